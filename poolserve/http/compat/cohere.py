"""Cohere's `POST /v2/embed`: its body into the service's embed request, embeddings by type out.

Shapes read from the `cohere` SDK 7.3.1 (`ClientV2.embed`, `EmbedInput`, `EmbedByTypeResponse`:
`id`, `embeddings` keyed by type, `texts`, `meta`, `response_type`) and Cohere's OpenAPI
(cohere-developer-experience `cohere-openapi.yaml`, `/v2/embed`); where Cohere leaves a rule
open (base64 bytes, text parts of one input, truncate NONE with max_tokens), vLLM's `/v2/embed`.
"""

from __future__ import annotations

import base64
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette.responses import Response

from poolserve.frontend.encoding import dumps, to_dtype_bytes
from poolserve.frontend.jobs import Requested, TextJob, Truncate
from poolserve.frontend.pipeline import check_serving, gather
from poolserve.frontend.state import ModelHandle
from poolserve.frontend.texts import check_batch_size
from poolserve.http.bodies import RequestBody
from poolserve.http.calls import answer, service_state, submit
from poolserve.http.routing import StrictJSONRoute
from poolserve.types.errors import InvalidRequestError
from poolserve.types.outputs import PoolingOutput
from poolserve.types.tasks import PoolingTask

logger = logging.getLogger(__name__)
router = APIRouter(route_class=StrictJSONRoute)

EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
InputType = Literal["search_document", "search_query", "classification", "clustering", "image"]
CohereTruncate = Literal["NONE", "START", "END"]
# Cohere's truncate -> the side whose tokens are kept (START discards the start).
KEPT_SIDE: dict[str, Literal["left", "right"]] = {"START": "left", "END": "right"}
# 8-bit types are cut from a fixed range: every component of a unit vector lies in [-1, 1].
UNIT_LOW, UNIT_HIGH = -1.0, 1.0
NUM_LEVELS = 255
# The text parts of one input become one text, joined as vLLM joins a message's text parts.
PART_SEPARATOR = "\n"


class TextContent(BaseModel):
    """One part of an `inputs` item; only text parts are served."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text", "image_url"]
    text: StrictStr | None = None
    image_url: dict[str, object] | None = None


class EmbedInput(BaseModel):
    """One `inputs` item: its content parts, embedded together as one input."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    content: list[TextContent]


class CohereEmbedRequest(RequestBody):
    """Cohere's v2 embed body (unknown fields accepted and named in a warning, as everywhere)."""

    model: StrictStr | None = None
    input_type: InputType | None = Field(
        None, description="Selects the model's query or document prompt (see docs/api.md)."
    )
    texts: list[StrictStr] | None = None
    images: list[StrictStr] | None = None
    inputs: list[EmbedInput] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    output_dimension: StrictInt | None = None
    embedding_types: list[EmbeddingType] | None = None
    truncate: CohereTruncate = "END"  # Cohere's default
    priority: Annotated[StrictInt, Field(ge=0, le=999)] = 0  # Cohere's range; 0 runs first


# The sentence-transformers prompt names each input_type may select, most specific first: a
# model whose config_sentence_transformers.json names its prompts after Cohere's input types, or
# the query/document names retrieval embedders (E5, BGE, Qwen3-Embedding, nomic) use.
PROMPTS_FOR_INPUT_TYPE: dict[str, tuple[str, ...]] = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage", "corpus"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}


def prompt_name_for(input_type: InputType | None, prompt_names: Sequence[str]) -> str | None:
    """The model's prompt an `input_type` selects; None leaves the model's default prompt."""
    for name in PROMPTS_FOR_INPUT_TYPE.get(input_type or "", ()):
        if name in prompt_names:
            return name
    return None


def _texts(body: CohereEmbedRequest, max_batch: int) -> tuple[str, list[str]]:
    """The field the texts came from and one text per input; images are refused."""
    if body.images or (body.input_type == "image" and not (body.texts or body.inputs)):
        raise InvalidRequestError("image embeddings are not served: send texts", "images")
    if (body.texts is None) == (body.inputs is None):
        raise InvalidRequestError("send exactly one of texts and inputs", "texts")
    field = "texts" if body.texts is not None else "inputs"
    count = len(body.texts if body.texts is not None else body.inputs or ())
    if not count:
        raise InvalidRequestError(f"{field} must not be empty", field)
    check_batch_size(count, max_batch, field)
    texts = body.texts or [_input_text(item, n) for n, item in enumerate(body.inputs or ())]
    if not all(texts):
        raise InvalidRequestError(f"{field} must not contain empty strings", field)
    return field, texts


def _input_text(item: EmbedInput, index: int) -> str:
    """One `inputs` item as one text: Cohere answers one embedding per input, whatever its parts."""
    if any(part.type != "text" for part in item.content):
        raise InvalidRequestError(
            f"inputs {index} has an image part: image embeddings are not served", "inputs"
        )
    parts = [part.text for part in item.content]
    if not parts or any(text is None for text in parts):
        raise InvalidRequestError(f"inputs {index} needs text parts with a text", "inputs")
    return PART_SEPARATOR.join(text or "" for text in parts)


def _truncate(body: CohereEmbedRequest, model: ModelHandle) -> tuple[Truncate, int | None]:
    """Cohere's `truncate` and `max_tokens` as the service's truncation, and the prompt length
    above which an input is refused (NONE with max_tokens, as vLLM's /v2/embed refuses it)."""
    tokens = body.max_tokens
    if tokens is not None and tokens <= len(model.specials):
        raise InvalidRequestError(
            f"max_tokens must be more than the {len(model.specials)} special tokens the model "
            "adds to every text",
            "max_tokens",
        )
    if tokens is not None and tokens >= model.max_model_len:
        tokens = None  # the model's own limit is the tighter one
    if body.truncate != "NONE":
        return Truncate(tokens or -1, KEPT_SIDE[body.truncate]), None
    if tokens is None:
        # over-long texts are refused, never cut (sentence-transformers' max_seq_length still is)
        return Truncate(auto=False), None
    # one token past max_tokens tells an input too long without tokenizing all of it
    return Truncate(tokens + 1, "right", auto=False), tokens


def _check_lengths(outputs: Sequence[PoolingOutput], limit: int | None, field: str) -> None:
    """400 for an input over max_tokens when truncate NONE forbids cutting it."""
    if limit is None:
        return
    for index, output in enumerate(outputs):
        if output.num_prompt_tokens > limit:
            raise InvalidRequestError(
                f"{field} {index} has more than max_tokens ({limit}) tokens and truncate NONE "
                "forbids cutting it: use START or END",
                "max_tokens",
            )


@router.post("/v2/embed")
async def embed(body: CohereEmbedRequest, request: Request) -> Response:
    """Cohere v2 embed: one embed job through the engine, answered by type."""
    state = service_state(request)
    # the model named (the default when none is); a name the server does not serve is a 404
    # (Cohere and vLLM refuse it too): another model's vectors would silently mix spaces;
    # --served-model-name adds the name a client sends
    _, model = check_serving(state, body.model)
    field, texts = _texts(body, model.settings.max_client_batch_size)
    kinds = list(dict.fromkeys(body.embedding_types or ["float"]))  # in order, once each
    truncate, limit = _truncate(body, model)
    job = TextJob(
        PoolingTask.EMBED,
        texts,
        requested=Requested(dimensions=body.output_dimension),
        model=body.model,
        prompt_name=prompt_name_for(body.input_type, model.prompts.names),
        truncate=truncate,
        priority=body.priority,
    )
    run = await submit(request, job)
    outputs = await gather(run)
    _check_lengths(outputs, limit, field)
    return await answer(
        request, outputs, lambda: _encode(texts, kinds, outputs, run.num_prompt_tokens)
    )


def _encode(
    texts: list[str], kinds: Sequence[str], outputs: list[PoolingOutput], num_tokens: int
) -> bytes:
    """`EmbedByTypeResponse` with one matrix per requested type."""
    floats = np.stack([np.asarray(o.data, dtype=np.float32) for o in outputs])  # [n, dim]
    units = {"input_tokens": num_tokens}
    return dumps(
        {
            "id": str(uuid.uuid4()),
            "embeddings": {kind: QUANTIZERS[kind](floats) for kind in kinds},
            "texts": texts,
            "meta": {"api_version": {"version": "2"}, "billed_units": units, "tokens": units},
            "response_type": "embeddings_by_type",
        }
    )


def _levels(floats: np.ndarray) -> np.ndarray:
    """Each component of the unit-length vector as one of 256 levels over [-1, 1].

    sentence-transformers' `quantize_embeddings` rule with the fixed range [-1, 1] in every
    dimension, so a text's bytes never depend on what else is in the request.
    """
    norms = np.linalg.norm(floats, axis=-1, keepdims=True)  # [n, 1]
    units = floats / np.where(norms == 0, 1, norms)
    step = np.float32((UNIT_HIGH - UNIT_LOW) / NUM_LEVELS)
    return np.clip(np.floor((units - np.float32(UNIT_LOW)) / step), 0, NUM_LEVELS)  # [n, dim]


def _bits(floats: np.ndarray) -> np.ndarray:
    """One bit per component (1 where it is positive), packed 8 to a byte, first bit highest."""
    return np.packbits(floats > 0, axis=-1)  # [n, ceil(dim / 8)] uint8


def _base64(floats: np.ndarray) -> list[str]:
    """Each float embedding's bytes (little-endian float32, as vLLM's /v2/embed) in base64."""
    return [
        base64.b64encode(to_dtype_bytes(row, "float32", "little")).decode("ascii") for row in floats
    ]


QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray | list[str]]] = {
    "float": lambda floats: floats,
    "uint8": lambda floats: _levels(floats).astype(np.uint8),
    "int8": lambda floats: (_levels(floats) - 128).astype(np.int8),
    "ubinary": _bits,
    "binary": lambda floats: (_bits(floats).astype(np.int16) - 128).astype(np.int8),
    "base64": _base64,
}

"""Cohere's `POST /v2/embed`: its body into the service's embed request, embeddings by type out.

Shapes read from the `cohere` SDK's v2 client (the `embed` request fields and
`EmbedByTypeResponse`: `id`, `embeddings` keyed by type, `texts`, `meta`, `response_type`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette.responses import Response

from poolserve.pooling.params import PoolingTask
from poolserve.scheduler.request import PoolingOutput
from poolserve.service.errors import InvalidRequestError
from poolserve.service.frontend.bodies import RequestBody
from poolserve.service.frontend.encoding import StrictJSONRoute, answer, dumps
from poolserve.service.frontend.jobs import Requested, TextJob, Truncate
from poolserve.service.frontend.pipeline import check_serving, gather, service_state, submit
from poolserve.service.frontend.texts import check_batch_size

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


class TextContent(BaseModel):
    """One part of an `inputs` item; only text parts are served."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text", "image_url"]
    text: StrictStr | None = None
    image_url: dict[str, object] | None = None


class EmbedInput(BaseModel):
    """One `inputs` item: its content parts."""

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
    priority: StrictInt = 0


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


def _texts(body: CohereEmbedRequest, max_batch: int) -> list[str]:
    """The texts to embed, from `texts` or text-only `inputs`; images are refused."""
    if body.images or (body.input_type == "image" and not (body.texts or body.inputs)):
        raise InvalidRequestError("image embeddings are not served: send texts", "images")
    if (body.texts is None) == (body.inputs is None):
        raise InvalidRequestError("send exactly one of texts and inputs", "texts")
    field = "texts" if body.texts is not None else "inputs"
    texts = body.texts if body.texts is not None else [_input_text(i) for i in body.inputs or ()]
    if not texts:
        raise InvalidRequestError(f"{field} must not be empty", field)
    check_batch_size(len(texts), max_batch, field)
    if not all(texts):
        raise InvalidRequestError(f"{field} must not contain empty strings", field)
    return texts


def _input_text(item: EmbedInput) -> str:
    """An `inputs` item made of exactly one text part."""
    if len(item.content) != 1 or item.content[0].type != "text" or item.content[0].text is None:
        raise InvalidRequestError(
            "each inputs item must hold exactly one text part: image parts are not served",
            "inputs",
        )
    return item.content[0].text


def _embedding_types(body: CohereEmbedRequest) -> list[str]:
    """The requested types in order, once each (float when none is named)."""
    kinds = list(dict.fromkeys(body.embedding_types or ["float"]))
    if "base64" in kinds:
        # the SDK documents "the float embedding bytes" but not their width or byte order
        raise InvalidRequestError(
            "embedding type base64 is not served (its byte layout is unspecified): use float",
            "embedding_types",
        )
    return kinds


def _truncate(body: CohereEmbedRequest) -> Truncate:
    """Cohere's `truncate` and `max_tokens` as the service's truncation."""
    if body.truncate == "NONE":
        if body.max_tokens is not None:
            raise InvalidRequestError(
                "max_tokens cuts texts, which truncate NONE forbids: use START or END",
                "max_tokens",
            )
        # the service's default: sentence-transformers' max_seq_length, else refuse long texts
        return Truncate()
    return Truncate(body.max_tokens or -1, KEPT_SIDE[body.truncate])


@router.post("/v2/embed")
async def embed(body: CohereEmbedRequest, request: Request) -> Response:
    """Cohere v2 embed: one embed job through the engine, answered by type."""
    state = service_state(request)
    _, model = check_serving(state, body.model)
    texts = _texts(body, state.settings.max_client_batch_size)
    kinds = _embedding_types(body)
    job = TextJob(
        PoolingTask.EMBED,
        texts,
        requested=Requested(dimensions=body.output_dimension),
        model=body.model,
        prompt_name=prompt_name_for(body.input_type, model.prompts.names),
        truncate=_truncate(body),
        priority=body.priority,
    )
    run = await submit(request, job)
    outputs = await gather(request, run)
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


QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "float": lambda floats: floats,
    "uint8": lambda floats: _levels(floats).astype(np.uint8),
    "int8": lambda floats: (_levels(floats) - 128).astype(np.int8),
    "ubinary": _bits,
    "binary": lambda floats: (_bits(floats).astype(np.int16) - 128).astype(np.int8),
}

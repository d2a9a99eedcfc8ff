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
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette.responses import Response

from poolserve.frontend.encoding import dumps, to_dtype_bytes
from poolserve.frontend.jobs import Chat, MediaItem, MediaJob, Requested, TextJob, Truncate
from poolserve.frontend.pipeline import check_serving, gather
from poolserve.frontend.quantize import PRECISIONS, quantize
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
# The text parts of one input become one text, joined as vLLM joins a message's text parts.
PART_SEPARATOR = "\n"


class TextContent(BaseModel):
    """One part of an `inputs` item: a text, or an image (`image_url`: {"url": ...})."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text", "image_url"]
    text: StrictStr | None = None
    image_url: dict[str, object] | None = None


class EmbedInput(BaseModel):
    """One `inputs` item: its content parts, embedded together as one input."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    content: list[TextContent]


class CohereEmbedRequest(RequestBody):
    """Cohere's v2 embed body (unknown fields accepted and named in a warning, as everywhere;
    other APIs' names for Cohere's own choices refused)."""

    foreign_fields: ClassVar[Mapping[str, str]] = {
        "dimensions": "OpenAI's and not honoured on /v2/embed: send output_dimension",
        "truncate_prompt_tokens": "vLLM's and not honoured on /v2/embed: send max_tokens",
        "encoding_format": "OpenAI's and not honoured on /v2/embed: send embedding_types",
    }

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


def _media(body: CohereEmbedRequest, max_batch: int) -> tuple[str, list[MediaItem]] | None:
    """The field and the inputs as images and texts when any input is an image (a model that
    takes images answers it; any other refuses it); None: texts only."""
    if body.images is not None:
        if body.texts is not None or body.inputs is not None:
            raise InvalidRequestError("send exactly one of texts, images and inputs", "images")
        if not body.images:
            raise InvalidRequestError("images must not be empty", "images")
        check_batch_size(len(body.images), max_batch, "images")
        return "images", [
            MediaItem(image=url, where=f"images[{i}]") for i, url in enumerate(body.images)
        ]
    items = body.inputs or []
    if not any(part.type == "image_url" for item in items for part in item.content):
        return None
    check_batch_size(len(items), max_batch, "inputs")
    return "inputs", [_input_item(item, n) for n, item in enumerate(items)]


def _input_item(item: EmbedInput, index: int) -> MediaItem:
    """One `inputs` item: its image (one image part alone), its text parts as one text, or,
    texts and images together, one conversation of its parts in order (a vision-language model
    embeds it whole; a dual encoder refuses it)."""
    where = f"inputs[{index}]"
    if not any(part.type == "image_url" for part in item.content):
        return MediaItem(text=_input_text(item, index), where=where)
    parts = [_part(part, f"{where}.content[{k}]") for k, part in enumerate(item.content)]
    wheres = tuple(
        f"{where}.content[{k}]" for k, part in enumerate(item.content) if part.type == "image_url"
    )
    if len(parts) == 1:
        return MediaItem(image=parts[0]["image_url"]["url"], where=wheres[0])
    chat = Chat(({"role": "user", "content": parts},))
    return MediaItem(where=where, chat=chat, image_wheres=wheres)


def _part(part: TextContent, where: str) -> dict[str, Any]:
    """A content part as a chat template reads it (OpenAI's shape)."""
    if part.type == "text":
        if part.text is None:
            raise InvalidRequestError(f"{where}: a text part needs its text", "inputs")
        return {"type": "text", "text": part.text}
    url = part.image_url.get("url") if part.image_url else None
    if not isinstance(url, str):
        raise InvalidRequestError(
            f"{where}: an image_url part holds its image as {{'url': ...}}", "inputs"
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _texts(body: CohereEmbedRequest, max_batch: int) -> tuple[str, list[str]]:
    """The field the texts came from and one text per input."""
    if body.input_type == "image" and not (body.texts or body.inputs):
        raise InvalidRequestError("input_type 'image' needs images", "images")
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
    kinds = list(dict.fromkeys(body.embedding_types or ["float"]))  # in order, once each
    truncate, limit = _truncate(body, model)
    requested = Requested(dimensions=body.output_dimension)
    media = _media(body, model.settings.max_client_batch_size)
    job: TextJob | MediaJob
    texts: list[str] | None
    if media is not None:
        field, items = media
        texts = None  # Cohere's answer lists the texts of a text request only
        job = MediaJob(
            PoolingTask.EMBED, tuple(items), requested, body.model, truncate, body.priority
        )
    else:
        field, texts = _texts(body, model.settings.max_client_batch_size)
        job = TextJob(
            PoolingTask.EMBED,
            texts,
            requested=requested,
            model=body.model,
            input_type=body.input_type,
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
    texts: list[str] | None, kinds: Sequence[str], outputs: list[PoolingOutput], num_tokens: int
) -> bytes:
    """`EmbedByTypeResponse` with one matrix per requested type (`texts` for texts only)."""
    floats = np.stack([np.asarray(o.data, dtype=np.float32) for o in outputs])  # [n, dim]
    units = {"input_tokens": num_tokens}
    listed = {} if texts is None else {"texts": texts}
    return dumps(
        {
            "id": str(uuid.uuid4()),
            "embeddings": {kind: ENCODERS[kind](floats) for kind in kinds},
            **listed,
            "meta": {"api_version": {"version": "2"}, "billed_units": units, "tokens": units},
            "response_type": "embeddings_by_type",
        }
    )


def _base64(floats: np.ndarray) -> list[str]:
    """Each float embedding's bytes (little-endian float32, as vLLM's /v2/embed) in base64."""
    return [
        base64.b64encode(to_dtype_bytes(row, "float32", "little")).decode("ascii") for row in floats
    ]


# each embedding type's matrix: sentence-transformers' quantization rules (frontend/quantize.py)
ENCODERS: dict[str, Callable[[np.ndarray], np.ndarray | list[str]]] = {
    **{precision: partial(quantize, precision=precision) for precision in PRECISIONS},
    "base64": _base64,
}

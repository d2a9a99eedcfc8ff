"""Infinity's `POST /embeddings`, `GET /models` and the body of its `POST /rerank`.

Shapes read from Infinity 0.0.77 (michaelfeil/infinity fcb951c): its server (`infinity_server.py`)
and its pydantic models (`fastapi_schemas/pymodels.py`: the OpenAI-like embedding input with
`modality`, `OpenAIEmbeddingResult`, `ModelInfo`, `RerankInput`, `ReRankResult`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import Field, StrictInt, StrictStr, StringConstraints
from starlette.responses import Response

from poolserve.frontend.encoding import document, dumps, encode_item
from poolserve.frontend.jobs import MediaItem, MediaJob, ScoreJob, TextJob
from poolserve.frontend.pipeline import check_serving, gather
from poolserve.frontend.state import ModelHandle, ServiceState
from poolserve.frontend.texts import check_batch_size
from poolserve.http.bodies import MODE_WEIGHTS_FOREIGN, RequestBody
from poolserve.http.calls import answer, score, service_state, submit
from poolserve.http.routing import StrictJSONRoute
from poolserve.http.visible import seen_models, tenant_of
from poolserve.types.errors import InvalidRequestError
from poolserve.types.outputs import PoolingOutput
from poolserve.types.stats import EngineSnapshot
from poolserve.types.tasks import CAPABILITIES, PoolingTask

router = APIRouter(route_class=StrictJSONRoute)
# Infinity's capability of a model that embeds images
IMAGE_CAPABILITY = "image_embed"
# What Infinity's clients send when no model is named; with one model Infinity takes any name.
UNNAMED_MODEL = "default/not-specified"
# Infinity strips each input text before embedding it; the same text must give the same vector.
InfinityText = Annotated[StrictStr, StringConstraints(strip_whitespace=True)]


class InfinityEmbeddingRequest(RequestBody):
    """Infinity's embeddings body: OpenAI's fields plus `modality` (text, or image: each input
    an image's URL or data URI)."""

    input: InfinityText | list[InfinityText]
    model: StrictStr = UNNAMED_MODEL
    encoding_format: Literal["float", "base64"] = "float"
    user: StrictStr | None = None
    dimensions: StrictInt = Field(0, description="The first N of the embedding; 0 keeps all.")
    modality: Literal["text", "image", "audio"] = "text"


class InfinityRerankRequest(RequestBody):
    """Infinity's rerank body (told apart from vLLM's and Cohere's by `raw_scores`)."""

    foreign_fields = MODE_WEIGHTS_FOREIGN
    query: InfinityText
    documents: list[InfinityText]
    return_documents: bool = False
    raw_scores: bool = Field(False, description="The raw logit instead of the activation.")
    model: StrictStr = UNNAMED_MODEL
    top_n: Annotated[StrictInt, Field(gt=0)] | None = None


@router.post("/embeddings")
async def embeddings(body: InfinityEmbeddingRequest, request: Request) -> Response:
    """Infinity's text embeddings, answered as `OpenAIEmbeddingResult`."""
    if body.modality == "audio":
        raise InvalidRequestError(
            "modality 'audio' is not served: this server embeds texts and images", "modality"
        )
    name = _routed_name(service_state(request), body.model)
    engine, model = check_serving(service_state(request), name)
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise InvalidRequestError("input must not be empty", "input")
    check_batch_size(len(texts), model.settings.max_client_batch_size, "input")
    width = _cut(body.dimensions, model.defaults.dimensions or engine.pooling_info.embedding_size)
    takes_images = model.card.images is not None or model.card.inline_images is not None
    if body.modality == "image" and not takes_images:
        raise InvalidRequestError(
            f"modality 'image' is not served by model {model.served_name!r}: it embeds text",
            "modality",
        )
    if body.modality == "image":  # each input an image's URL or data URI, as Infinity takes
        images = tuple(MediaItem(image=url, where=f"input[{i}]") for i, url in enumerate(texts))
        run = await submit(request, MediaJob(PoolingTask.EMBED, images, model=name))
        outputs, num_tokens = await gather(run), run.num_prompt_tokens
    else:
        outputs, num_tokens = await _embed(request, texts, model, name)
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    fields = {
        "object": "list",
        "model": model.served_name,
        "usage": usage,
        "id": f"infinity-{uuid.uuid4()}",
        "created": int(time.time()),
    }

    def encode() -> bytes:
        fmt = body.encoding_format
        items = (
            encode_item({"object": "embedding", "index": i}, "embedding", o.data[:width], fmt)
            for i, o in enumerate(outputs)
        )
        return document(fields, "data", items)

    return await answer(request, outputs, encode)


def _cut(dimensions: int, size: int) -> int | None:
    """Infinity's Matryoshka cut on any model: the first N of the full normalized embedding,
    not normalized again (0: all of it); checked before any work, Infinity checks after."""
    if dimensions == 0:
        return None
    if not 1 <= dimensions <= size:
        raise InvalidRequestError(
            f"dimensions must be between 1 and the embedding size {size}, or 0 for all of it; "
            f"got {dimensions}",
            "dimensions",
        )
    return dimensions


def _routed_name(state: ServiceState, name: str) -> str | None:
    """The `model` a job names, by Infinity's rule: its clients' placeholder is the default
    model, and with one model served any name is that model; with several, an unknown name is a
    404 (Infinity itself answers 400)."""
    return None if name == UNNAMED_MODEL or len(state.models) == 1 else name


async def _embed(
    request: Request, texts: list[str], model: ModelHandle, name: str | None
) -> tuple[list[PoolingOutput], int]:
    """Each text's embedding and the prompt tokens, Infinity's way: no sentence-transformers
    prompt (it tokenizes texts as they are), and "" embedded as the special tokens alone.

    The front end refuses empty texts, so their prompts (the tokenizer's specials, what it
    gives for "") go as token ids in a second job; both run through the one pipeline.
    """
    empty = [i for i, text in enumerate(texts) if not text]
    full = [i for i, text in enumerate(texts) if text]
    specials = [*model.specials.prefix, *model.specials.suffix]
    if empty and not specials:
        raise InvalidRequestError(
            f"input {empty[0]} is empty and this model adds no special tokens: nothing to embed",
            "input",
        )
    jobs = (
        (full, TextJob(PoolingTask.EMBED, [texts[i] for i in full], model=name, prompt="")),
        (empty, TextJob(PoolingTask.EMBED, [specials] * len(empty), model=name)),
    )
    outputs: dict[int, PoolingOutput] = {}
    num_tokens = 0
    for indices, job in jobs:
        if indices:
            run = await submit(request, job)
            outputs.update(zip(indices, await gather(run), strict=True))
            num_tokens += run.num_prompt_tokens
    return [outputs[i] for i in range(len(texts))], num_tokens


@router.get("/models")
async def models(request: Request) -> Response:
    """Every served model the request's key may use as Infinity's `OpenAIModelInfo`: its
    `ModelInfo` fields only."""
    state = service_state(request)
    check_serving(state, None)
    listed = seen_models(tenant_of(request), state)
    snapshots = await asyncio.gather(*(served.engine.snapshot() for served in listed))
    pairs = zip(listed, snapshots, strict=True)
    cards = [_card(served.handle, snapshot) for served, snapshot in pairs]
    body = dumps({"data": cards, "object": "list"})
    return Response(body, media_type="application/json")


def _card(model: ModelHandle, snapshot: EngineSnapshot) -> dict[str, object]:
    """One model's `ModelInfo`, its queue as its engine reports it."""
    limit = model.settings.max_num_queued_requests
    tasks = model.card.supported_tasks
    return {
        "id": model.served_name,
        "stats": {
            "queue_fraction": snapshot.num_waiting / limit if limit else 0.0,
            "queue_absolute": snapshot.num_waiting,
            "results_pending": snapshot.num_running,
            "batch_size": model.settings.max_num_seqs,
        },
        "object": "model",
        # Infinity's client parses owned_by as an enum whose only member is "infinity"
        "owned_by": "infinity",
        "created": int(time.time()),
        "backend": "torch",
        "capabilities": sorted(
            {CAPABILITIES[t] for t in tasks if t in CAPABILITIES}
            | ({IMAGE_CAPABILITY} if model.card.takes_images else set())
        ),
    }


async def rerank(body: InfinityRerankRequest, request: Request) -> Response:
    """Infinity's `ReRankResult`: best first (ties in input order), `top_n` of them."""
    job = ScoreJob.one_query(
        body.query,
        body.documents,
        "documents",
        model=_routed_name(service_state(request), body.model),
        use_activation=not body.raw_scores,
    )
    scored = await score(request, job)
    scores = scored.scores
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    # `document` is null unless asked: Infinity's response model always writes the field
    results = [
        {
            "relevance_score": scores[i],
            "index": i,
            "document": body.documents[i] if body.return_documents else None,
        }
        for i in order
    ]
    reply = {
        "object": "rerank",
        "results": results,
        "model": scored.model_name,
        "usage": {
            "prompt_tokens": scored.num_prompt_tokens,
            "total_tokens": scored.num_prompt_tokens,
        },
        "id": f"infinity-{uuid.uuid4()}",
        "created": int(time.time()),
    }
    return await answer(request, scored.outputs, lambda: dumps(reply))

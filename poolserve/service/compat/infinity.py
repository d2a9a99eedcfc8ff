"""Infinity's `POST /embeddings`, `GET /models` and the body of its `POST /rerank`.

Shapes read from Infinity's server (`infinity_server.py`) and its pydantic models
(`fastapi_schemas/pymodels.py`: the OpenAI-like embedding input with `modality`,
`OpenAIEmbeddingResult`, `ModelInfo`, `RerankInput`, `ReRankResult`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import Field, StrictInt, StrictStr, StringConstraints
from starlette.responses import Response

from poolserve.pooling.params import PoolingTask
from poolserve.service.errors import InvalidRequestError
from poolserve.service.frontend.bodies import RequestBody
from poolserve.service.frontend.encoding import (
    StrictJSONRoute,
    answer,
    document,
    dumps,
    encode_item,
)
from poolserve.service.frontend.jobs import Requested, ScoreJob, TextJob
from poolserve.service.frontend.pipeline import check_serving, gather, service_state, submit
from poolserve.service.frontend.scoring import score

router = APIRouter(route_class=StrictJSONRoute)
# What Infinity's clients send when no model is named.
UNNAMED_MODEL = "default/not-specified"
# Infinity strips each input text before embedding it; the same text must give the same vector.
InfinityText = Annotated[StrictStr, StringConstraints(strip_whitespace=True)]
# Our tasks under Infinity's capability names.
CAPABILITIES: dict[PoolingTask, str] = {
    PoolingTask.EMBED: "embed",
    PoolingTask.CLASSIFY: "classify",
    PoolingTask.SCORE: "rerank",
}


class InfinityEmbeddingRequest(RequestBody):
    """Infinity's embeddings body: OpenAI's fields plus `modality` (text only here)."""

    input: InfinityText | list[InfinityText]
    model: StrictStr = UNNAMED_MODEL
    encoding_format: Literal["float", "base64"] = "float"
    user: StrictStr | None = None
    dimensions: StrictInt = Field(0, description="Matryoshka dimensions; 0 keeps them all.")
    modality: Literal["text", "image", "audio"] = "text"


class InfinityRerankRequest(RequestBody):
    """Infinity's rerank body (told apart from vLLM's and Cohere's by `raw_scores`)."""

    query: InfinityText
    documents: list[InfinityText]
    return_documents: bool = False
    raw_scores: bool = Field(False, description="The raw logit instead of the activation.")
    model: StrictStr = UNNAMED_MODEL
    top_n: Annotated[StrictInt, Field(gt=0)] | None = None


def _model_name(model: str) -> str | None:
    """The model a request names; Infinity's placeholder names none."""
    return None if model == UNNAMED_MODEL else model


@router.post("/embeddings")
async def embeddings(body: InfinityEmbeddingRequest, request: Request) -> Response:
    """Infinity's text embeddings, answered as `OpenAIEmbeddingResult`."""
    if body.modality != "text":
        raise InvalidRequestError(
            f"modality {body.modality!r} is not served: this server embeds text", "modality"
        )
    job = TextJob(
        PoolingTask.EMBED,
        body.input,
        # Infinity's 0 keeps every dimension: the request sets none
        requested=Requested(dimensions=body.dimensions or None),
        model=_model_name(body.model),
    )
    run = await submit(request, job)
    outputs = await gather(request, run)
    usage = {"prompt_tokens": run.num_prompt_tokens, "total_tokens": run.num_prompt_tokens}
    fields = {
        "object": "list",
        "model": run.model.served_name,
        "usage": usage,
        "id": f"infinity-{uuid.uuid4()}",
        "created": int(time.time()),
    }

    def encode() -> bytes:
        fmt = body.encoding_format
        items = (
            encode_item({"object": "embedding", "index": i}, "embedding", o.data, fmt)
            for i, o in enumerate(outputs)
        )
        return document(fields, "data", items)

    return await answer(request, outputs, encode)


@router.get("/models")
async def models(request: Request) -> Response:
    """The served model as Infinity's `OpenAIModelInfo`."""
    state = service_state(request)
    engine, model = check_serving(state, None)
    snapshot = engine.snapshot()
    limit = state.settings.max_num_queued_requests
    card = {
        "id": model.served_name,
        "stats": {
            "queue_fraction": snapshot.num_waiting / limit if limit else 0.0,
            "queue_absolute": snapshot.num_waiting,
            "results_pending": snapshot.num_running,
            "batch_size": state.settings.max_num_seqs,
        },
        "object": "model",
        # Infinity's client parses owned_by as an enum whose only member is "infinity"
        "owned_by": "infinity",
        "created": int(time.time()),
        "backend": "torch",
        "capabilities": sorted(CAPABILITIES[t] for t in state.supported_tasks if t in CAPABILITIES),
        "embedding_dtype": "float32",
        "dtype": state.dtype,
        "device": state.device,
    }
    body = dumps({"data": [card], "object": "list"})
    return Response(body, media_type="application/json")


async def rerank(body: InfinityRerankRequest, request: Request) -> Response:
    """Infinity's `ReRankResult`: best first (ties in input order), `top_n` of them."""
    job = ScoreJob.one_query(
        body.query,
        body.documents,
        "documents",
        model=_model_name(body.model),
        use_activation=not body.raw_scores,
    )
    scored = await score(request, job)
    scores = scored.scores
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    results = [
        {"relevance_score": scores[i], "index": i, "document": body.documents[i]}
        if body.return_documents
        else {"relevance_score": scores[i], "index": i}
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

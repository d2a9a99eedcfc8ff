"""TEI's `POST /`: the model's main task, which huggingface_hub's InferenceClient calls.

TEI picks the handler by model type (and a TASK variable for similarity); here the body decides
where it can (`query` + `texts`: rerank; `inputs.source_sentence`: similarity), else the model's
first task: embed, classify (predict), sparse embed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from pydantic import BaseModel
from starlette.responses import Response

from poolserve.pooling.params import PoolingTask
from poolserve.service import routes_retrieval
from poolserve.service.compat import tei_embed, tei_predict, tei_sparse
from poolserve.service.compat.tei_common import body_schema, validated
from poolserve.service.encoding import StrictJSONRoute
from poolserve.service.errors import InvalidRequestError
from poolserve.service.runs import check_serving, service_state

router = APIRouter(route_class=StrictJSONRoute)
Handler = Callable[[Any, Request], Awaitable[Response]]
# the model's main task -> (TEI body, handler), first supported wins
MAIN_TASKS: tuple[tuple[PoolingTask, type[BaseModel], Handler], ...] = (
    (PoolingTask.EMBED, tei_embed.EmbedRequest, tei_embed.embed),
    (PoolingTask.CLASSIFY, tei_predict.PredictRequest, tei_predict.predict),
    (PoolingTask.EMBED_SPARSE, tei_sparse.EmbedSparseRequest, tei_sparse.embed_sparse),
)


@router.post(
    "/",
    # the flat bodies only: a nested model's $defs would not resolve inside an inline schema
    openapi_extra=body_schema(tei_embed.EmbedRequest, tei_predict.PredictRequest),
)
async def main_task(payload: Annotated[dict[str, Any], Body()], request: Request) -> Response:
    """The body's route when its shape says, else the model's main task."""
    if "query" in payload and "texts" in payload:
        return await routes_retrieval.rerank_any(payload, request)
    if isinstance(payload.get("inputs"), dict):
        body = validated(tei_embed.SimilarityRequest, payload)
        return await tei_embed.similarity(body, request)
    state = service_state(request)
    check_serving(state, None)
    for task, model, handler in MAIN_TASKS:
        if task in state.supported_tasks:
            return await handler(validated(model, payload), request)
    supported = ", ".join(t.value for t in state.supported_tasks)
    raise InvalidRequestError(
        f"POST / serves embed, classify or embed_sparse models; this model serves {supported}",
        None,
    )

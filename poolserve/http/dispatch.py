"""Paths two client families share: the body's shape picks the family's handler.

`POST /` is TEI's main route (huggingface_hub's InferenceClient calls it): the body decides where
it can (`query` + `texts`: rerank; `inputs.source_sentence`: similarity), else the model's first
task among sparse embed (an MLM head is SPLADE), embed and classify (predict), as TEI picks by
model type (the default model's: TEI's routes name no model); its errors answer in TEI's
shape.
`POST /rerank` takes vLLM's, TEI's (`texts`) and Infinity's (`raw_scores`) bodies, and
`POST /tokenize` vLLM's (`prompt`) and TEI's (`inputs`). SageMaker's `POST /invocations` goes,
as vLLM routes it, to the first of embeddings, classify, score, rerank and pooling that the
model serves and whose body it is; its `GET|POST /ping` is the readiness probe. Only the app
factory imports this module; native routes and compat translators never import each other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from poolserve.frontend.pipeline import check_serving
from poolserve.frontend.state import ModelHandle
from poolserve.frontend.texts import check_batch_size
from poolserve.http.api import admin, inference, retrieval
from poolserve.http.api.schemas import (
    ClassifyRequest,
    EmbeddingRequest,
    PoolingRequestBody,
    RerankRequestBody,
    ScoreRequestBody,
    TokenizeRequest,
)
from poolserve.http.bodies import QUIET
from poolserve.http.calls import service_state
from poolserve.http.compat import infinity, tei_embed, tei_predict, tei_rerank, tei_tokens
from poolserve.http.compat.tei_common import TEIRoute, mark
from poolserve.http.routing import StrictJSONRoute
from poolserve.types.errors import InvalidRequestError, UnsupportedTaskError
from poolserve.types.scoring import scorer_plan
from poolserve.types.tasks import SPARSE_MAIN_HEADS, PoolingTask

router = APIRouter(route_class=StrictJSONRoute)
# paths where a TEI body is answered (errors included) in TEI's shape, beside other families'
SHARED_WITH_TEI = frozenset({"/rerank", "/tokenize"})
B = TypeVar("B", bound=BaseModel)
Handler = Callable[[Any, Request], Awaitable[Response]]
Payload = Annotated[dict[str, Any], Body()]


def validated(model: type[B], payload: dict[str, Any]) -> B:
    """The body as `model`; its problems answer 400 through the usual validation handler."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False), body=payload) from None


def body_schema(*models: type[BaseModel]) -> dict[str, Any]:
    """An OpenAPI request body that is any one of the models, each schema self-contained: a
    nested model's `$defs` entry is written in place (`#/$defs/...` would be read from the
    OpenAPI document's root, where it is not)."""
    schemas = [_inlined(m.model_json_schema()) for m in models]
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"anyOf": schemas}}},
        }
    }


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every `$ref` to its own `$defs` replaced by the definition (the bodies'
    models are not recursive); a discriminator keeps its property, its mapping of refs goes."""
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            if "discriminator" in node:
                node = {
                    **node,
                    "discriminator": {"propertyName": node["discriminator"]["propertyName"]},
                }
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    resolved: dict[str, Any] = resolve(schema)
    return resolved


RERANK_BODIES = (RerankRequestBody, tei_rerank.TEIRerankRequest, infinity.InfinityRerankRequest)


@router.post("/rerank", openapi_extra=body_schema(*RERANK_BODIES))
async def rerank(payload: Payload, request: Request) -> Response:
    """vLLM/Jina/Cohere rerank; TEI's when the body has `texts`, Infinity's with `raw_scores`."""
    if "texts" in payload and "documents" not in payload:
        mark(request)  # TEI's body: its errors, validation included, in TEI's shape
        return await tei_rerank.rerank(validated(tei_rerank.TEIRerankRequest, payload), request)
    if "raw_scores" in payload:  # Infinity's clients always send it; vLLM's body has no such field
        return await infinity.rerank(validated(infinity.InfinityRerankRequest, payload), request)
    return await retrieval.rerank(validated(RerankRequestBody, payload), request)


@router.post("/tokenize", openapi_extra=body_schema(TokenizeRequest, tei_tokens.TokenizeRequest))
async def tokenize(payload: Payload, request: Request) -> Response:
    """vLLM's tokenize (`prompt`), or TEI's when the body has `inputs`."""
    if "inputs" in payload and "prompt" not in payload:
        mark(request)  # TEI's body: its errors, validation included, in TEI's shape
        return await tei_tokens.tokenize(validated(tei_tokens.TokenizeRequest, payload), request)
    return await admin.tokenize(validated(TokenizeRequest, payload), request)


# the model's main task -> (TEI body, handler), first supported wins; a model with an MLM head
# answers sparse, as TEI serves a `*ForMaskedLM` under `--pooling splade`
MAIN_TASKS: tuple[tuple[PoolingTask, type[BaseModel], Handler], ...] = (
    (PoolingTask.EMBED_SPARSE, tei_embed.EmbedSparseRequest, tei_embed.embed_sparse),
    (PoolingTask.EMBED, tei_embed.EmbedRequest, tei_embed.embed),
    (PoolingTask.CLASSIFY, tei_predict.PredictRequest, tei_predict.predict),
)


async def main_task(payload: Payload, request: Request) -> Response:
    """The body's route when its shape says, else the model's main task."""
    if "query" in payload and "texts" in payload:
        return await rerank(payload, request)
    if isinstance(payload.get("inputs"), dict):
        body = validated(tei_embed.SimilarityRequest, payload)
        return await tei_embed.similarity(body, request)
    _, served = check_serving(service_state(request), None)  # TEI's routes: the default model
    model, handler = _main(served, "POST /")
    return await handler(validated(model, payload), request)


def _main(served: ModelHandle, route: str) -> tuple[type[BaseModel], Handler]:
    """The TEI body and handler of the model's main task (`route` names who asks, when none)."""
    tasks = served.card.supported_tasks
    if served.card.pooling_info.head_kind not in SPARSE_MAIN_HEADS:
        tasks -= {PoolingTask.EMBED_SPARSE}  # bge-m3's main output is its dense vector
    for task, model, handler in MAIN_TASKS:
        if task in tasks:
            return model, handler
    supported = ", ".join(t.value for t in served.supported_tasks)
    raise InvalidRequestError(
        f"{route} serves embed, classify or embed_sparse models; this model serves {supported}",
        None,
        "unsupported_task",
    )


# TEI's route only: its errors, body errors included, answer in TEI's shape
router.add_api_route(
    "/",
    main_task,
    methods=["POST"],
    route_class_override=TEIRoute,
    # the flat bodies only: a nested model's $defs would not resolve inside an inline schema
    openapi_extra=body_schema(tei_embed.EmbedRequest, tei_predict.PredictRequest),
)


def _serves(task: PoolingTask) -> Callable[[ModelHandle], bool]:
    return lambda model: task in model.card.supported_tasks


def _scores(model: ModelHandle) -> bool:
    try:
        scorer_plan(model.card.pooling_info)
    except UnsupportedTaskError:
        return False
    return True


# SageMaker's name of the adapter an invocation is for (AWS's model-hosting-container-standards,
# which vLLM's /invocations applies): it replaces the body's `model`. No SageMaker header names
# the route of a POST /invocations (Model-Invocation-Path is the bidirectional stream's).
ADAPTER_HEADER = "x-amzn-sagemaker-adapter-identifier"
# Only the pooling body names a task: a body with one is no other route's, although those accept
# unknown fields (vLLM would answer it as embeddings, silently dropping the task).
TASK_FIELD = "task"
# SageMaker's /invocations, vLLM's order: (whether the model serves the route, vLLM's name of
# the body in its error message, the body, the route); the first served whose body it is wins
INVOCATIONS: tuple[tuple[Callable[[ModelHandle], bool], str, type[BaseModel], Handler], ...] = (
    (_serves(PoolingTask.EMBED), "EmbeddingRequest", EmbeddingRequest, inference.embeddings),
    (_serves(PoolingTask.CLASSIFY), "ClassificationRequest", ClassifyRequest, inference.classify),
    (_scores, "ScoreRequest", ScoreRequestBody, retrieval.score_texts),
    (_scores, "RerankRequest", RerankRequestBody, retrieval.rerank),
    (lambda model: True, "PoolingRequest", PoolingRequestBody, inference.pooling),
)


@router.post(
    "/invocations",
    openapi_extra=body_schema(*(body for _, _, body, _ in INVOCATIONS)),
    responses=inference.STREAMED,
)
async def invocations(payload: Payload, request: Request) -> Response:
    """SageMaker's inference route: the body decides which route answers (as vLLM's does)."""
    adapter = request.headers.get(ADAPTER_HEADER)
    if adapter is not None:  # the model (a LoRA adapter) SageMaker invokes replaces the body's
        payload = {**payload, "model": adapter}
    name = payload.get("model")
    _, model = check_serving(service_state(request), name if isinstance(name, str) else None)
    expected = []
    for serves, label, body, handler in INVOCATIONS:
        if not serves(model) or (TASK_FIELD in payload and body is not PoolingRequestBody):
            continue
        try:
            body.model_validate(payload, context=QUIET)
        except ValidationError:
            expected.append(label)
            continue
        return await handler(body.model_validate(payload), request)  # now said once, if at all
    raise InvalidRequestError(
        f"Cannot find suitable handler for request. Expected one of: {expected}", None
    )


@router.get("/ping", responses=admin.UNAVAILABLE)
@router.post("/ping", responses=admin.UNAVAILABLE)
async def ping(request: Request) -> Response:
    """SageMaker's health check: 200 once every model is ready, 503 before and while draining
    (it routes no invocation to a container that does not answer 200)."""
    return await admin.ready(request)


async def vertex(payload: Payload, request: Request) -> Response:
    """Vertex AI's prediction route, as TEI serves it: `{"instances": [...]}`, each instance a
    TEI body (a rerank body when it is one, else the model's main task's), answered together as
    `{"predictions": [...]}`, each prediction the route's own answer; the first error answers
    for the request, in TEI's shape, and stops the other instances."""
    mark(request)
    instances = payload.get("instances")
    if not isinstance(instances, list) or not instances:
        raise InvalidRequestError("`instances` must be a non-empty list", "instances", "empty")
    _, served = check_serving(service_state(request), None)  # TEI's routes: the default model
    check_batch_size(len(instances), served.settings.max_client_batch_size, "instances")
    main = _main(served, "Vertex AI's route")
    calls = [asyncio.ensure_future(_instance(one, main, request)) for one in instances]
    try:
        answers = await asyncio.gather(*calls)
    except BaseException:
        for call in calls:
            call.cancel()
        raise
    predictions = b",".join(answer.body for answer in answers)
    return Response(b'{"predictions":[' + predictions + b"]}", media_type="application/json")


async def _instance(
    instance: object, main: tuple[type[BaseModel], Handler], request: Request
) -> Response:
    """One Vertex instance through its TEI route."""
    if not isinstance(instance, dict):
        raise InvalidRequestError("each instance must be a JSON object", "instances")
    try:  # "Rerank is the only payload that can be matched safely" (TEI)
        body = tei_rerank.TEIRerankRequest.model_validate(instance, context=QUIET)
    except ValidationError:
        model, handler = main
        return await handler(validated(model, instance), request)
    return await tei_rerank.rerank(body, request)


def add_vertex_routes(app_router: APIRouter, predict_route: str, health_route: str | None) -> None:
    """Vertex AI's routes: TEI's `/vertex`, and the paths Vertex names (AIP_PREDICT_ROUTE,
    AIP_HEALTH_ROUTE) where they differ."""
    for path in dict.fromkeys(("/vertex", predict_route)):
        app_router.add_api_route(
            path,
            vertex,
            methods=["POST"],
            route_class_override=TEIRoute,
            openapi_extra={"requestBody": {"required": True, "content": VERTEX_BODY}},
        )
    if health_route is not None and health_route not in ("/health", "/ready"):
        app_router.add_api_route(
            health_route, admin.ready, methods=["GET"], responses=admin.UNAVAILABLE
        )


VERTEX_BODY = {
    "application/json": {
        "schema": {
            "type": "object",
            "required": ["instances"],
            "properties": {"instances": {"type": "array", "items": {"type": "object"}}},
        }
    }
}

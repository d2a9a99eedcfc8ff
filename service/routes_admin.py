"""Operational routes: tokenize, detokenize, models, info, health, ready, metrics."""

from __future__ import annotations

import asyncio
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import PlainTextResponse, Response

from service.encoding import StrictJSONRoute, dumps
from service.errors import InvalidRequestError, error_response
from service.inputs import tokenize_prompt
from service.runs import check_serving, service_state
from service.schemas import DetokenizeRequest, TokenizeRequest
from service.settings import DEFAULT_MODEL_ID, ServerSettings
from service.state import ModelHandle

router = APIRouter(route_class=StrictJSONRoute)
UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    503: {"description": "Not ready, draining, or the engine stopped."}
}


def _json(document: object, status: int = 200) -> Response:
    return Response(dumps(document), status_code=status, media_type="application/json")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    """Token ids of a prompt, as the engine would see them before any truncation."""
    state = service_state(request)
    _, model = check_serving(state, body.model)
    ids = await tokenize_prompt(
        model, body.prompt, body.add_special_tokens, state.metrics.on_reject
    )
    return _json({"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids})


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    """Text of token ids."""
    _, model = check_serving(service_state(request), body.model)
    vocab_size = model.loaded.spec.vocab_size
    bad = [t for t in body.tokens if t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", "tokens"
        )
    text = await asyncio.to_thread(model.tokenizer.decode, body.tokens)
    return _json({"prompt": text})


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """The one served model, OpenAI-style."""
    state = service_state(request)
    _, model = check_serving(state, None)
    card = {
        "id": model.served_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "poolserve",
        "root": _source(state.settings, model),
        "max_model_len": model.max_model_len,
    }
    return _json({"object": "list", "data": [card]})


@router.get("/info")
async def info(request: Request) -> Response:
    """Model, tasks, dtype, device, limits and version."""
    state = service_state(request)
    _, model = check_serving(state, None)
    s = state.settings
    return _json(
        {
            "model": model.served_name,
            "model_source": _source(s, model),
            "architecture": model.loaded.spec.architecture,
            "tasks": [t.value for t in state.supported_tasks],
            "dtype": state.dtype,
            "device": state.device,
            "max_model_len": model.max_model_len,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "max_num_seqs": s.max_num_seqs,
            "max_num_queued_requests": s.max_num_queued_requests,
            "max_num_queued_tokens": s.max_num_queued_tokens,
            "max_client_batch_size": s.max_client_batch_size,
            "payload_limit": s.payload_limit,
            "async_scheduling": s.async_scheduling,
            "version": version("poolserve"),
        }
    )


def _source(settings: ServerSettings, model: ModelHandle) -> str:
    """Where the weights came from, without the server's directories: a Hub id or a folder name."""
    if settings.model is None:
        return DEFAULT_MODEL_ID
    if Path(settings.model).expanduser().is_dir():
        return model.loaded.path.name
    return settings.model


@router.get("/health", responses=UNAVAILABLE)
async def health(request: Request) -> Response:
    """Liveness: 200 while the process and the engine loop live."""
    engine = service_state(request).engine
    if engine is not None and not engine.is_alive:
        return error_response(
            503, "the engine loop has stopped", "service_unavailable", None, "engine_dead"
        )
    return _json({"status": "ok"})


@router.get("/ready", responses=UNAVAILABLE)
async def ready(request: Request) -> Response:
    """Readiness: 503 until warmed up, while draining, after an unrecoverable engine error."""
    state = service_state(request)
    if state.accepting():
        return _json({"status": "ready"})
    reason = "draining" if state.draining or state.leaving else "not_ready"
    if state.engine is not None and state.engine.dead_reason is not None:
        reason = "engine_dead"
    return error_response(503, f"not ready: {reason}", "service_unavailable", None, reason)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    return Response(service_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

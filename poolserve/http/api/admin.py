"""Operational routes: tokenize, detokenize, models, version, info, health, ready, metrics."""

from __future__ import annotations

import asyncio
import os
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import PlainTextResponse, Response

from poolserve.frontend.chat import render_messages
from poolserve.frontend.encoding import dumps
from poolserve.frontend.pipeline import check_serving
from poolserve.frontend.state import ModelHandle, ServiceState
from poolserve.frontend.texts import tokenize_prompt
from poolserve.http.api.schemas import DetokenizeRequest, TokenizeRequest
from poolserve.http.calls import HTTPCaller, service_state
from poolserve.http.errors import error_response
from poolserve.http.routing import StrictJSONRoute
from poolserve.http.tenants import TenantKey
from poolserve.http.visible import described, seen_adapters, seen_models, tenant_of, unseen
from poolserve.types.errors import InvalidRequestError
from poolserve.types.model import DEFAULT_MODEL_ID
from poolserve.types.tasks import SPARSE_MAIN_HEADS, PoolingTask, PoolingType

router = APIRouter(route_class=StrictJSONRoute)
UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    503: {"description": "Not ready, draining, or the engine stopped."}
}


def _json(document: object, status: int = 200) -> Response:
    return Response(dumps(document), status_code=status, media_type="application/json")


async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    """Token ids of a prompt or a chat, as the engine would see them before any truncation.

    The chat form is rendered by the same chat-template path as pooling requests' `messages`;
    special tokens default to true for a prompt and false on top of a chat template, as in vLLM.
    """
    state = service_state(request)
    model = _routed(request, state, body.model)
    on_reject = state.metrics.model(model.model_name).on_reject
    chat = body.chat()
    text = body.prompt
    if chat is not None:
        trusted = model.settings.trust_request_chat_template
        text = await render_messages(chat, model, trusted, on_reject)
    assert text is not None  # the schema asks for exactly one of prompt and messages
    specials = body.add_special_tokens if body.add_special_tokens is not None else chat is None
    ids = await tokenize_prompt(model, text, specials, on_reject)
    strings = None
    if body.return_token_strs:
        strings = await asyncio.to_thread(model.tokenizer.convert_ids_to_tokens, ids)
    return _json(
        {
            "count": len(ids),
            "max_model_len": model.max_model_len,
            "tokens": ids,
            "token_strs": strings,
        }
    )


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    """Text of token ids."""
    model = _routed(request, service_state(request), body.model)
    vocab_size = model.card.vocab_size
    bad = [t for t in body.tokens if t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", "tokens"
        )
    text = await asyncio.to_thread(model.tokenizer.decode, body.tokens)
    return _json({"prompt": text})


def _routed(request: Request, state: ServiceState, name: str | None) -> ModelHandle:
    """The model a body names (the default when it names none), noted for the access log."""
    _, model = check_serving(state, name)
    HTTPCaller(request).routed(model.model_name, model.lora_name)
    return model


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """Every served model the request's key may use, OpenAI-style: one card per served name,
    as vLLM lists them, then its LoRA adapters."""
    state = service_state(request)
    check_serving(state, None)
    return _json({"object": "list", "data": _model_cards(state, tenant_of(request))})


@router.get(
    "/v1/models/{model_id:path}",
    responses={404: {"description": "No model the key may use is served as `model_id`."}},
)
async def model(request: Request, model_id: str) -> Response:
    """OpenAI's model retrieval: the card `/v1/models` lists under `model_id`."""
    state = service_state(request)
    check_serving(state, None)
    tenant = tenant_of(request)
    card = next((c for c in _model_cards(state, tenant) if c["id"] == model_id), None)
    if card is None:  # unknown, or a model the key may not use: one answer for both
        raise unseen(model_id, tenant)
    return _json(card)


def _model_cards(state: ServiceState, tenant: TenantKey | None) -> list[dict[str, Any]]:
    """The cards of the models and LoRA adapters the key may use (every one without a key)."""
    created = int(time.time())
    cards: list[dict[str, Any]] = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "poolserve",
            "root": _source(served.handle),
            "max_model_len": served.handle.max_model_len,
        }
        for served in seen_models(tenant, state)
        for name in served.handle.served_names
    ]
    # LoRA adapters as vLLM lists them: the folder as root, the base model as parent
    cards += [
        {
            "id": served.name,
            "object": "model",
            "created": created,
            "owned_by": "poolserve",
            "root": lora.path,
            "parent": served.handle.parent,
            "max_model_len": served.handle.max_model_len,
        }
        for served in seen_adapters(tenant, state)
        if (lora := served.handle.lora) is not None
    ]
    return cards


@router.get("/version")
async def server_version() -> Response:
    """The server's version, in vLLM's shape."""
    return _json({"version": version("poolserve")})


@router.get(
    "/info",
    responses={404: {"description": "No model the key may use is served as `model`."}},
)
async def info(request: Request, model: str | None = None) -> Response:
    """The model's name, tasks, dtype, device, limits and version: the one `?model=` names, else
    the default model (TEI's /info: the model its routes serve); a 404 for a model the
    request's key may not use, the default included (poolserve/http/visible.py)."""
    state = service_state(request)
    handle = described(state, tenant_of(request), model)
    s = handle.settings
    return _json(
        {
            "model": handle.served_name,
            "model_source": _source(handle),
            "architecture": handle.card.architecture,
            "tasks": [t.value for t in handle.supported_tasks],
            # what its inputs may be: texts always, images where it takes them
            "modalities": ["text", "image"] if handle.card.takes_images else ["text"],
            "dtype": handle.dtype,
            "device": handle.device,
            "max_model_len": handle.max_model_len,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "max_num_seqs": s.max_num_seqs,
            "max_num_queued_requests": s.max_num_queued_requests,
            "max_num_queued_tokens": s.max_num_queued_tokens,
            "max_client_batch_size": s.max_client_batch_size,
            "payload_limit": s.payload_limit,
            "async_scheduling": s.async_scheduling,
            "version": version("poolserve"),
            **sentence_transformers_info(handle),
            **tei_info(handle),
        }
    )


def sentence_transformers_info(model: ModelHandle) -> dict[str, object]:
    """Prompts, the default prompt, the similarity function and Matryoshka sizes."""
    st = model.card.sentence_transformers
    return {
        "prompts": dict(model.prompts.named),
        "default_prompt_name": model.prompts.default_name,
        # sentence-transformers' own default when the model saved none
        "similarity_fn_name": (st.similarity_fn_name if st else None) or "cosine",
        "truncate_dim": st.truncate_dim if st else None,
        "matryoshka_dimensions": model.card.matryoshka_dimensions,
    }


def tei_info(model: ModelHandle) -> dict[str, object]:
    """TEI's /info fields (its `Info` record, TEI 1.9.3) that these servers have in common."""
    s = model.settings
    return {
        "model_id": _source(model),
        "model_sha": s.revision,  # TEI reports its --revision here
        "model_dtype": model.dtype,
        "served_model_name": model.served_name,
        "model_type": _tei_model_type(model),
        "max_concurrent_requests": s.max_num_queued_requests,
        # sentence-transformers' max_seq_length caps every prompt, as TEI reads it
        "max_input_length": model.st_max_seq_length or model.max_model_len,
        "max_batch_tokens": s.max_num_batched_tokens,
        "max_batch_requests": s.max_num_seqs,
        # TEI's routes truncate a request that leaves `truncate` unset (TEI >= 1.9's default),
        # whatever --auto-truncate (the native routes' switch) says
        "auto_truncate": True,
        "tokenization_workers": _tokenization_workers(),
        "sha": None,
        "docker_label": None,
    }


# the embed pooling in TEI's spelling (its `Pool` names)
TEI_POOLING = {PoolingType.CLS: "cls", PoolingType.MEAN: "mean", PoolingType.LAST: "last_token"}


def _tei_model_type(model: ModelHandle) -> dict[str, object]:
    """TEI's model_type: a classifier (one label: a reranker) with its labels, or an embedder."""
    labels = model.card.labels
    tasks = model.card.supported_tasks
    if PoolingTask.CLASSIFY in tasks and labels:
        kind = "reranker" if len(labels) == 1 else "classifier"
        return {
            kind: {
                "id2label": {str(i): name for i, name in enumerate(labels)},
                "label2id": {name: i for i, name in enumerate(labels)},
            }
        }
    if model.card.pooling_info.head_kind in SPARSE_MAIN_HEADS:  # POST / answers sparse, splade
        return {"embedding": {"pooling": "splade"}}
    # --pooler-config's pooling, else the sentence-transformers mode, else the model kind's
    pooling = model.card.pooling_info.embed_pooling_type
    return {"embedding": {"pooling": TEI_POOLING.get(pooling, pooling.value)}}


def _tokenization_workers() -> int:
    """Threads that may tokenize at once: the event loop's default executor's size (Python's
    ThreadPoolExecutor default), where every route tokenizes."""
    return min(32, (os.cpu_count() or 1) + 4)


def _source(model: ModelHandle) -> str:
    """Where the weights came from, without the server's directories: a Hub id or a folder name."""
    source = model.settings.model
    if source is None:
        return DEFAULT_MODEL_ID
    if Path(source).expanduser().is_dir():
        return model.card.path.name
    return source


@router.get("/health", responses=UNAVAILABLE)
async def health(request: Request) -> Response:
    """Liveness: 200 while the process and every model's engine in the engine core live."""
    if not all(served.engine.is_alive for served in service_state(request).models):
        return error_response(
            503, "the engine core has stopped", "service_unavailable", None, "engine_dead"
        )
    return _json({"status": "ok"})


@router.get("/ready", responses=UNAVAILABLE)
async def ready(request: Request) -> Response:
    """Readiness: 503 until every model is warmed up, while draining, after an unrecoverable
    engine error."""
    state = service_state(request)
    if state.accepting():
        return _json({"status": "ready"})
    reason = "draining" if state.draining or state.leaving else "not_ready"
    if any(served.engine.dead_reason is not None for served in state.models):
        reason = "engine_dead"
    return error_response(503, f"not ready: {reason}", "service_unavailable", None, reason)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition; every model's engine gauges asked of the engine core now."""
    state = service_state(request)
    if state.ready:
        live = [s.engine for s in state.models if s.engine.dead_reason is None]
        # an engine that does not answer: its model's samples go, the others' stay
        await asyncio.gather(*(engine.snapshot() for engine in live), return_exceptions=True)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

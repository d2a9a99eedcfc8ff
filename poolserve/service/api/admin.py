"""Operational routes: tokenize, detokenize, models, version, info, health, ready, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import PlainTextResponse, Response

from poolserve.pooling.params import PoolingTask, PoolingType
from poolserve.service.api.schemas import DetokenizeRequest, TokenizeRequest
from poolserve.service.errors import InvalidRequestError, error_response
from poolserve.service.frontend.chat import render_messages
from poolserve.service.frontend.encoding import dumps
from poolserve.service.frontend.pipeline import check_serving, service_state
from poolserve.service.frontend.routing import StrictJSONRoute
from poolserve.service.frontend.texts import tokenize_prompt
from poolserve.service.settings import DEFAULT_MODEL_ID, ServerSettings
from poolserve.service.state import ModelHandle, ServiceState

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
    _, model = check_serving(state, body.model)
    on_reject = state.metrics.on_reject
    chat = body.chat()
    text = body.prompt
    if chat is not None:
        trusted = state.settings.trust_request_chat_template
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
    _, model = check_serving(service_state(request), body.model)
    vocab_size = model.card.spec.vocab_size
    bad = [t for t in body.tokens if t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", "tokens"
        )
    text = await asyncio.to_thread(model.tokenizer.decode, body.tokens)
    return _json({"prompt": text})


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """The served model, OpenAI-style: one card per --served-model-name, as vLLM lists them."""
    state = service_state(request)
    _, model = check_serving(state, None)
    created = int(time.time())
    root = _source(state.settings, model)
    cards = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "poolserve",
            "root": root,
            "max_model_len": model.max_model_len,
        }
        for name in model.served_names
    ]
    return _json({"object": "list", "data": cards})


@router.get("/version")
async def server_version() -> Response:
    """The server's version, in vLLM's shape."""
    return _json({"version": version("poolserve")})


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
            "architecture": model.card.spec.architecture,
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
            **sentence_transformers_info(model),
            **tei_info(state, model),
        }
    )


def sentence_transformers_info(model: ModelHandle) -> dict[str, object]:
    """Prompts, the default prompt, the similarity function and Matryoshka sizes."""
    st = model.card.sentence_transformers
    spec = model.card.spec
    return {
        "prompts": dict(model.prompts.named),
        "default_prompt_name": model.prompts.default_name,
        # sentence-transformers' own default when the model saved none
        "similarity_fn_name": (st.similarity_fn_name if st else None) or "cosine",
        "truncate_dim": st.truncate_dim if st else None,
        "matryoshka_dimensions": spec.matryoshka_dimensions,
    }


def tei_info(state: ServiceState, model: ModelHandle) -> dict[str, object]:
    """TEI's /info fields (its `Info` record, TEI 1.9.3) that these servers have in common."""
    s = state.settings
    return {
        "model_id": _source(s, model),
        "model_sha": s.revision,  # TEI reports its --revision here
        "model_dtype": state.dtype,
        "served_model_name": model.served_name,
        "model_type": _tei_model_type(state, model),
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


def _tei_model_type(state: ServiceState, model: ModelHandle) -> dict[str, object]:
    """TEI's model_type: a classifier (one label: a reranker) with its labels, or an embedder."""
    labels = model.card.spec.labels
    tasks = state.supported_tasks
    if PoolingTask.CLASSIFY in tasks and labels:
        kind = "reranker" if len(labels) == 1 else "classifier"
        return {
            kind: {
                "id2label": {str(i): name for i, name in enumerate(labels)},
                "label2id": {name: i for i, name in enumerate(labels)},
            }
        }
    if PoolingTask.EMBED_SPARSE in tasks:  # an MLM head: POST / answers sparse, TEI's splade
        return {"embedding": {"pooling": "splade"}}
    # --pooler-config's pooling, else the sentence-transformers mode, else the model kind's
    pooling = state.engine.pooling_info.embed_pooling_type if state.engine else PoolingType.CLS
    return {"embedding": {"pooling": TEI_POOLING.get(pooling, pooling.value)}}


def _tokenization_workers() -> int:
    """Threads that may tokenize at once: the event loop's default executor's size (Python's
    ThreadPoolExecutor default), where every route tokenizes."""
    return min(32, (os.cpu_count() or 1) + 4)


def _source(settings: ServerSettings, model: ModelHandle) -> str:
    """Where the weights came from, without the server's directories: a Hub id or a folder name."""
    if settings.model is None:
        return DEFAULT_MODEL_ID
    if Path(settings.model).expanduser().is_dir():
        return model.card.path.name
    return settings.model


@router.get("/health", responses=UNAVAILABLE)
async def health(request: Request) -> Response:
    """Liveness: 200 while the process and the engine core live."""
    engine = service_state(request).engine
    if engine is not None and not engine.is_alive:
        return error_response(
            503, "the engine core has stopped", "service_unavailable", None, "engine_dead"
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
    """Prometheus text exposition; the engine's gauges asked of the engine core now."""
    state = service_state(request)
    if state.engine is not None and state.engine.dead_reason is None and state.ready:
        with contextlib.suppress(Exception):  # a core that does not answer: its families go
            await state.engine.snapshot()
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

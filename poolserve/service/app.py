"""FastAPI app factory and lifespan: load, warm up, serve, drain."""

from __future__ import annotations

import asyncio
import copy
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import torch
from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from poolserve.models.errors import UnsupportedDtypeError, UnsupportedQuantizationError
from poolserve.models.loader import load_model, resolve_dtype
from poolserve.models.quantization import check_quantization
from poolserve.models.spec import LoadedModel
from poolserve.pooling.params import PoolingParams
from poolserve.scheduler.admission import CharBudget
from poolserve.scheduler.config import SchedulerConfig
from poolserve.scheduler.engine import Engine
from poolserve.service import dispatch
from poolserve.service.api import admin, inference, retrieval
from poolserve.service.compat import cohere, infinity, tei_embed, tei_predict, tei_tokens
from poolserve.service.compat.tei_common import TEIRoute
from poolserve.service.edge.handlers import install_error_handlers, openapi_schema
from poolserve.service.edge.middleware import OPEN_PATHS, EdgeMiddleware, InFlight
from poolserve.service.frontend.jobs import (
    PoolerDefaults,
    Truncate,
    TruncationSide,
    parse_pooler_config,
)
from poolserve.service.frontend.pair_template import probe_pair_template
from poolserve.service.frontend.prompts import Prompts
from poolserve.service.frontend.texts import encode_texts, truncation_for
from poolserve.service.frontend.truncation import special_tokens
from poolserve.service.observability.metrics import ServiceMetrics
from poolserve.service.observability.tracing import build_tracing
from poolserve.service.settings import DEFAULT_MODEL_ID, ServerSettings
from poolserve.service.state import ModelHandle, ServiceState, TextLimits

logger = logging.getLogger(__name__)

# --dtype values; auto (None) lets the loader pick per device: float32 on CPU, bfloat16 on CUDA.
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
WARMUP_TEXT = "poolserve warm-up"


def create_app(settings: ServerSettings) -> FastAPI:
    """A server app; the model loads in the lifespan, /ready turns 200 after warm-up."""
    state = ServiceState(
        settings=settings,
        metrics=ServiceMetrics(),
        tracing=build_tracing(settings.otlp_traces_endpoint),
    )
    inflight = InFlight()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await _start(state)
        try:
            yield
        finally:
            state.draining = True
            if state.engine is not None:
                # the HTTP side had the drain; work still queued now has nobody waiting for it
                await state.engine.drain(0.0)
            await asyncio.to_thread(state.tracing.shutdown)

    app = FastAPI(
        title="poolserve",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        root_path=settings.root_path,  # as vLLM: routes answer with or without the prefix
    )
    app.state.poolserve = state
    app.state.inflight = inflight
    install_error_handlers(app)
    routers = (
        inference.router,
        admin.router,
        retrieval.router,
        cohere.router,
        infinity.router,
        tei_embed.router,
        tei_predict.router,
        tei_tokens.router,
        dispatch.router,
    )
    for router in routers:
        app.include_router(router)
    app.add_middleware(EdgeMiddleware, state=state, inflight=inflight)
    if settings.allowed_origins:
        # added last, so outermost: preflights are answered before the API key check
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=settings.allowed_methods,
            allow_headers=settings.allowed_headers,
            allow_credentials=settings.allow_credentials,
        )
    # paths whose errors may take TEI's shape: TEI's own routes and the shared ones
    tei_routes = {r.path for rt in routers for r in rt.routes if isinstance(r, TEIRoute)}
    tei_paths = tei_routes | dispatch.SHARED_WITH_TEI
    app.openapi = partial(openapi_schema, app, OPEN_PATHS, tei_paths)  # type: ignore[method-assign]
    return app


def resolve_device(name: str) -> torch.device:
    """auto = cuda when available; cuda without a usable GPU is refused, naming the flag."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    elif name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available to torch")
    return torch.device(name)


async def _start(state: ServiceState) -> None:
    """Load the model off the loop, start the engine, warm up, then report ready."""
    settings = state.settings
    device = resolve_device(settings.device)
    try:
        # before the load: a dtype the device cannot run fails at once, not after a download
        dtype = resolve_dtype(DTYPES[settings.dtype], device)
    except UnsupportedDtypeError as exc:
        raise ValueError(f"--dtype {settings.dtype}: {exc}; float32 runs everywhere") from exc
    try:
        check_quantization(settings.quantization, device, dtype)
    except UnsupportedQuantizationError as exc:
        raise ValueError(f"--quantization {settings.quantization}: {exc}") from exc
    defaults = parse_pooler_config(settings.pooler_config)
    loaded = await asyncio.to_thread(
        load_model,
        settings.model,
        device=device,
        dtype=dtype,
        hf_overrides=settings.hf_overrides_dict,
        revision=settings.revision,
        quantization=settings.quantization,
    )
    handle = _model_handle(loaded, settings, defaults)
    config = _scheduler_config(settings, loaded, handle.max_model_len)
    engine = Engine(
        loaded,
        config,
        device,
        max_model_len=handle.max_model_len,
        embed_pooling=defaults.embed_pooling,
        observer=state.metrics,
    )
    state.model, state.engine = handle, engine
    state.device, state.dtype = device.type, str(loaded.spec.dtype).removeprefix("torch.")
    state.supported_tasks = tuple(sorted(engine.supported_tasks, key=lambda t: t.value))
    state.metrics.bind_engine(engine.snapshot, state.accepting)
    engine.start()
    await _warm_up(state)
    state.ready = True
    logger.info(
        "ready: model=%s served_as=%s tasks=%s device=%s dtype=%s max_model_len=%d "
        "max_num_batched_tokens=%d max_num_seqs=%d max_num_queued_tokens=%d num_kv_blocks=%d "
        "async_scheduling=%s prefix_caching=%s",
        loaded.path,
        ",".join(handle.served_names),
        ",".join(t.value for t in state.supported_tasks),
        state.device,
        state.dtype,
        handle.max_model_len,
        config.max_num_batched_tokens,
        config.max_num_seqs,
        config.max_num_queued_tokens,
        config.num_kv_blocks,
        config.async_scheduling,
        config.enable_prefix_caching,
    )


def _model_handle(
    loaded: LoadedModel, settings: ServerSettings, defaults: PoolerDefaults
) -> ModelHandle:
    """The served name, the effective max_model_len, the tokenizer and the text limits."""
    limit = loaded.spec.max_model_len
    max_model_len = min(settings.max_model_len or limit, limit)
    side: TruncationSide = "left" if loaded.tokenizer.truncation_side == "left" else "right"
    tokenizer = copy.deepcopy(loaded.tokenizer)
    # the service cuts prompts itself and refuses long ones clearly; silence the tokenizer's warning
    tokenizer.model_max_length = 1 << 30
    st = loaded.sentence_transformers
    st_length = st.max_seq_length if st is not None else None
    limits = TextLimits.derive(settings, max_model_len)
    names = settings.served_model_names or (_default_name(settings.model),)
    return ModelHandle(
        loaded=loaded,
        served_name=names[0],
        aliases=names[1:],
        auto_truncate=settings.auto_truncate,
        max_model_len=max_model_len,
        tokenizer=tokenizer,
        defaults=defaults,
        specials=special_tokens(tokenizer),
        pair_template=probe_pair_template(tokenizer),
        truncation_side=side,
        st_max_seq_length=None if st_length is None else min(st_length, max_model_len),
        limits=limits,
        tokenizing=CharBudget(limits.max_tokenizing_chars),
        prompts=Prompts.of(st, settings.default_prompt_name),
    )


def _default_name(model: str | None) -> str:
    """The name a model is served as without --served-model-name: never a filesystem path."""
    if model is None:
        return DEFAULT_MODEL_ID
    local = Path(model).expanduser()
    return local.resolve().name if local.is_dir() else model


def _scheduler_config(
    settings: ServerSettings, loaded: LoadedModel, max_model_len: int
) -> SchedulerConfig:
    """Budgets from the flags; encoders need a whole prompt to fit one step."""
    budget = settings.max_num_batched_tokens
    if not loaded.spec.is_causal and budget < max_model_len:
        raise ValueError(
            f"encoder prompts cannot be chunked: --max-num-batched-tokens ({budget}) "
            f"must be at least "
            f"max_model_len ({max_model_len})"
        )
    blocks_for_longest = math.ceil(max_model_len / settings.block_size)
    num_kv_blocks = settings.num_kv_blocks or blocks_for_longest + math.ceil(
        budget / settings.block_size
    )
    if num_kv_blocks < blocks_for_longest and loaded.spec.is_causal:
        raise ValueError(
            f"--num-kv-blocks ({num_kv_blocks}) cannot hold one prompt of max_model_len "
            f"({max_model_len}); it needs at least {blocks_for_longest}"
        )
    return SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=settings.max_num_seqs,
        max_num_queued_requests=settings.max_num_queued_requests,
        max_num_queued_tokens=settings.max_num_queued_tokens,
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
        block_size=settings.block_size,
        num_kv_blocks=num_kv_blocks,
        enable_chunked_prefill=loaded.spec.is_causal,
        async_scheduling=settings.async_scheduling,
        # bidirectional attention: a position's KV depends on later tokens, so nothing is shared
        enable_prefix_caching=settings.enable_prefix_caching and loaded.spec.is_causal,
        record_timelines=settings.otlp_traces_endpoint is not None,
    )


async def _warm_up(state: ServiceState) -> None:
    """Run one request of the default task so the first user request pays no first-run costs."""
    assert state.model is not None and state.engine is not None
    model = state.model
    # the request path's own tokenization, so its first use is warm too
    (ids,) = encode_texts(model, [WARMUP_TEXT], truncation_for(Truncate(), model))
    await state.engine.submit(ids, PoolingParams(task=state.default_task))

"""FastAPI app factory and lifespan: load, warm up, serve, drain."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import inspect
import logging
import math
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from poolserve.config.models_file import ServedModel, ServedModels, served_models
from poolserve.config.settings import ServerSettings
from poolserve.engine.host import CoreConfig, LocalCore, socket_path
from poolserve.frontend.chunked import slice_length
from poolserve.frontend.client import EngineClient
from poolserve.frontend.jobs import (
    PoolerDefaults,
    Truncate,
    TruncationSide,
    parse_pooler_config,
)
from poolserve.frontend.pair_template import probe_pair_template
from poolserve.frontend.prompts import Prompts
from poolserve.frontend.state import ModelHandle, Served, ServiceState, TextLimits
from poolserve.frontend.texts import encode_texts, truncation_for
from poolserve.frontend.truncation import special_tokens
from poolserve.http import dispatch
from poolserve.http.api import admin, inference, retrieval
from poolserve.http.compat import cohere, infinity, tei_embed, tei_predict, tei_tokens
from poolserve.http.compat.tei_common import TEIRoute
from poolserve.http.edge.handlers import install_error_handlers, openapi_schema
from poolserve.http.edge.middleware import OPEN_PATHS, EdgeMiddleware, InFlight
from poolserve.http.edge.routing import DirectRoutes
from poolserve.observability.metrics import ModelMetrics, ServiceMetrics
from poolserve.observability.tracing import build_tracing
from poolserve.types.admission import CharBudget
from poolserve.types.card import ModelCard
from poolserve.types.params import PoolingParams

logger = logging.getLogger(__name__)

WARMUP_TEXT = "poolserve warm-up"
# Allocations (net of deallocations) between two collections of the youngest generation.
YOUNG_GC_THRESHOLD = 20_000
# What the process supervisor sends a front end when the engine core process has exited.
CORE_LOST_SIGNAL = signal.SIGUSR1
# The edge makes each request's server span and the service counts its own metrics: FastAPI's
# native OpenTelemetry (FastAPI >= 0.165, on whenever a global provider is configured) would add
# a second span per request and checks the providers on every request.
FASTAPI_TELEMETRY_OFF: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI).parameters
    else {}
)


def create_app(
    settings: ServerSettings, core_address: str | None = None, *, owns_process: bool = False
) -> FastAPI:
    """A server app; /ready turns 200 after warm-up.

    With `core_address` (a directory) the app is one front end of an engine core process whose
    models listen there (`socket_path(core_address, i)` for model i); without, its lifespan runs
    the engine core on its own loop (loading every model).
    `owns_process`: the app is all this process serves (its objects may be frozen after start).
    """
    state = ServiceState(
        settings=settings,
        metrics=ServiceMetrics(),
        tracing=build_tracing(settings.otlp_traces_endpoint),
        core_address=core_address,
        owns_process=owns_process,
    )
    inflight = InFlight()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await _start(state)
        try:
            yield
        finally:
            state.draining = True
            for served in state.models:
                await served.engine.close()
            if state.core is not None:
                # the HTTP side had the drain; work still queued now has nobody waiting for it
                await state.core.stop()
            await asyncio.to_thread(state.tracing.shutdown)

    app = FastAPI(
        title="poolserve",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        root_path=settings.root_path,  # as vLLM: routes answer with or without the prefix
        **FASTAPI_TELEMETRY_OFF,
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
    # inside the edge (added first): every request still meets the edge's checks and accounting
    app.add_middleware(DirectRoutes, routes=[r for router in routers for r in router.routes])
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


def core_config(settings: ServerSettings, defaults: PoolerDefaults) -> CoreConfig:
    """What the engine core needs from the server's settings."""
    return CoreConfig(
        model=settings.model,
        revision=settings.revision,
        device=settings.device,
        dtype=settings.dtype,
        quantization=settings.quantization,
        allow_slower_precision=settings.allow_slower_precision,
        hf_overrides=settings.hf_overrides_dict,
        max_model_len=settings.max_model_len,
        embed_pooling=defaults.embed_pooling,
        # model-level, as in vLLM: the core applies them, whichever front end asks
        logit_mean=defaults.calibration.mean,
        logit_sigma=defaults.calibration.sigma,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        max_num_queued_requests=settings.max_num_queued_requests,
        max_num_queued_tokens=settings.max_num_queued_tokens,
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
        block_size=settings.block_size,
        num_kv_blocks=settings.num_kv_blocks,
        async_scheduling=settings.async_scheduling,
        enable_prefix_caching=settings.enable_prefix_caching,
        record_timelines=settings.otlp_traces_endpoint is not None,
    )


def core_configs(served: ServedModels) -> tuple[CoreConfig, ...]:
    """One core config per model, in order: its settings', and how it shares the device."""
    configs = []
    for model in served.models:
        try:
            defaults = parse_pooler_config(model.settings.pooler_config)
        except ValueError as exc:
            raise ValueError(f"model {model.name!r}: {exc}") from exc
        config = core_config(model.settings, defaults)
        configs.append(
            dataclasses.replace(
                config, priority=model.priority, gpu_memory_fraction=model.gpu_memory_fraction
            )
        )
    return tuple(configs)


async def _start(state: ServiceState) -> None:
    """Reach the engine core (starting it here in single-process mode), one engine client per
    model; every model connected and warmed up before the server reports ready. A model that
    fails fails the start, named, and what started is stopped."""
    served = served_models(state.settings)
    observers = [state.metrics.model(m.name) for m in served.models]
    engines = await _engine_clients(state, core_configs(served), observers)
    try:
        models = []
        for entry, engine in zip(served.models, engines, strict=True):
            try:
                card = await engine.connect()
                models.append(Served(_model_handle(card, entry), engine))
            except ValueError as exc:
                raise ValueError(f"model {entry.name!r}: {exc}") from exc
        default = models[served.models.index(served.default)]
        state.serve(tuple(models), default)
        state.metrics.bind_engines(
            {m.name: m.engine.latest_snapshot for m in models}, state.accepting
        )
        for one in models:
            await _warm_up(one)
    except BaseException:
        for engine in engines:
            await engine.close()
        if state.core is not None:
            await state.core.stop()
        raise
    if state.owns_process:
        # what start-up made lives as long as the process: out of the collector's way, so
        # its full collections stop walking it on every request (measured: ~75 us a request)
        gc.collect()
        gc.freeze()
        # A request's objects die by reference counting, yet at the default threshold (700
        # allocations) the young generation was collected every request or two: 18 us a request
        # under load (measured with gc.callbacks). Cyclic garbage is still collected, later.
        gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])
    state.ready = True
    for one in models:
        _log_ready(state, one, default)


async def _engine_clients(
    state: ServiceState, configs: tuple[CoreConfig, ...], observers: list[ModelMetrics]
) -> list[EngineClient]:
    """One client per model, to the core started here or to the core process's sockets."""
    if state.core_address is None:
        state.core = LocalCore(configs, observers)
        await state.core.start()
        paths = state.core.paths
    else:
        paths = tuple(socket_path(state.core_address, i) for i in range(len(configs)))
    timeout_s = state.settings.engine_core_timeout
    engines = [
        EngineClient(path, timeout_s=timeout_s, observer=observer)
        for path, observer in zip(paths, observers, strict=True)
    ]
    if state.core is None:
        # the supervisor's word that the engine core process exited: fail fast, whatever the
        # sockets have noticed yet
        def lose() -> None:
            for engine in engines:
                engine.lose("the engine core process exited")

        asyncio.get_running_loop().add_signal_handler(CORE_LOST_SIGNAL, lose)
    return engines


def _log_ready(state: ServiceState, served: Served, default: Served) -> None:
    """One line per model: what it is, where it runs, its budgets."""
    handle, config = served.handle, served.handle.card.scheduler
    logger.info(
        "ready: model=%s served_as=%s%s tasks=%s device=%s dtype=%s max_model_len=%d "
        "max_num_batched_tokens=%d max_num_seqs=%d max_num_queued_tokens=%d num_kv_blocks=%d "
        "async_scheduling=%s prefix_caching=%s engine_core=%s",
        handle.card.path,
        ",".join(handle.served_names),
        " (default)" if served is default and len(state.models) > 1 else "",
        ",".join(t.value for t in handle.supported_tasks),
        handle.device,
        handle.dtype,
        handle.max_model_len,
        config.max_num_batched_tokens,
        config.max_num_seqs,
        config.max_num_queued_tokens,
        config.num_kv_blocks,
        config.async_scheduling,
        config.enable_prefix_caching,
        "thread" if state.core is not None else state.core_address,
    )


def _model_handle(card: ModelCard, served: ServedModel) -> ModelHandle:
    """The served names, the effective max_model_len, the tokenizer and the text limits."""
    settings = served.settings
    defaults = parse_pooler_config(settings.pooler_config)
    limit = card.spec.max_model_len
    max_model_len = min(settings.max_model_len or limit, limit)
    side: TruncationSide = "left" if card.tokenizer.truncation_side == "left" else "right"
    tokenizer = copy.deepcopy(card.tokenizer)
    # the service cuts prompts itself and refuses long ones clearly; silence the tokenizer's warning
    tokenizer.model_max_length = 1 << 30
    st = card.sentence_transformers
    st_length = st.max_seq_length if st is not None else None
    limits = TextLimits.derive(settings, max_model_len, _chunked_input_tokens(card, defaults))
    names = served.served_names
    return ModelHandle(
        card=card,
        settings=settings,
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


def _chunked_input_tokens(card: ModelCard, defaults: PoolerDefaults) -> int | None:
    """With chunked processing, the most tokens one embed input may have (max_embed_len);
    refused at start when the engine could never queue an input that long."""
    if not defaults.enable_chunked_processing:
        return None
    st = card.sentence_transformers
    size = slice_length(card.max_model_len, st.max_seq_length if st is not None else None)
    max_embed_len = defaults.max_embed_len or size
    scheduler = card.scheduler
    slices = math.ceil(max_embed_len / size)
    for count, what, limit in (
        (max_embed_len, "tokens", scheduler.max_num_queued_tokens),
        (slices, "requests", scheduler.max_num_queued_requests),
    ):
        if count > limit:
            raise ValueError(
                f"--pooler-config: max_embed_len ({max_embed_len}) makes {count} queued "
                f"{what} ({slices} slices of {size} tokens), more than --max-num-queued-{what} "
                f"({limit}): an input that long could never be queued; raise "
                f"--max-num-queued-{what} or lower max_embed_len"
            )
    return max_embed_len


async def _warm_up(served: Served) -> None:
    """Run one request of the model's default task, so the first user request pays no
    first-run costs; a model that fails it fails the start, named."""
    model = served.handle
    try:
        # the request path's own tokenization, so its first use is warm too
        (ids,) = encode_texts(model, [WARMUP_TEXT], truncation_for(Truncate(), model))
        params = PoolingParams(task=model.default_task)
        (output,) = await served.engine.submit_many([ids], params)
        await output
    except Exception as exc:
        raise RuntimeError(f"model {model.served_name!r}: the warm-up failed: {exc}") from exc

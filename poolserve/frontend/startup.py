"""Start-up of a front end: reach the engine core, one client and handle per model, warm up.

The app's lifespan and the Python API both build their state with `new_state` and run `start`
and `stop`, so the Python API needs no web framework to serve: every model connected and warmed
up before the server reports ready; a model that fails fails the start, named, and what started
is stopped. The engine core is another process (its socket directory in the state), or, with
--api-server-count 0 and in the Python API, started here on this event loop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math

from poolserve.config.core import CoreConfig, core_configs
from poolserve.config.models_file import ServedModel, served_models
from poolserve.config.pooler import PoolerDefaults
from poolserve.config.settings import ServerSettings
from poolserve.frontend.chunked import slice_length
from poolserve.frontend.client import EngineClient
from poolserve.frontend.jobs import Truncate, TruncationSide
from poolserve.frontend.pair_template import probe_pair_template
from poolserve.frontend.prompts import Prompts
from poolserve.frontend.score_template import score_template_of
from poolserve.frontend.state import ModelHandle, Served, ServiceState, TextLimits
from poolserve.frontend.texts import encode_texts, truncation_for
from poolserve.frontend.truncation import special_tokens
from poolserve.observability.metrics import ModelMetrics, ServiceMetrics
from poolserve.observability.tracing import build_tracing
from poolserve.types.admission import CharBudget
from poolserve.types.card import ModelCard
from poolserve.types.params import PoolingParams
from poolserve.types.process import CORE_LOST_SIGNAL, socket_path

WARMUP_TEXT = "poolserve warm-up"
# Allocations (net of deallocations) between two collections of the youngest generation.
YOUNG_GC_THRESHOLD = 20_000

logger = logging.getLogger(__name__)


def new_state(
    settings: ServerSettings, core_address: str | None = None, *, owns_process: bool = False
) -> ServiceState:
    """A front end's state before its start: its own metrics, and tracing as the settings ask
    (built here so the app and the Python API count and trace alike)."""
    return ServiceState(
        settings=settings,
        metrics=ServiceMetrics(),
        tracing=build_tracing(settings.otlp_traces_endpoint),
        core_address=core_address,
        owns_process=owns_process,
    )


async def start(state: ServiceState) -> None:
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


async def stop(state: ServiceState) -> None:
    """Stop serving: refuse new work, close every engine client, then the engine core started
    here (work still queued has nobody waiting for it), then flush the traces."""
    state.draining = True
    for served in state.models:
        await served.engine.close()
    if state.core is not None:
        await state.core.stop()
    await asyncio.to_thread(state.tracing.shutdown)


async def _engine_clients(
    state: ServiceState, configs: tuple[CoreConfig, ...], observers: list[ModelMetrics]
) -> list[EngineClient]:
    """One client per model, to the core started here or to the core process's sockets."""
    if state.core_address is None:
        # the in-process engine core (--api-server-count 0, the Python API): the only place a
        # front end loads the engine, and only when it is asked to run one
        from poolserve.engine.host import LocalCore

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
    defaults = served.pooler
    max_model_len = card.max_model_len  # computed once, by the engine
    side: TruncationSide = "left" if card.tokenizer.truncation_side == "left" else "right"
    # this front end's own: the card arrived pickled, so the engine's tokenizer is untouched
    tokenizer = card.tokenizer
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
        score_template=score_template_of(card, settings, tokenizer),
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

"""Where the engine core runs: its own process (served with front-end processes), or a thread.

Both load the model, build the engine and serve it with `EngineCore` on a Unix socket; front
ends reach either through `EngineClient`, so the single-process mode (tests, small CPU
installs) runs the same code paths, the socket included.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from poolserve.core.server import EngineCore
from poolserve.kinds import HeadKind
from poolserve.models.errors import UnsupportedDtypeError, UnsupportedQuantizationError
from poolserve.models.loader import load_model, resolve_dtype
from poolserve.models.quantization import check_quantization
from poolserve.models.spec import LoadedModel
from poolserve.pooling.heads import LogitCalibration
from poolserve.pooling.params import PoolingType
from poolserve.scheduler.config import SchedulerConfig
from poolserve.scheduler.engine import Engine
from poolserve.scheduler.observer import EngineObserver

logger = logging.getLogger(__name__)

T = TypeVar("T")

# --dtype values; auto (None) lets the loader pick per device: float32 on CPU, bfloat16 on CUDA.
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Heads whose logits --pooler-config's logit_mean/logit_sigma calibrate.
CLASSIFIER_HEADS = frozenset({HeadKind.SEQUENCE_CLASSIFIER, HeadKind.TOKEN_CLASSIFIER})
SOCKET_NAME = "engine-core.sock"
# A core whose engine died (a device error) tells its front ends, then exits after this long.
DEAD_EXIT_DELAY_S = 1.0


@dataclass(frozen=True)
class CoreConfig:
    """Everything the engine core needs to load the model and build its engine."""

    model: str | None
    revision: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None
    hf_overrides: dict[str, Any] | None = None
    max_model_len: int | None = None
    embed_pooling: PoolingType | None = None
    # vLLM's logit_mean/logit_sigma (--pooler-config): classifier logits calibrated in the core
    logit_mean: float | None = None
    logit_sigma: float | None = None
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 256
    max_num_queued_requests: int = 1024
    max_num_queued_tokens: int = 262144
    long_prefill_token_threshold: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: the longest prompt plus one step's tokens
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    record_timelines: bool = False


def resolve_device(name: str) -> torch.device:
    """auto = cuda when available; cuda without a usable GPU is refused, naming the flag."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    elif name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available to torch")
    return torch.device(name)


def build_engine(config: CoreConfig, observer: EngineObserver | None = None) -> Engine:
    """Load the model and build its engine (blocking; not started)."""
    device = resolve_device(config.device)
    try:
        # before the load: a dtype the device cannot run fails at once, not after a download
        dtype = resolve_dtype(DTYPES[config.dtype], device)
    except UnsupportedDtypeError as exc:
        raise ValueError(f"--dtype {config.dtype}: {exc}; float32 runs everywhere") from exc
    try:
        check_quantization(config.quantization, device, dtype)
    except UnsupportedQuantizationError as exc:
        raise ValueError(f"--quantization {config.quantization}: {exc}") from exc
    # before the load: a zero sigma fails at once
    calibration = LogitCalibration(config.logit_mean, config.logit_sigma)
    loaded = load_model(
        config.model,
        device=device,
        dtype=dtype,
        hf_overrides=config.hf_overrides,
        revision=config.revision,
        quantization=config.quantization,
    )
    limit = loaded.spec.max_model_len
    max_model_len = min(config.max_model_len or limit, limit)
    if calibration != LogitCalibration() and loaded.spec.head_kind not in CLASSIFIER_HEADS:
        logger.warning("logit_mean/logit_sigma have no effect: the model has no classifier head")
    return Engine(
        loaded,
        scheduler_config(config, loaded, max_model_len),
        device,
        max_model_len=max_model_len,
        embed_pooling=config.embed_pooling,
        observer=observer,
        calibration=calibration,
    )


def scheduler_config(
    config: CoreConfig, loaded: LoadedModel, max_model_len: int
) -> SchedulerConfig:
    """Budgets from the flags; encoders need a whole prompt to fit one step."""
    budget = config.max_num_batched_tokens
    if not loaded.spec.is_causal and budget < max_model_len:
        raise ValueError(
            f"encoder prompts cannot be chunked: --max-num-batched-tokens ({budget}) "
            f"must be at least max_model_len ({max_model_len})"
        )
    blocks_for_longest = math.ceil(max_model_len / config.block_size)
    num_kv_blocks = config.num_kv_blocks or blocks_for_longest + math.ceil(
        budget / config.block_size
    )
    if num_kv_blocks < blocks_for_longest and loaded.spec.is_causal:
        raise ValueError(
            f"--num-kv-blocks ({num_kv_blocks}) cannot hold one prompt of max_model_len "
            f"({max_model_len}); it needs at least {blocks_for_longest}"
        )
    return SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=config.max_num_seqs,
        max_num_queued_requests=config.max_num_queued_requests,
        max_num_queued_tokens=config.max_num_queued_tokens,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        block_size=config.block_size,
        num_kv_blocks=num_kv_blocks,
        enable_chunked_prefill=loaded.spec.is_causal,
        async_scheduling=config.async_scheduling,
        # bidirectional attention: a position's KV depends on later tokens, so nothing is shared
        enable_prefix_caching=config.enable_prefix_caching and loaded.spec.is_causal,
        record_timelines=config.record_timelines,
    )


class LocalCore:
    """The engine core on the running event loop, on a Unix socket in a private directory.

    The single-process mode: the front end's loop also runs the engine's loop task and the
    core's side of the socket, so a burst of requests reaches the engine as one step, as it
    does across processes, without a second Python thread contending for the GIL.
    """

    def __init__(self, config: CoreConfig, observer: EngineObserver | None = None) -> None:
        self.config = config
        self.observer = observer
        self._directory = tempfile.mkdtemp(prefix="poolserve-core-")
        self.path = os.path.join(self._directory, SOCKET_NAME)
        self.core: EngineCore | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._beats: asyncio.Future[None] | None = None

    @property
    def engine(self) -> Engine:
        """The engine served (for in-process inspection)."""
        assert self.core is not None, "start() first"
        return self.core.engine

    def call(self, function: Callable[[], T]) -> T:
        """Run `function` on the core's loop from another thread (inspection, tests)."""
        assert self.loop is not None, "start() first"

        async def run() -> T:
            return function()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result()

    async def start(self) -> None:
        """Load and build off the loop, start the engine, listen."""
        try:
            engine = await asyncio.to_thread(build_engine, self.config, self.observer)
        except BaseException:
            shutil.rmtree(self._directory, ignore_errors=True)
            raise
        engine.start()
        self.core = EngineCore(engine)
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_unix_server(self.core.connection, self.path)
        self._beats = asyncio.ensure_future(self.core.beat())

    async def stop(self) -> None:
        """Stop listening; work still queued has nobody waiting for it: cancel it, stop."""
        if self._beats is not None:
            self._beats.cancel()
        if self._server is not None:
            self._server.close()
        if self.core is not None:
            await self.core.engine.drain(0.0)
        shutil.rmtree(self._directory, ignore_errors=True)


class CoreThread:
    """A `LocalCore` on its own loop in a thread: a core for a caller without a loop."""

    def __init__(self, config: CoreConfig, observer: EngineObserver | None = None) -> None:
        self.local = LocalCore(config, observer)
        self.path = self.local.path
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="poolserve-core")

    @property
    def engine(self) -> Engine:
        """The engine served."""
        return self.local.engine

    @property
    def core(self) -> EngineCore | None:
        """The core serving it."""
        return self.local.core

    def call(self, function: Callable[[], T]) -> T:
        """Run `function` on the core's loop and return its result."""
        return self.local.call(function)

    def start(self) -> None:
        """Load, build, listen (blocking); raises what the start raised."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.local.start(), self._loop).result()

    def stop(self) -> None:
        """Stop the core, then the thread (blocking)."""
        asyncio.run_coroutine_threadsafe(self.local.stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def serve_core_process(
    config: CoreConfig, path: str, observer: EngineObserver | None = None
) -> int:
    """The engine core process: serve on `path` until SIGTERM (0) or the engine dies (1).

    The supervisor sends SIGTERM once every front end has drained: nobody waits for what is
    left, so the engine stops at once.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine = await asyncio.to_thread(build_engine, config, observer)
    engine.start()
    core = EngineCore(engine)
    gc.collect()
    gc.freeze()  # the model and the engine live as long as the process: never walk them again
    server = await loop.create_unix_server(core.connection, path)
    served = asyncio.ensure_future(core.beat())
    stopped = asyncio.ensure_future(stop.wait())
    died = asyncio.ensure_future(_engine_death(engine))
    await asyncio.wait((served, stopped, died), return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if died.done():
        logger.error("engine core: %s; exiting", engine.dead_reason)
        await asyncio.sleep(DEAD_EXIT_DELAY_S)  # beats carry the reason to every front end
        code = 1
    elif served.done():
        logger.error("engine core: serving stopped", exc_info=served.exception())
        code = 1
    else:
        clean = await engine.drain(0.0)
        logger.info("engine core: stopped (%s)", "idle" if clean else "work left was cancelled")
    for task in (served, stopped, died):
        task.cancel()
    server.close()
    await engine.stop()
    return code


async def _engine_death(engine: Engine) -> None:
    while engine.dead_reason is None and engine.is_alive:
        await asyncio.sleep(0.1)
    if engine.dead_reason is None:
        engine.dead_reason = "the engine loop stopped"

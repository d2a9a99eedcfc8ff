"""Where the engine core runs: a thread here, or its own process (`poolserve/engine/process.py`).

Both load every model, build one engine per model and serve each with its own `EngineCore` on
its own Unix socket (model i on `socket_path(directory, i)`); front ends reach either through
`EngineClient`, so the single-process mode (tests, small CPU installs) runs the same code
paths, the sockets included. With two or more models the engines take turns on the device
(`poolserve/engine/turns.py`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from poolserve.engine.loop import Engine
from poolserve.engine.server import EngineCore
from poolserve.engine.turns import DeviceTurns, Seat
from poolserve.models.loader import load_model, resolve_dtype
from poolserve.models.quantization import check_quantization
from poolserve.models.spec import LoadedModel
from poolserve.types.errors import (
    ModelStartError,
    UnsupportedDtypeError,
    UnsupportedQuantizationError,
)
from poolserve.types.limits import SchedulerConfig
from poolserve.types.observer import EngineObserver
from poolserve.types.params import LogitCalibration
from poolserve.types.process import socket_path
from poolserve.types.tasks import CLASSIFIER_HEADS

if TYPE_CHECKING:  # the settings' records, read here; pydantic stays out of the engine
    from poolserve.config.core import CoreConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

# --dtype values; auto (None) lets the loader pick per device: float32 on CPU, bfloat16 on CUDA.
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
GIB = 1 << 30


def resolve_device(name: str) -> torch.device:
    """auto = cuda when available; cuda without a usable GPU is refused, naming the flag."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    elif name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available to torch")
    return torch.device(name)


def build_engines(
    configs: Sequence[CoreConfig], observers: Sequence[EngineObserver | None] | None = None
) -> tuple[Engine, ...]:
    """Load every model, one after another, and build its engine (blocking; none started).

    Two or more engines share one `DeviceTurns`; one alone runs without (no overhead). A model
    that fails raises `ModelStartError` naming it; the engines built before it never started.
    """
    if not configs:
        raise ValueError("the engine core needs at least one model")
    turns = DeviceTurns() if len(configs) > 1 else None
    engines = []
    for config, observer in zip(configs, observers or [None] * len(configs), strict=True):
        seat = None if turns is None else turns.seat(config.placement.priority)
        try:
            engines.append(build_engine(config, observer, seat))
        except Exception as exc:
            raise ModelStartError(config.model, exc) from exc
    return tuple(engines)


def build_engine(
    config: CoreConfig, observer: EngineObserver | None = None, turns_seat: Seat | None = None
) -> Engine:
    """Load the model and build its engine (blocking; not started); its memory share checked."""
    device = resolve_device(config.load.device)
    fraction = config.placement.gpu_memory_fraction
    measured = fraction is not None and device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if measured else 0
    engine = _load_and_build(config, device, observer, turns_seat)
    if fraction is None:
        return engine
    if not measured:
        logger.info(
            "model %r: gpu_memory_fraction %s ignored on %s", config.model, fraction, device
        )
        return engine
    try:
        # weights and KV pool: what this model's load and engine allocated on the device
        used = torch.cuda.memory_allocated(device) - before
        check_memory_fraction(used, fraction, torch.cuda.get_device_properties(device).total_memory)
    except ValueError:
        del engine  # its memory goes now, not with the traceback
        raise
    return engine


def check_memory_fraction(used_bytes: int, fraction: float, total_bytes: int) -> None:
    """Refuse a model holding more than its fraction of the device's memory, with the numbers."""
    cap = fraction * total_bytes
    if used_bytes > cap:
        raise ValueError(
            f"holds {used_bytes / GIB:.2f} GiB of device memory after loading (weights and KV "
            f"pool), more than its gpu_memory_fraction {fraction} of the device's "
            f"{total_bytes / GIB:.2f} GiB ({cap / GIB:.2f} GiB); raise the fraction, or lower "
            "max_model_len, max_num_batched_tokens or num_kv_blocks"
        )


def _load_and_build(
    config: CoreConfig,
    device: torch.device,
    observer: EngineObserver | None,
    turns_seat: Seat | None,
) -> Engine:
    """Load the model on `device` and build its engine."""
    load = config.load
    try:
        # before the load: a dtype the device cannot run fails at once, not after a download
        dtype = resolve_dtype(DTYPES[load.dtype], device)
    except UnsupportedDtypeError as exc:
        raise ValueError(f"--dtype {load.dtype}: {exc}; float32 runs everywhere") from exc
    try:
        check_quantization(load.quantization, device, dtype)
    except UnsupportedQuantizationError as exc:
        raise ValueError(f"--quantization {load.quantization}: {exc}") from exc
    loaded = load_model(
        load.model,
        device=device,
        dtype=dtype,
        hf_overrides=load.hf_overrides,
        revision=load.revision,
        quantization=load.quantization,
        allow_slower_precision=load.allow_slower_precision,
        lora=load.lora,
    )
    max_model_len = served_length(load.max_model_len, loaded, config.scheduler)
    calibration = config.pooler.calibration
    if calibration != LogitCalibration() and loaded.spec.head_kind not in CLASSIFIER_HEADS:
        logger.warning("logit_mean/logit_sigma have no effect: the model has no classifier head")
    return Engine(
        loaded,
        config.scheduler.sized(max_model_len, loaded.spec.is_causal),
        device,
        max_model_len=max_model_len,
        embed_pooling=config.pooler.embed_pooling,
        pooler_task=config.pooler.pooler_task,
        observer=observer,
        calibration=calibration,
        turns_seat=turns_seat,
    )


def served_length(asked: int | None, loaded: LoadedModel, scheduler: SchedulerConfig) -> int:
    """The longest prompt served: --max-model-len (refused later if a whole prompt cannot fit
    a step), else the model's own; a model whose prompts run whole (bidirectional attention)
    and that is left to its own length is served up to one step's budget, said in one line."""
    limit = loaded.spec.max_model_len
    if asked is not None:
        return min(asked, limit)
    budget = scheduler.max_num_batched_tokens
    if loaded.spec.is_causal or limit <= budget:
        return limit
    logger.warning(
        "model %s attends both ways, so each prompt runs whole in one step: its %d positions "
        "are served up to --max-num-batched-tokens %d; raise it to serve longer prompts",
        loaded.spec.architecture,
        limit,
        budget,
    )
    return budget


class LocalCore:
    """The engine core on the running event loop, one socket per model in a private directory.

    The single-process mode: the front end's loop also runs the engines' loop tasks and the
    core's side of the sockets, so a burst of requests reaches an engine as one step, as it
    does across processes, without a second Python thread contending for the GIL.
    """

    def __init__(
        self,
        configs: Sequence[CoreConfig],
        observers: Sequence[EngineObserver] | None = None,
    ) -> None:
        self.configs = tuple(configs)
        self.observers = observers
        self._directory = tempfile.mkdtemp(prefix="poolserve-core-")
        self.paths = tuple(socket_path(self._directory, i) for i in range(len(self.configs)))
        self.cores: tuple[EngineCore, ...] = ()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[asyncio.Server] = []
        self._beats: list[asyncio.Future[None]] = []

    @property
    def engines(self) -> tuple[Engine, ...]:
        """The engines served, model i's at i (for in-process inspection)."""
        return tuple(core.engine for core in self.cores)

    @property
    def engine(self) -> Engine:
        """The first model's engine."""
        assert self.cores, "start() first"
        return self.cores[0].engine

    def call(self, function: Callable[[], T]) -> T:
        """Run `function` on the core's loop from another thread (inspection, tests)."""
        assert self.loop is not None, "start() first"

        async def run() -> T:
            return function()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result()

    async def start(self) -> None:
        """Load and build every engine off the loop, start them, listen on every socket."""
        try:
            engines = await asyncio.to_thread(build_engines, self.configs, self.observers)
        except BaseException:
            shutil.rmtree(self._directory, ignore_errors=True)
            raise
        self.loop = asyncio.get_running_loop()
        for engine in engines:
            engine.start()
        self.cores = tuple(EngineCore(engine) for engine in engines)
        for core, path in zip(self.cores, self.paths, strict=True):
            self._servers.append(await self.loop.create_unix_server(core.connection, path))
            self._beats.append(asyncio.ensure_future(core.beat()))

    async def stop(self) -> None:
        """Stop listening; work still queued has nobody waiting for it: cancel it, stop."""
        for beats in self._beats:
            beats.cancel()
        for server in self._servers:
            server.close()
        await asyncio.gather(*(core.engine.drain(0.0) for core in self.cores))
        shutil.rmtree(self._directory, ignore_errors=True)


class CoreThread:
    """A `LocalCore` on its own loop in a thread: a core for a caller without a loop."""

    def __init__(
        self,
        configs: Sequence[CoreConfig],
        observers: Sequence[EngineObserver] | None = None,
    ) -> None:
        self.local = LocalCore(configs, observers)
        self.paths = self.local.paths
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="poolserve-core")

    @property
    def engines(self) -> tuple[Engine, ...]:
        """The engines served, model i's at i."""
        return self.local.engines

    @property
    def engine(self) -> Engine:
        """The first model's engine."""
        return self.local.engine

    @property
    def cores(self) -> tuple[EngineCore, ...]:
        """The cores serving them."""
        return self.local.cores

    def call(self, function: Callable[[], T]) -> T:
        """Run `function` on the core's loop and return its result."""
        return self.local.call(function)

    def start(self) -> None:
        """Load, build, listen (blocking); raises what the start raised, the thread ended."""
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.local.start(), self._loop).result()
        except BaseException:
            self._end_thread()
            raise

    def stop(self) -> None:
        """Stop the core, then the thread (blocking)."""
        asyncio.run_coroutine_threadsafe(self.local.stop(), self._loop).result()
        self._end_thread()

    def _end_thread(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

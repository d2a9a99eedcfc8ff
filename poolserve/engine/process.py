"""The engine-core process: every model's engine, one socket each, one exit code."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING

from poolserve.engine.host import build_engines
from poolserve.engine.loop import Engine
from poolserve.engine.server import EngineCore
from poolserve.types.observer import EngineObserver
from poolserve.types.process import socket_path

if TYPE_CHECKING:  # the settings' records, read here; pydantic stays out of the engine
    from poolserve.config.core import CoreConfig

logger = logging.getLogger(__name__)

# A core whose engine died (a device error) tells its front ends, then exits after this long.
DEAD_EXIT_DELAY_S = 1.0


async def serve_core_process(
    configs: Sequence[CoreConfig],
    directory: str,
    observers: Sequence[EngineObserver] | None = None,
) -> int:
    """Serve model i on `socket_path(directory, i)` until SIGTERM (0) or an engine dies (1).

    The supervisor sends SIGTERM once every front end has drained: nobody waits for what is
    left, so the engines stop at once. A model that fails to load raises `ModelStartError`.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engines = await asyncio.to_thread(build_engines, configs, observers)
    for engine in engines:
        engine.start()
    cores = [EngineCore(engine) for engine in engines]
    gc.collect()
    gc.freeze()  # the models and the engines live as long as the process: never walk them again
    os.makedirs(directory, exist_ok=True)
    servers = [
        await loop.create_unix_server(core.connection, socket_path(directory, i))
        for i, core in enumerate(cores)
    ]
    served = [asyncio.ensure_future(core.beat()) for core in cores]
    stopped = asyncio.ensure_future(stop.wait())
    died = [asyncio.ensure_future(_engine_death(engine)) for engine in engines]
    tasks = (*served, stopped, *died)
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    code = await _outcome(configs, engines, served, died)
    for task in tasks:
        task.cancel()
    for server in servers:
        server.close()
    for engine in engines:
        await engine.stop()
    return code


async def _outcome(
    configs: Sequence[CoreConfig],
    engines: Sequence[Engine],
    served: Sequence[asyncio.Future[None]],
    died: Sequence[asyncio.Future[None]],
) -> int:
    """Why serving ended, logged; the exit code (any engine dead: 1)."""
    dead = [(c, e) for c, e, d in zip(configs, engines, died, strict=True) if d.done()]
    for config, engine in dead:
        logger.error("engine core: model %r: %s; exiting", config.model, engine.dead_reason)
    if dead:
        await asyncio.sleep(DEAD_EXIT_DELAY_S)  # beats carry the reason to every front end
        return 1
    for beats in served:
        if beats.done():
            logger.error("engine core: serving stopped", exc_info=beats.exception())
            return 1
    cleans = await asyncio.gather(*(engine.drain(0.0) for engine in engines))
    logger.info("engine core: stopped (%s)", "idle" if all(cleans) else "work left was cancelled")
    return 0


async def _engine_death(engine: Engine) -> None:
    while engine.dead_reason is None and engine.is_alive:
        await asyncio.sleep(0.1)
    if engine.dead_reason is None:
        engine.dead_reason = "the engine loop stopped"

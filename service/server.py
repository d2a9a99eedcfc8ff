"""Runs the app under uvicorn; SIGTERM drains: 503 for new work, in-flight work finishes, exit 0."""

from __future__ import annotations

import logging
import time
from types import FrameType

import uvicorn

from service.app import create_app
from service.settings import ServerSettings
from service.state import ServiceState

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal starts a drain instead of closing sockets."""

    def __init__(self, config: uvicorn.Config, state: ServiceState) -> None:
        super().__init__(config)
        self.state = state
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain (readiness 503, new work 503); a second one exits at once."""
        if self.drain_deadline is not None or not self.state.ready:
            super().handle_exit(sig, frame)
            return
        logger.info(
            "signal %d: draining for up to %.1fs", sig, self.state.settings.shutdown_timeout
        )
        self.state.draining = True
        self.drain_deadline = time.monotonic() + self.state.settings.shutdown_timeout

    async def on_tick(self, counter: int) -> bool:
        """Exit once a drain has no in-flight work left or its deadline passed."""
        if self.drain_deadline is not None:
            engine_busy = self.state.engine is not None and bool(self.state.engine.queues)
            idle = self.state.active_requests == 0 and not engine_busy
            if idle or time.monotonic() >= self.drain_deadline:
                self.should_exit = True
        return await super().on_tick(counter)


def run_server(settings: ServerSettings) -> None:
    """Serve until drained."""
    app = create_app(settings)
    state: ServiceState = app.state.poolserve
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout)),
        access_log=False,
    )
    server = DrainingServer(config, state)
    server.run()  # uvicorn picks uvloop and httptools when installed

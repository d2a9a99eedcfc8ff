"""FastAPI app factory and lifespan: load, warm up, serve, drain."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.middleware.cors import CORSMiddleware

from poolserve.config.settings import ServerSettings
from poolserve.frontend.startup import new_state, start, stop
from poolserve.frontend.state import ServiceState
from poolserve.http import dispatch
from poolserve.http.api import admin, inference, lora, retrieval
from poolserve.http.batches import routes as batch_routes
from poolserve.http.batches.runner import BatchRunner
from poolserve.http.batches.store import BatchStore
from poolserve.http.compat import cohere, infinity, ollama, tei_embed, tei_predict, tei_tokens
from poolserve.http.compat.tei_common import TEIRoute
from poolserve.http.edge.handlers import install_error_handlers, openapi_schema
from poolserve.http.edge.middleware import EdgeMiddleware, InFlight, open_paths
from poolserve.http.routing import DirectRoutes, StrictJSONRoute
from poolserve.http.tenants import KeyRing, on_hangup
from poolserve.observability.logs import report_start_failure

logger = logging.getLogger(__name__)

# The edge makes each request's server span and the service counts its own metrics: FastAPI's
# native OpenTelemetry (FastAPI >= 0.165, on whenever a global provider is configured) would add
# a second span per request and checks the providers on every request.
FASTAPI_TELEMETRY_OFF: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI).parameters
    else {}
)


def create_app(
    settings: ServerSettings,
    core_address: str | None = None,
    *,
    owns_process: bool = False,
    state: ServiceState | None = None,
) -> FastAPI:
    """A server app; /ready turns 200 after warm-up.

    With `core_address` (a directory) the app is one front end of an engine core process whose
    models listen there (`socket_path(core_address, i)` for model i); without, its lifespan runs
    the engine core on its own loop (loading every model).
    `owns_process`: the app is all this process serves (its objects may be frozen after start).
    `state`: a front end already started by its owner (the Python API, `frontend/startup.py`),
    which also stops it; the lifespan then runs only the app's own parts (keys file, batches).
    """
    owns_state = state is None
    if state is None:
        state = new_state(settings, core_address, owns_process=owns_process)
    inflight = InFlight()
    batches = None
    if settings.batch_dir is not None:
        store = BatchStore(settings.batch_dir)
        batches = batch_routes.Batches(store, BatchRunner(store, state), settings)
    keys = None
    if settings.api_keys_file is not None:
        share = settings.api_server_count  # each front end enforces 1/N of every key's limits
        keys = KeyRing(settings.api_keys_file, settings.api_key, share, state.metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            if keys is not None:
                keys.load()  # checked before any process started; read here as it is now
            if owns_state:
                await start(state)
            if batches is not None:  # its lines answered by this app, below the edge's checks
                await asyncio.to_thread(batches.store.prepare)
                batches.runner.start(app)
        except BaseException as exc:
            state.start_failure = exc
            if owns_process:  # a server process: one line, as every start-up error is said
                report_start_failure("serve", exc)
            raise
        if owns_process:  # every front end re-reads the keys file on SIGHUP
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_hangup, keys)
        if state.address is not None:
            logger.info("listening on %s", state.address)
        try:
            yield
        finally:
            state.draining = True
            if batches is not None:  # before the engines: its lines in flight run again later
                await batches.runner.stop()
            if owns_state:  # the HTTP side had the drain
                await stop(state)

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
    app.state.api_keys = keys
    app.state.batches = batches
    install_error_handlers(app)
    # Vertex AI's routes: where the platform names them (AIP_PREDICT_ROUTE, AIP_HEALTH_ROUTE)
    vertex = APIRouter(route_class=StrictJSONRoute)
    dispatch.add_vertex_routes(vertex, settings.vertex_predict_route, settings.vertex_health_route)
    routers = (
        inference.router,
        admin.router,
        lora.router,
        retrieval.router,
        cohere.router,
        infinity.router,
        ollama.router,
        tei_embed.router,
        tei_predict.router,
        tei_tokens.router,
        dispatch.router,
        batch_routes.router,
        vertex,
    )
    for router in routers:
        app.include_router(router)
    # inside the edge (added first): every request still meets the edge's checks and accounting
    app.add_middleware(DirectRoutes, routes=[r for router in routers for r in router.routes])
    app.add_middleware(EdgeMiddleware, state=state, inflight=inflight, keys=keys)
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
    ollama_paths = {r.path for r in ollama.router.routes if isinstance(r, ollama.OllamaRoute)}
    app.openapi = partial(  # type: ignore[method-assign]
        openapi_schema, app, open_paths(settings), tei_paths, ollama_paths, inference.VOYAGE_PATHS
    )
    return app

"""The gRPC server of a front-end process (--grpc-port): TEI's tei.v1 services, grpc.health.v1 and
server reflection, on the front end's loop beside the HTTP server, started once the models are
served and stopped before the engine clients close.

Every front end binds the port with SO_REUSEPORT when there are several (--api-server-count), so
the kernel spreads connections as it does for the HTTP port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from poolserve.config.settings import ServerSettings
from poolserve.frontend.state import ServiceState
from poolserve.grpc import tei_pb2_grpc as pb_grpc
from poolserve.grpc.handling import Calls
from poolserve.grpc.tei_embed import EmbedService, PredictService, RerankService
from poolserve.grpc.tei_tokens import InfoService, TokenizeService
from poolserve.http.tenants import KeyRing

logger = logging.getLogger(__name__)

SERVICES = tuple(f"tei.v1.{name}" for name in ("Info", "Embed", "Predict", "Rerank", "Tokenize"))
HEALTH_POLL_S = 0.25  # how soon the health service follows readiness and drain
STOP_GRACE_S = 1.0  # calls still running when the process stops get this long


class GrpcStartError(OSError):
    """The gRPC port could not be bound."""


def build_server(
    state: ServiceState, keys: KeyRing | None = None
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The server with every service added (checking `keys`, the HTTP side's, when the
    --api-keys-file is set); not bound yet."""
    settings = state.settings
    options = [
        ("grpc.so_reuseport", 1 if settings.api_server_count > 1 else 0),
        ("grpc.max_receive_message_length", settings.payload_limit),
    ]
    server = grpc.aio.server(options=options)
    calls = Calls(state, keys)
    pb_grpc.add_InfoServicer_to_server(InfoService(calls), server)
    pb_grpc.add_EmbedServicer_to_server(EmbedService(calls), server)
    pb_grpc.add_PredictServicer_to_server(PredictService(calls), server)
    pb_grpc.add_RerankServicer_to_server(RerankService(calls), server)
    pb_grpc.add_TokenizeServicer_to_server(TokenizeService(calls), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    names = (*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return server, checks


def bind(server: grpc.aio.Server, settings: ServerSettings) -> int:
    """Bind --host:--grpc-port, with TLS when the HTTP side has it; the port bound."""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    address = f"{host}:{settings.grpc_port}"
    try:
        if settings.ssl_keyfile and settings.ssl_certfile:
            key = Path(settings.ssl_keyfile).read_bytes()
            chain = Path(settings.ssl_certfile).read_bytes()
            credentials = grpc.ssl_server_credentials([(key, chain)])
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc says a port it cannot bind this way
        raise GrpcStartError(f"cannot bind the gRPC port {address}: {exc}") from exc
    if port == 0:
        raise GrpcStartError(f"cannot bind the gRPC port {address}")
    return port


async def _follow_health(state: ServiceState, checks: health.aio.HealthServicer) -> None:
    """SERVING while the server is ready and not leaving, NOT_SERVING otherwise."""
    said: int | None = None
    while True:
        serving = state.ready and not state.leaving and not state.draining
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        if status != said:
            for name in ("", *SERVICES):
                await checks.set(name, status)
            said = status
        await asyncio.sleep(HEALTH_POLL_S)


@contextlib.asynccontextmanager
async def serving_grpc(state: ServiceState, keys: KeyRing | None = None) -> AsyncIterator[None]:
    """The gRPC server running on this loop for the block's length; with --api-keys-file it
    checks `keys`, the table the HTTP edge of this process checks and SIGHUP reloads."""
    if state.settings.api_keys_file is not None and keys is None:
        raise GrpcStartError("--api-keys-file: the gRPC server got no keys to check")
    server, checks = build_server(state, keys)
    port = bind(server, state.settings)
    await server.start()
    scheme = "grpcs" if state.settings.ssl_certfile else "grpc"
    logger.info("gRPC (tei.v1) listening on %s://%s:%d", scheme, state.settings.host, port)
    follower = asyncio.ensure_future(_follow_health(state, checks))
    try:
        yield
    finally:
        follower.cancel()
        await checks.enter_graceful_shutdown()
        await server.stop(STOP_GRACE_S)


def beside_http(
    settings: ServerSettings,
) -> tuple[Callable[[ServiceState, KeyRing | None], AbstractAsyncContextManager[None]], ...]:
    """What runs beside the HTTP server of a front end: the gRPC server when --grpc-port is set."""
    if settings.grpc_port is None:
        return ()
    return (serving_grpc,)

"""poolserve as a Ray Serve application: each replica owns its engines behind poolserve's own app.

Every replica builds the FastAPI app of `poolserve serve` (`poolserve.http.app.create_app`)
and Serve routes HTTP to it unchanged, so every route, error shape and metric is the same as on
a plain server. The app's lifespan runs inside the replica: the model loads and warms up before the
replica counts as started, and on shutdown Serve first waits for the requests in flight
(graceful_shutdown_timeout_s = --shutdown-timeout), then the lifespan drains the engine.

    serve run --app-dir deploy/ray poolserve_app:build num_replicas=2
    serve run --app-dir deploy/ray poolserve_app:build min_replicas=1 max_replicas=4
    serve run --app-dir deploy/ray poolserve_app:build models_config=deploy/models.yaml

Arguments (`key=value` after the import path; all optional):
    num_replicas          fixed replica count (default 1), or
    min_replicas/max_replicas with target_ongoing_requests (default 32): autoscaling on the
                          requests each replica has in flight
    max_ongoing_requests  requests Serve sends one replica at once (default 128: the engine
                          batches them; Serve's own default of 5 would starve it)
    gpus_per_replica      default 1 when the cluster has GPUs, else 0 (then the device is cpu)
    cpus_per_replica      default 1
    server                poolserve flags as one string, e.g. "--model Qwen/Qwen3-Embedding-0.6B",
                          or several models: "MODEL_A MODEL_B" (each replica serves them all)
    models_config         a models file (YAML, `poolserve serve --models-config`'s) read here,
                          where `serve run` runs, and handed to every replica: replicas on other
                          nodes need no copy of it (the models it names they still need)
Every flag can also come as a POOLSERVE_* variable in the replicas' environment.
"""

from __future__ import annotations

import logging
import shlex
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from poolserve.config.flags import parse_settings
from poolserve.config.models_file import served_models
from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app

logger = logging.getLogger(__name__)

REPLICA_HEADER = b"x-poolserve-replica"
DEFAULT_MAX_ONGOING = 128
DEFAULT_TARGET_ONGOING = 32


class ReplicaHeader:
    """Names the replica that answered, so a client can tell replicas apart (e.g. /metrics)."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.replica = replica.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Add the header to every HTTP answer; pass the lifespan through."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REPLICA_HEADER, self.replica)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_named)


@serve.ingress()
class PoolserveReplica:
    """One engine per model on one device; HTTP goes to poolserve's own app."""

    def __init__(self, server_args: list[str], models_text: str | None = None) -> None:
        if models_text is not None:  # the models file `build` read, written where we run
            path = Path(tempfile.mkdtemp(prefix="poolserve-models-")) / "models.yaml"
            path.write_text(models_text)
            server_args = [*server_args, "--models-config", str(path)]
        self.settings = _settings(server_args)
        self.state: Any = None

    def __serve_build_asgi_app__(self) -> ASGIApp:
        """The app of `poolserve serve`; Serve runs its lifespan (load, warm up, drain)."""
        app = create_app(self.settings)
        self.state = app.state.poolserve
        replica = serve.get_replica_context().replica_id.to_full_id_str()
        app.add_middleware(ReplicaHeader, replica=replica)
        return app

    async def check_health(self) -> None:
        """Healthy while every model is ready and its engine lives (Serve replaces it else)."""
        state = self.state
        if state is None or not state.ready or not state.models:
            raise RuntimeError("the models are not ready")
        for served in state.models:
            engine = served.engine
            if engine.dead_reason is not None or not engine.is_alive:
                raise RuntimeError(
                    f"model {served.name!r}: the engine stopped: {engine.dead_reason}"
                )


def _settings(server_args: list[str]) -> ServerSettings:
    """The server's settings from its flags and POOLSERVE_* variables, as `poolserve serve`."""
    return parse_settings(["serve", *server_args])


def build(args: dict[str, str]) -> Application:
    """The Serve application; `args` are the `key=value` pairs of `serve run`."""
    gpus = float(args.get("gpus_per_replica", 1 if _cluster_has_gpus() else 0))
    server_args = shlex.split(args.get("server", ""))
    if "--device" not in server_args:
        server_args += ["--device", "cuda" if gpus > 0 else "cpu"]
    models_file = args.get("models_config")
    if models_file is not None and "--models-config" in server_args:
        raise ValueError("give the models file as models_config= or in server=, not both")
    probe = _settings([*server_args, *(["--models-config", models_file] if models_file else [])])
    served_models(probe)  # a models clash (names, keys, fractions) fails here, before any replica
    models_text = None if models_file is None else Path(models_file).read_text()
    options: dict[str, Any] = {
        "ray_actor_options": {"num_gpus": gpus, "num_cpus": float(args.get("cpus_per_replica", 1))},
        "max_ongoing_requests": int(args.get("max_ongoing_requests", DEFAULT_MAX_ONGOING)),
        "health_check_period_s": 5,
        "health_check_timeout_s": 30,
        # Serve waits this long for in-flight requests before the lifespan drains the engine
        "graceful_shutdown_timeout_s": probe.shutdown_timeout,
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    if "min_replicas" in args or "max_replicas" in args:
        options["autoscaling_config"] = {
            "min_replicas": int(args.get("min_replicas", 1)),
            "max_replicas": int(args.get("max_replicas", 4)),
            "target_ongoing_requests": int(
                args.get("target_ongoing_requests", DEFAULT_TARGET_ONGOING)
            ),
        }
    else:
        options["num_replicas"] = int(args.get("num_replicas", 1))
    return serve.deployment(**options)(PoolserveReplica).bind(server_args, models_text)


def _cluster_has_gpus() -> bool:
    """Whether the Ray cluster this builds for has any GPU (starts a local one if none runs)."""
    if not ray.is_initialized():
        ray.init()
    return ray.cluster_resources().get("GPU", 0) > 0

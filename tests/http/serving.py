"""App clients over tiny checkpoints, real server processes, and Hugging Face references for
their outputs: the helpers of the tests that serve a model (tests/http, tests/frontend,
tests/config, tests/observability). Their fixtures are in tests/http/fixtures.py.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.tiny_models import build_hf_model

ClientFactory = Callable[..., "contextmanager[TestClient]"]
# Every name the conformance modules' MiniLM clients send (Cohere's SDK always sends a model).
LIVE_NAMES = ("minilm", "embed-v4.0", "embed-v5.0-fast")


@contextmanager
def queue_taken(
    client: TestClient, requests: int, tokens: int, model: str | None = None
) -> Iterator[None]:
    """Hold admission room in the engine core (as other requests would) until the block ends,
    in the engine of the model served as `model` (None: the default model).

    The room is taken on the core's loop and the block starts once the front end's copy of the
    counters shows it (the core's next message carries them).
    """
    state = client.app.state.poolserve  # type: ignore[attr-defined]
    served = state.find(model)
    core, front = state.core, served.engine
    engine = core.engines[state.models.index(served)]
    core.call(lambda: engine.admission.reserve(requests, tokens))
    try:
        _until(lambda: front.admission.queued_requests >= requests)
        yield
    finally:
        core.call(lambda: engine.admission.release(requests, tokens))
        _until(lambda: front.admission.queued_requests < requests)


def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the front end never saw the core's counters"
        time.sleep(0.01)


@contextmanager
def started_client(
    tiny_model_dir: Callable[[str], Path], name: str | None, **settings: object
) -> Iterator[TestClient]:
    """The app on the tiny checkpoint `name` (None: the bundled MiniLM), started, in a client."""
    model = str(tiny_model_dir(name)) if name else None
    app = create_app(ServerSettings(model=model, served_model_name=name or "minilm", **settings))
    with TestClient(app) as client:
        yield client


def hf_hidden(name: str, ids: list[int]) -> torch.Tensor:
    """Last hidden states of the Hugging Face backbone for one prompt."""
    model = build_hf_model(name)
    with torch.inference_mode():
        out = model.base_model(input_ids=torch.tensor([ids]))
    return out.last_hidden_state[0].float()  # [num_tokens, hidden]


def hf_logits(name: str, ids: list[int]) -> torch.Tensor:
    """Logits of the Hugging Face model with its own head for one prompt."""
    model = build_hf_model(name)
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def assert_close(got: object, want: torch.Tensor | np.ndarray) -> None:
    """float32 tolerance relative to the reference's scale."""
    ref = want.numpy() if isinstance(want, torch.Tensor) else want
    arr = np.asarray(got, dtype=np.float32)
    assert arr.shape == ref.shape, (arr.shape, ref.shape)
    scale = max(float(np.abs(ref).max()), 1e-6)
    assert float(np.abs(arr - ref).max()) <= 1e-4 * scale


@contextmanager
def live_server(*args: str) -> Iterator[httpx.Client]:
    """A real `poolserve serve ARGS` process and a client for it; SIGTERM at the end."""
    from tests.http.test_server_process import free_port, start_server

    port = free_port()
    process = start_server(port, *args)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            yield client
    finally:
        _stop(process)


def _stop(*processes: subprocess.Popen[bytes]) -> None:
    """SIGTERM to each, then wait for each (killed after 30 s)."""
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def serve_flags(model: Path | None, name: str, **settings: object) -> tuple[str, ...]:
    """The `poolserve serve` flags of the app `started_client` builds: `--model DIR` (None: the
    bundled MiniLM), `--served-model-name NAME` and each setting as its flag."""
    flags = [] if model is None else ["--model", str(model)]
    flags += ["--served-model-name", name]
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return tuple(flags)


class LiveServers:
    """Real `poolserve serve` processes, one per distinct list of flags, shared by every test
    that asks for the same flags; SIGTERM to each at `close`.

    `serve` answers at once with a client whose first request waits until its server is ready,
    so that the servers a module needs can start side by side (`start_together`): a start is
    seconds of imports, most of a port's time.
    """

    def __init__(self) -> None:
        self._starts = ThreadPoolExecutor(max_workers=4, thread_name_prefix="live-server")
        self._clients: dict[tuple[str, ...], httpx.Client] = {}
        self._processes: list[Future[subprocess.Popen[bytes]]] = []

    def serve(self, model: Path | None, name: str, **settings: object) -> httpx.Client:
        """A client of the server of `serve_flags(model, name, **settings)`, started if new."""
        from tests.http.test_server_process import free_port, start_server

        flags = serve_flags(model, name, **settings)
        if flags not in self._clients:
            port = free_port()
            started = self._starts.submit(start_server, port, *flags)
            self._processes.append(started)

            def wait_ready(_: httpx.Request) -> None:
                started.result()  # a failed start fails each request, with the server's log

            self._clients[flags] = httpx.Client(
                base_url=f"http://127.0.0.1:{port}",
                timeout=60,
                event_hooks={"request": [wait_ready]},
            )
        return self._clients[flags]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        _stop(*(started.result() for started in self._processes if started.exception() is None))
        self._starts.shutdown()


def start_together(request: pytest.FixtureRequest, servers: Sequence[str]) -> None:
    """Ask at once for the fixtures of `servers` (names of fixtures that call
    `LiveServers.serve`) that the module's selected tests use, so that their servers start side
    by side. A test's fixtures count, and a parameter's value that names one (the tests that
    pick their server with `request.getfixturevalue`)."""
    used: set[str] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            callspec = getattr(item, "callspec", None)
            params = callspec.params.values() if callspec else ()
            used |= set(getattr(item, "fixturenames", ())) | {str(value) for value in params}
    for name in servers:
        if name in used:
            request.getfixturevalue(name)


@contextmanager
def minilm_client(transport: str, live: Callable[[], httpx.Client]) -> Iterator[httpx.Client]:
    """The bundled MiniLM behind the in-process app ("app") or the real server ("live")."""
    if transport == "live":
        yield live()
        return
    settings = ServerSettings(model=None, served_model_name=list(LIVE_NAMES))
    with TestClient(create_app(settings)) as client:
        yield client

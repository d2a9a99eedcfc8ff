"""Local server processes: a free loopback port, a server in its own session, a wait until ready."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import httpx

from bench.common.repo import ROOT

# A server that does not start, answers wrongly, or dies under load (wrk then prints no summary).
SERVER_FAILURES: tuple[type[Exception], ...] = (
    RuntimeError,
    TimeoutError,
    ValueError,
    OSError,
    subprocess.SubprocessError,
    httpx.HTTPError,
)


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(probe: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll until probe() is true; TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout_s
    while not probe():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


@contextlib.contextmanager
def spawn(
    command: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Start a server process in its own session; always terminate (SIGTERM: its drain), then
    kill it if it hangs. env: the whole environment; by default this one, offline, no telemetry."""
    if env is None:
        env = {
            **os.environ,
            "DO_NOT_TRACK": "1",
            "INFINITY_ANONYMOUS_USAGE_STATS": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": str(ROOT),
        }
    log = log_path.open("ab")
    process = subprocess.Popen(
        list(command),
        cwd=ROOT,
        env=dict(env),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()

"""Real processes for the live tests: a poolserve server and a Prometheus server scraping it."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy.tools import DEPLOY_DIR, REPO_ROOT, free_port, require_tool

SERVER_READY_TIMEOUT_S = 180.0
PROMETHEUS_READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
HTTP_TIMEOUT_S = 30.0
LOG_TAIL_CHARS = 4000
# The server's own drain budget in tests: short, so teardown never waits long.
TEST_SHUTDOWN_TIMEOUT_S = "5"


@dataclass(frozen=True)
class LiveProcess:
    """A started process: where it answers and where its output goes."""

    name: str
    base_url: str
    log_path: Path


def server_command(port: int) -> list[str]:
    """`poolserve serve` from the venv's console script, else the CLI module."""
    venv_script = Path(sys.executable).parent / "poolserve"
    script = str(venv_script) if venv_script.exists() else shutil.which("poolserve")
    start = [script] if script else [sys.executable, "-m", "poolserve"]
    return [*start, "serve", "--port", str(port)]


def server_env() -> dict[str, str]:
    """This environment without any POOLSERVE_* setting, plus a CPU, offline, loopback server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POOLSERVE_")}
    env.update(
        {
            "POOLSERVE_HOST": "127.0.0.1",
            "POOLSERVE_DEVICE": "cpu",
            "POOLSERVE_SHUTDOWN_TIMEOUT": TEST_SHUTDOWN_TIMEOUT_S,
            "HF_HUB_OFFLINE": "1",
        }
    )
    return env


def log_tail(path: Path) -> str:
    """The end of a process log, for failure messages."""
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-LOG_TAIL_CHARS:]


@contextmanager
def started(
    name: str, args: Sequence[str], env: dict[str, str] | None, log_path: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """Start a process logging to a file; always stop it (SIGTERM, then SIGKILL) on exit."""
    with log_path.open("wb") as log:
        try:
            process = subprocess.Popen(
                list(args), cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        except OSError as exc:
            pytest.fail(f"could not start {name} ({' '.join(args)}): {exc}", pytrace=False)
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_TIMEOUT_S)


def wait_ready(
    process: subprocess.Popen[bytes],
    live: LiveProcess,
    path: str,
    timeout_s: float,
    verify: ssl.SSLContext | bool = True,
) -> None:
    """Poll `path` until it answers 200; fail with the log if the process exits or time runs out.

    `verify`: what an https server's certificate is checked against (a test's own CA).
    """
    deadline = time.monotonic() + timeout_s
    while process.poll() is None:
        try:
            if httpx.get(live.base_url + path, timeout=2.0, verify=verify).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(
                f"{live.name} did not answer 200 on {path} within {timeout_s:.0f} s; "
                f"log tail:\n{log_tail(live.log_path)}",
                pytrace=False,
            )
        time.sleep(0.25)
    pytest.fail(
        f"{live.name} exited with {process.returncode} before {path} answered 200; "
        f"log tail:\n{log_tail(live.log_path)}",
        pytrace=False,
    )


@contextmanager
def poolserve_server(
    workdir: Path, settings: dict[str, str] | None = None
) -> Iterator[LiveProcess]:
    """`poolserve serve` on a free loopback port with its default (embedded) model, ready;
    `settings`: POOLSERVE_* variables beside the defaults."""
    port = free_port()
    live = LiveProcess("poolserve", f"http://127.0.0.1:{port}", workdir / "poolserve.log")
    env = {**server_env(), **(settings or {})}
    with started(live.name, server_command(port), env, live.log_path) as process:
        wait_ready(process, live, "/ready", SERVER_READY_TIMEOUT_S)
        yield live


def prometheus_config(target: str, workdir: Path) -> Path:
    """A config scraping `target` every second, with the project's alert rules."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(DEPLOY_DIR / "alerts.yml")],
        "scrape_configs": [
            {
                "job_name": "poolserve",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [target]}],
            }
        ],
    }
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def prometheus_server(scrape_target: str, workdir: Path) -> Iterator[LiveProcess]:
    """A real Prometheus on a free loopback port with temp storage, ready."""
    port = free_port()
    live = LiveProcess("prometheus", f"http://127.0.0.1:{port}", workdir / "prometheus.log")
    args = [
        require_tool("prometheus"),
        f"--config.file={prometheus_config(scrape_target, workdir)}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with started(live.name, args, None, live.log_path) as process:
        wait_ready(process, live, "/-/ready", PROMETHEUS_READY_TIMEOUT_S)
        yield live


def query(prometheus: LiveProcess, promql: str) -> list[dict[str, Any]]:
    """Result vector of an instant query through Prometheus's HTTP API (fails on API errors)."""
    response = httpx.get(
        prometheus.base_url + "/api/v1/query", params={"query": promql}, timeout=HTTP_TIMEOUT_S
    )
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", (promql, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result

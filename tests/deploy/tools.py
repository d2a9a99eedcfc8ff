"""Shared helpers of the deployment tests: repository paths, external tools, dashboard queries."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = REPO_ROOT / "deploy"
DASHBOARD = DEPLOY_DIR / "grafana" / "dashboards" / "poolserve.json"
# Where each external tool comes from; `bash scripts/install-test-tools.sh` installs the apt ones.
SOURCE_OF_TOOL = {
    "promtool": "Debian's `prometheus` package",
    "prometheus": "Debian's `prometheus` package",
    "docker-compose": "Debian's `docker-compose` package",
    "haproxy": "Debian's `haproxy` package",
    "openssl": "Debian's `openssl` package",
    "hadolint": "the dev extra (`pip install -e '.[dev]'`)",
    "shellcheck": "the dev extra (`pip install -e '.[dev]'`)",
}
INSTALL_HINT = "`bash scripts/install-test-tools.sh` installs the apt packages as root or with sudo"
TOOL_TIMEOUT_S = 120.0
METRIC_NAME = re.compile(r"\bpoolserve_[A-Za-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Grafana's own variables, replaced by plain PromQL so that promtool and Prometheus can parse.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$instance": ".*",
    "$model": ".*",
}

T = TypeVar("T")


@dataclass(frozen=True)
class ToolResult:
    """Exit status and output of one external tool run."""

    args: tuple[str, ...]
    returncode: int
    output: str

    def describe(self) -> str:
        """Command line, status and output, for assertion messages."""
        return f"$ {' '.join(self.args)}\nexit {self.returncode}\n{self.output}"


def in_ci() -> bool:
    """Whether the CI variable is set, as CI services set it (`CI=true`)."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def require_tool(name: str) -> str:
    """Path of an external tool (the venv's bin first); skips saying what to install if missing.

    Under CI the tools are installed by `make test`, so a missing one fails the test instead.
    """
    venv_tool = Path(sys.executable).parent / name
    found = str(venv_tool) if venv_tool.exists() else shutil.which(name)
    if found is None:
        source = SOURCE_OF_TOOL.get(name, "its package")
        message = f"{name} is not installed: install {source}; {INSTALL_HINT}"
        if in_ci():
            pytest.fail(f"{message} (CI is set: a missing tool is a failure)", pytrace=False)
        pytest.skip(message)
    return found


def run_tool(args: Sequence[str], stdin: str | None = None, cwd: Path = REPO_ROOT) -> ToolResult:
    """Run a tool to completion with a timeout; stdout and stderr together."""
    completed = subprocess.run(
        list(args),
        input=stdin,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
        check=False,
    )
    return ToolResult(tuple(args), completed.returncode, completed.stdout + completed.stderr)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(probe: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Poll `probe` until it returns a value; fail with `what` when `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}", pytrace=False)
        time.sleep(0.25)


def load_dashboard() -> dict[str, object]:
    """The provisioned Grafana dashboard."""
    loaded: dict[str, object] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_queries() -> list[str]:
    """Every query string in the dashboard: panel target `expr`s and templating queries."""
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "query", "definition") and isinstance(value, str):
                    found.append(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(load_dashboard())
    return found


def panel_exprs() -> list[str]:
    """The PromQL of every panel target, with Grafana variables replaced."""
    exprs = [q for q in dashboard_queries() if not q.startswith("label_values(")]
    return [_substitute(e) for e in exprs]


def _substitute(expr: str) -> str:
    """Replace Grafana variables (longest names first) with plain PromQL."""
    for variable in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(variable, GRAFANA_VARIABLES[variable])
    return expr


def metric_families(queries: Sequence[str]) -> set[str]:
    """poolserve_* names the queries read, with histogram sample suffixes stripped."""
    names = {m.group(0) for q in queries for m in METRIC_NAME.finditer(q)}
    return {_strip_histogram_suffix(n) for n in names}


def _strip_histogram_suffix(name: str) -> str:
    """`x_bucket` / `x_sum` / `x_count` -> `x`."""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def exposition_families(text: str) -> set[str]:
    """Metric family names declared by `# TYPE` lines of a text exposition."""
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


class StubServer(ThreadingHTTPServer):
    """A loopback HTTP server whose per-path status the test sets."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), _StatusHandler)
        self.status_for: dict[str, int] = {}


class _StatusHandler(BaseHTTPRequestHandler):
    """Answers every GET with the status the stub holds for its path (404 by default)."""

    def do_GET(self) -> None:
        assert isinstance(self.server, StubServer)
        self.send_response(self.server.status_for.get(self.path, 404))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        """Keep test output quiet."""


@contextmanager
def running_stub() -> Iterator[StubServer]:
    """A stub server serving in a thread, shut down on exit."""
    server = StubServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def thp_mode() -> str:
    """The kernel's transparent huge page mode (always, madvise, never), or "" without THP."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.is_file() else ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def huge_pages_mib(pid: int) -> int:
    """How much of a process's anonymous memory lies on transparent huge pages, in MiB."""
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return int(rollup.split("AnonHugePages:", 1)[1].split()[0]) // 1024


def maps_library(pid: int, name: str) -> bool:
    """Whether a shared library whose file name contains `name` is mapped into a process."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return any(name in line.rsplit("/", 1)[-1] for line in lines)


def require_tcmalloc() -> str:
    """tcmalloc's soname (poolserve/memory.py finds it so); skips saying what to install if
    missing, and fails under CI, where `make test` installs it."""
    from poolserve.memory import TCMALLOC_PACKAGE, find_tcmalloc

    found = find_tcmalloc()
    if found is None:
        message = f"tcmalloc is not installed: install {TCMALLOC_PACKAGE}; {INSTALL_HINT}"
        if in_ci():
            pytest.fail(f"{message} (CI is set: a missing library is a failure)", pytrace=False)
        pytest.skip(message)
    return found

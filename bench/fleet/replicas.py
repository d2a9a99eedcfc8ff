"""Real processes of a fleet: `poolserve serve` replicas and the HAProxy in front of them.

Used by `python -m bench fleet` and by tests/deploy/test_rolling_restart.py. HAProxy runs the
shipped deploy/haproxy/haproxy.cfg with the addresses in its environment; `retrying=False` runs a
copy without request buffering and L7 retries (a balancer that cannot replay a POST).
"""

from __future__ import annotations

import contextlib
import csv
import io
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from bench.common.procs import free_port, wait_for
from bench.common.repo import ROOT

logger = logging.getLogger(__name__)

HAPROXY_CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
NUM_CONFIGURED_SERVERS = 3  # server lines in the shipped config
READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0
# What a balancer that cannot replay a sent request keeps of the shipped config.
NO_REPLAY = {
    "    option http-buffer-request\n": "",
    "    retry-on conn-failure empty-response junk-response 503\n": "    retry-on conn-failure\n",
}


def _get_status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2.0).status_code
    except httpx.HTTPError:
        return None


class Replica:
    """One `poolserve serve` process on a fixed loopback port; restartable."""

    def __init__(self, name: str, workdir: Path, server_args: Sequence[str]) -> None:
        self.name = name
        self.port = free_port()
        self.log_path = workdir / f"{name}.log"
        self.server_args = list(server_args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """host:port."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the process (its log appends to the replica's file)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("POOLSERVE_")}
        env.update({"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
        command = [
            sys.executable,
            "-m",
            "poolserve",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            *self.server_args,
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def is_ready(self) -> bool:
        """/ready answers 200 (fails when the process has exited)."""
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"{self.name} is not running; log: {self.log_path}")
        return _get_status(f"http://{self.address}/ready") == 200

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (the drain), wait for the exit; SIGKILL past the timeout. The exit code."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def kill(self) -> None:
        """Cleanup: end the process whatever its state."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class Balancer:
    """HAProxy (foreground) on the shipped config with the replicas' addresses."""

    def __init__(self, workdir: Path, addresses: Sequence[str], retrying: bool = True) -> None:
        if len(addresses) > NUM_CONFIGURED_SERVERS:
            raise ValueError(f"the config has {NUM_CONFIGURED_SERVERS} server lines")
        self.port, self.stats_port = free_port(), free_port()
        self.config = _config(workdir, retrying)
        self.log_path = workdir / "haproxy.log"
        self.env = {
            **os.environ,
            "POOLSERVE_LB_BIND": f"127.0.0.1:{self.port}",
            "POOLSERVE_LB_STATS": f"127.0.0.1:{self.stats_port}",
        }
        # unused server lines point at a closed port: always down, never chosen
        padded = [*addresses, *[f"127.0.0.1:{free_port()}"] * NUM_CONFIGURED_SERVERS]
        for index, address in enumerate(padded[:NUM_CONFIGURED_SERVERS], start=1):
            self.env[f"POOLSERVE_REPLICA_{index}"] = address
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Where clients connect."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Run haproxy in the foreground; wait for its stats page."""
        binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [binary, "-db", "-f", str(self.config)],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for(lambda: self._stats_up(), 20.0, "haproxy's stats page")

    def _stats_up(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"haproxy exited; log: {self.log_path}")
        return _get_status(f"http://127.0.0.1:{self.stats_port}/stats;csv") == 200

    def servers(self) -> dict[str, dict[str, str]]:
        """The backend's rows of HAProxy's stats CSV, by server name."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5.0).text
        rows = csv.DictReader(io.StringIO(text.removeprefix("# ")))
        return {
            r["svname"]: r
            for r in rows
            if r["pxname"] == "poolserve" and r["svname"] not in ("FRONTEND", "BACKEND")
        }

    def wait_status(self, server: str, status: str, timeout_s: float = 30.0) -> None:
        """Wait until HAProxy's checks put a server in `status` (UP, DOWN)."""
        wait_for(
            lambda: self.servers()[server]["status"] == status,
            timeout_s,
            f"haproxy to see {server} {status}",
        )

    def served(self) -> dict[str, int]:
        """2xx answers per server since HAProxy started (restarts of replicas included)."""
        return {name: int(row["hrsp_2xx"] or 0) for name, row in self.servers().items()}

    def stop(self) -> None:
        """Stop haproxy."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


def _config(workdir: Path, retrying: bool) -> Path:
    """The shipped config, or a copy that cannot replay a request."""
    if retrying:
        return HAPROXY_CONFIG
    text = HAPROXY_CONFIG.read_text()
    for line, replacement in NO_REPLAY.items():
        if line not in text:
            raise ValueError(f"{HAPROXY_CONFIG} no longer has {line.strip()!r}")
        text = text.replace(line, replacement)
    path = workdir / "haproxy-no-replay.cfg"
    path.write_text(text)
    return path


@contextlib.contextmanager
def fleet(
    workdir: Path,
    num_replicas: int,
    server_args: Sequence[str],
    *,
    retrying: bool = True,
    num_started: int | None = None,
) -> Iterator[tuple[list[Replica], Balancer]]:
    """Replicas (the first num_started of them running and ready) behind a running HAProxy."""
    replicas = [Replica(f"replica{i}", workdir, server_args) for i in range(1, num_replicas + 1)]
    balancer = Balancer(workdir, [r.address for r in replicas], retrying)
    running = replicas[: num_replicas if num_started is None else num_started]
    try:
        for replica in running:
            replica.start()
        for replica in running:
            wait_for(replica.is_ready, READY_TIMEOUT_S, f"{replica.name} ready")
        balancer.start()
        for replica in replicas:  # HAProxy starts every server UP; the checks settle it
            balancer.wait_status(replica.name, "UP" if replica in running else "DOWN")
        yield replicas, balancer
    finally:
        balancer.stop()
        for replica in replicas:
            replica.kill()


def restart(replica: Replica, balancer: Balancer) -> int:
    """SIGTERM, wait for the exit, start again, wait until HAProxy routes to it. Exit code."""
    code = replica.stop()
    logger.info("%s exited with %d; starting it again", replica.name, code)
    balancer.wait_status(replica.name, "DOWN")
    replica.start()
    wait_for(replica.is_ready, READY_TIMEOUT_S, f"{replica.name} ready again")
    balancer.wait_status(replica.name, "UP")
    return code

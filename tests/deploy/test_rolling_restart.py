"""Zero-loss rolling restart: three real replicas behind the shipped HAProxy config, under load."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import orjson
import pytest

from bench.common.procs import wait_for
from bench.fleet.load import ClosedLoop
from bench.fleet.replicas import Replica, fleet, restart
from tests.deploy.tools import require_tool, run_tool

pytestmark = pytest.mark.slow

# Small budgets: three replicas share the machine with the load.
SERVER_ARGS = (
    "--max-num-batched-tokens",
    "1024",
    "--max-num-seqs",
    "64",
    "--shutdown-timeout",
    "20",
    "--drain-delay",
    "3",
    "--log-level",
    "warning",
)
CONCURRENCY = 4
MAX_REQUESTS = 20_000  # the bound; the restarts end the run long before it
DELAY_S = 4.0  # the handshake test's --drain-delay: room for a slow machine inside it
CONFIG_ENV = {f"POOLSERVE_REPLICA_{i}": f"127.0.0.1:{9000 + i}" for i in (1, 2, 3)}


def test_shipped_config_is_valid() -> None:
    haproxy = require_tool("haproxy")
    result = run_tool(
        [
            "env",
            *(f"{k}={v}" for k, v in CONFIG_ENV.items()),
            haproxy,
            "-c",
            "-f",
            "deploy/haproxy/haproxy.cfg",
        ]
    )
    assert result.returncode == 0, result.describe()


def test_drain_delay_withdraws_readiness_before_refusing_work(tmp_path: Path) -> None:
    replica = Replica(
        "handshake", tmp_path, ["--drain-delay", str(DELAY_S), "--shutdown-timeout", "10"]
    )
    body = orjson.dumps({"input": ["a sentence"]})
    replica.start()
    try:
        wait_for(replica.is_ready, 180.0, "the replica ready")
        headers = {"content-type": "application/json"}
        with httpx.Client(
            base_url=f"http://{replica.address}", headers=headers, timeout=30.0
        ) as client:
            before = client.post("/v1/embeddings", content=body)
            assert before.status_code == 200 and "connection" not in before.headers
            assert replica.process is not None
            replica.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            wait_for(lambda: client.get("/ready").status_code == 503, 3.0, "/ready 503")
            served = client.post("/v1/embeddings", content=body)
            within_delay = time.monotonic() - signalled < DELAY_S
            # still served inside the delay, and the answer closes its connection
            assert within_delay and served.status_code == 200
            assert served.headers["connection"] == "close"
            # after the delay: 503, or no listener at all once the idle server has exited
            wait_for(lambda: _refused(client, body), 5.0, "new work refused after the delay")
        assert replica.process.wait(timeout=15) == 0
    finally:
        replica.kill()


def _refused(client: httpx.Client, body: bytes) -> bool:
    try:
        return client.post("/v1/embeddings", content=body).status_code == 503
    except httpx.TransportError:
        return True


def test_rolling_restart_behind_haproxy_loses_nothing(tmp_path: Path) -> None:
    require_tool("haproxy")
    with fleet(tmp_path, 3, SERVER_ARGS) as (replicas, balancer):
        load = ClosedLoop(
            balancer.url + "/v1/embeddings", CONCURRENCY, max_requests=MAX_REQUESTS
        ).start()
        try:
            codes = [restart(replica, balancer) for replica in replicas]
        finally:
            summary = load.stop()
        served = balancer.served()
    assert codes == [0, 0, 0]
    assert summary.failed == 0, summary.failures
    assert summary.sent > 50, summary
    assert all(served[r.name] > 0 for r in replicas), served

"""`python -m bench api-keys`: what API keys cost a request at the edge, in this process.

For each way of running (no key, `--api-key`, `--api-keys-file` with 1 to 1,000 keys, the key
found last or limited), the edge's check of one request (`EdgeMiddleware._check`: the key, the
route, the buckets, the content length) and a whole pass through the edge to a constant answer
(the check, the request id, the headers, the metrics, the access log switched off), in
microseconds per request, best of `--repeat` runs of `--number` requests. The token charge a
keys-file request also pays once its prompt is admitted is timed on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import tempfile
import timeit
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from poolserve.config.settings import ServerSettings
from poolserve.frontend.state import ServiceState
from poolserve.http.edge.middleware import EdgeMiddleware, InFlight
from poolserve.http.tenants import KeyRing
from poolserve.observability.metrics import ServiceMetrics

logger = logging.getLogger(__name__)

KEY = "sk-bench-0123456789abcdef"
LIMITS = "requests_per_second: 1000000000\n    tokens_per_minute: 1000000000000\n"


async def _constant(scope: Scope, receive: Receive, send: Send) -> None:
    """The app behind the edge: a constant answer."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def _keys_file(folder: Path, count: int, limited: bool) -> Path:
    """`count` keys, the bench's key last (every digest is compared anyway)."""
    lines = ["keys:"]
    for index in range(count):
        key = KEY if index == count - 1 else f"sk-other-{index:06d}"
        digest = hashlib.sha256(key.encode()).hexdigest()
        lines.append(f"  - name: tenant-{index}\n    key: sha256:{digest}")
        if limited:
            lines.append(f"    {LIMITS}")
    path = folder / f"keys-{count}-{int(limited)}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _edge(settings: ServerSettings) -> EdgeMiddleware:
    state = ServiceState(settings=settings, metrics=ServiceMetrics())
    keys = None
    if settings.api_keys_file is not None:
        keys = KeyRing(settings.api_keys_file, settings.api_key, 1, state.metrics)
        keys.load()
    return EdgeMiddleware(_constant, state=state, inflight=InFlight(), keys=keys)


def _scope() -> dict[str, Any]:
    headers = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"content-length", b"18"),
        (b"authorization", f"Bearer {KEY}".encode()),
    ]
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/embeddings",
        "raw_path": b"/v1/embeddings",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "state": {},
    }


def _best(work: Callable[[], object], number: int, repeat: int) -> float:
    """Microseconds per call, the best of `repeat` runs."""
    return min(timeit.repeat(work, number=number, repeat=repeat)) / number * 1e6


def _edge_pass(edge: EdgeMiddleware, number: int, repeat: int) -> float:
    """Microseconds per request through the whole edge, on one event loop."""

    async def receive() -> Message:
        return {"type": "http.request", "body": b'{"input": "hello"}', "more_body": False}

    async def send(message: Message) -> None:
        return None

    async def many() -> None:
        for _ in range(number):
            await edge(_scope(), receive, send)

    loop = asyncio.new_event_loop()
    try:
        return _best(lambda: loop.run_until_complete(many()), 1, repeat) / number
    finally:
        loop.close()


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table of per-request costs: every case measured in each round, the best kept."""
    parser = argparse.ArgumentParser(prog="python -m bench api-keys", description=__doc__)
    parser.add_argument("--keys", type=int, nargs="+", default=[1, 10, 100, 1000])
    parser.add_argument("--number", type=int, default=20000, help="requests per run")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the best is kept")
    parser.add_argument("--quick", action="store_true", help="fewer requests per run")
    args = parser.parse_args(argv)
    number = 2000 if args.quick else args.number
    logging.getLogger("poolserve.access").setLevel(logging.WARNING)
    folder = Path(tempfile.mkdtemp(prefix="bench-api-keys-"))
    cases: list[tuple[str, dict[str, Any]]] = [("no key", {}), ("--api-key", {"api_key": KEY})]
    for count in args.keys:
        for limited in (False, True):
            path = str(_keys_file(folder, count, limited))
            label = f"--api-keys-file, {count} key(s){', limits' if limited else ''}"
            cases.append((label, {"api_keys_file": path}))
    edges = [_edge(ServerSettings(access_log=False, **overrides)) for _, overrides in cases]
    headers = {"authorization": f"Bearer {KEY}", "content-length": "18"}
    checks = [float("inf")] * len(cases)
    wholes = [float("inf")] * len(cases)
    for _ in range(args.repeat):  # the cases take turns: the machine's drift hits them alike
        for index, edge in enumerate(edges):
            scope = _scope()
            work = partial(edge._check, scope, False, headers, None)
            checks[index] = min(checks[index], _best(work, number, 1))
            wholes[index] = min(wholes[index], _edge_pass(edge, number, 1))
    print("| edge | check (us) | whole edge (us) |")
    print("|---|---:|---:|")
    for (label, _), check, whole in zip(cases, checks, wholes, strict=True):
        print(f"| {label} | {check:.2f} | {whole:.2f} |")
    ring = KeyRing(str(_keys_file(folder, 1, True)), None, 1, ServiceMetrics())
    ring.load()
    tenant = ring.find(KEY.encode())
    assert tenant is not None
    charge = _best(partial(tenant.charge, 17), number, args.repeat)
    print(f"\nprompt tokens charged to a limited key, once admitted: {charge:.2f} us")

"""Interactive latency under a running batch (`python -m bench batch`).

One `poolserve serve --batch-dir` on the bundled MiniLM. Interactive requests (one short text
each on /v1/embeddings) arrive at a fixed rate, open loop, for the same time in three phases:
without a batch, while a large batch runs, and without again (the two quiet phases bracket the
machine's drift). Reported: each phase's p50 and p99, the batch phase's p99 against the quiet
phases' mean, and the lines the batch answered meanwhile (the capacity it took).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.common.loadgen import percentile_ms
from bench.common.procs import free_port, spawn, wait_for
from bench.common.repo import ROOT


def _line(number: int, inputs: int) -> str:
    texts = [
        f"document {number} part {k}: "
        + " ".join(f"w{(number + k * 13 + j) % 211}" for j in range(60))
        for k in range(inputs)
    ]
    body = {"model": "minilm", "input": texts}
    return json.dumps(
        {"custom_id": f"r{number}", "method": "POST", "url": "/v1/embeddings", "body": body}
    )


async def _interactive(base: str, rate: float, seconds: float) -> list[float]:
    """Latencies (s) of requests sent every 1/rate s for `seconds`, whatever the answers' pace."""
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:

        async def one(index: int) -> None:
            started = time.perf_counter()
            answer = await client.post("/v1/embeddings", json={"input": f"a short query {index}"})
            answer.raise_for_status()
            latencies.append(time.perf_counter() - started)

        tasks = []
        start = time.perf_counter()
        for index in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + index / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(index)))
        await asyncio.gather(*tasks)
    return latencies


def _batch_counts(client: httpx.Client, batch_id: str) -> tuple[str, int]:
    batch = client.get(f"/v1/batches/{batch_id}").json()
    return batch["status"], batch["request_counts"]["completed"]


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench batch", description=__doc__)
    parser.add_argument("--rate", type=float, default=10.0, help="interactive requests a second")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    parser.add_argument("--lines", type=int, default=3000, help="the batch's lines")
    parser.add_argument("--inputs", type=int, default=16, help="texts per batch line")
    args = parser.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as folder:
        command = [
            str(ROOT / ".venv" / "bin" / "python"),
            "-m",
            "poolserve",
            "serve",
            "--port",
            str(port),
            "--served-model-name",
            "minilm",
            "--batch-dir",
            folder,
        ]
        with (
            spawn(command, Path(folder) / "server.log"),
            httpx.Client(base_url=base, timeout=120) as http,
        ):
            wait_for(lambda: _ready(http), 180, "the server")
            asyncio.run(_interactive(base, args.rate, 5.0))  # warm-up
            quiet_before = asyncio.run(_interactive(base, args.rate, args.seconds))
            lines = "\n".join(_line(i, args.inputs) for i in range(args.lines)).encode()
            uploaded = http.post(
                "/v1/files", files={"purpose": (None, "batch"), "file": ("in.jsonl", lines)}
            ).json()
            batch = http.post(
                "/v1/batches",
                json={
                    "input_file_id": uploaded["id"],
                    "endpoint": "/v1/embeddings",
                    "completion_window": "24h",
                },
            ).json()
            wait_for(
                lambda: _batch_counts(http, batch["id"])[1] > 0, 120, "the batch's first lines"
            )
            _, done_before = _batch_counts(http, batch["id"])
            started = time.monotonic()
            under_batch = asyncio.run(_interactive(base, args.rate, args.seconds))
            elapsed = time.monotonic() - started
            status, done_after = _batch_counts(http, batch["id"])
            http.post(f"/v1/batches/{batch['id']}/cancel")
            wait_for(lambda: _batch_counts(http, batch["id"])[0] == "cancelled", 60, "the cancel")
            quiet_after = asyncio.run(_interactive(base, args.rate, args.seconds))
    if status != "in_progress":
        print(f"the batch was {status} at the end of its phase: raise --lines")
    rows = [
        ("no batch (before)", quiet_before),
        ("batch running", under_batch),
        ("no batch (after)", quiet_after),
    ]
    print(f"interactive: {args.rate:g} requests/s, {args.seconds:g} s per phase")
    print("| phase | requests | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|")
    for name, values in rows:
        p50, p99 = percentile_ms(values, 0.5), percentile_ms(values, 0.99)
        print(f"| {name} | {len(values)} | {p50:.1f} | {p99:.1f} |")
    quiet = (percentile_ms(quiet_before, 0.99) + percentile_ms(quiet_after, 0.99)) / 2
    print(f"p99 under the batch / quiet p99: {percentile_ms(under_batch, 0.99) / quiet:.2f}x")
    lines_done = done_after - done_before
    print(
        f"batch lines answered meanwhile: {lines_done} ({lines_done / elapsed:.1f} lines/s, "
        f"{lines_done * args.inputs / elapsed:.0f} texts/s)"
    )


def _ready(http: httpx.Client) -> bool:
    try:
        return http.get("/ready").status_code == 200
    except httpx.HTTPError:
        return False

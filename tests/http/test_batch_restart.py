"""A batch survives kill -9: a real `poolserve serve` with two front ends runs a batch, every
process of it is killed mid-batch, and a new server on the same --batch-dir finishes the batch
with every line written exactly once, in order, each equal to the online answer."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import openai
import psutil

from tests.http.test_server_process import free_port, start_server

# About 2.5 s of MiniLM's work on two quiet cores: the first progress (after 1 s) comes while
# most lines still wait, and the whole test stays short.
LINES = 200
INPUTS = 2


def _text(line: int, item: int) -> str:
    return f"line {line} item {item}: " + " ".join(
        f"word{(line * 7 + item * 3 + k) % 97}" for k in range(40)
    )


def _serve(folder: Path) -> tuple[object, openai.OpenAI, str]:
    port = free_port()
    args = ("--served-model-name", "minilm", "--batch-dir", str(folder), "--api-server-count", "2")
    process = start_server(port, *args)
    base = f"http://127.0.0.1:{port}"
    return process, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60), base


def _kill_all(pid: int) -> None:
    """SIGKILL to the server and every process under it at once: nobody stops cleanly."""
    parent = psutil.Process(pid)
    tree = [*parent.children(recursive=True), parent]
    for process in tree:
        process.send_signal(signal.SIGKILL)
    psutil.wait_procs(tree, timeout=30)


def test_a_batch_killed_mid_run_finishes_after_a_restart_exactly_once(tmp_path: Path) -> None:
    folder = tmp_path / "batches"
    lines = [
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "minilm", "input": [_text(i, j) for j in range(INPUTS)]},
            }
        )
        for i in range(LINES)
    ]
    process, client, _ = _serve(folder)
    try:
        uploaded = client.files.create(
            file=("in.jsonl", "\n".join(lines).encode()), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        deadline = time.monotonic() + 120
        while True:  # killed once some lines are on disk and many are not
            seen = client.batches.retrieve(batch.id)
            assert seen.status in ("validating", "in_progress"), seen
            if seen.request_counts is not None and seen.request_counts.completed > 0:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        _kill_all(process.pid)  # type: ignore[attr-defined]
    assert seen.request_counts.completed < LINES
    process, client, _ = _serve(folder)
    try:
        deadline = time.monotonic() + 300
        while (ended := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, ended
            time.sleep(0.2)
        assert ended.status == "completed", ended
        counts = ended.request_counts
        assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
        assert ended.error_file_id is None
        outputs = [
            json.loads(x) for x in client.files.content(ended.output_file_id).text.splitlines()
        ]
        assert [o["custom_id"] for o in outputs] == [f"r{i}" for i in range(LINES)]
        got = np.array(
            [d["embedding"] for o in outputs for d in o["response"]["body"]["data"]], np.float32
        )
        texts = [_text(i, j) for i in range(LINES) for j in range(INPUTS)]
        want = np.array(
            [
                d.embedding
                for start in range(0, len(texts), 256)
                for d in client.embeddings.create(
                    model="minilm", input=texts[start : start + 256]
                ).data
            ],
            np.float32,
        )
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    finally:
        process.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
        process.wait(timeout=30)  # type: ignore[attr-defined]

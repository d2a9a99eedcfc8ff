"""The Batch API's disk side without a server: an upload the client abandons, and a batch
finalized again after a crash between publishing a file's bytes and its record."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from poolserve.config.settings import ServerSettings
from poolserve.http.batches.runner import BatchRunner
from poolserve.http.batches.store import BatchRecord, BatchStore, Progress, Status, new_file_id
from poolserve.http.batches.upload import Limits, receive_file
from poolserve.observability.metrics import ServiceMetrics
from poolserve.types.errors import ClientDisconnectedError

BOUNDARY = "b0undary"


def test_an_abandoned_upload_is_a_499_and_leaves_nothing(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    store.prepare()
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"'
        "\r\n\r\n"
    ).encode()

    async def chunks() -> AsyncIterator[bytes]:
        yield head
        yield b'{"custom_id": "a"' * 1000
        raise ClientDisconnect()

    async def upload() -> None:
        content_type = f"multipart/form-data; boundary={BOUNDARY}"
        await receive_file(content_type, chunks(), store, Limits(1 << 20, 1 << 30), None)

    with pytest.raises(ClientDisconnectedError):
        asyncio.run(upload())
    assert list(store.files_dir.iterdir()) == []
    assert store.files(None, time.time()) == []


def test_a_finalize_resumed_after_the_bytes_moved_writes_the_record(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    store.prepare()
    output_id = new_file_id()
    lines = b'{"id": "batch_req_1"}\n'
    store.data_path(output_id).write_bytes(lines)  # moved, then the process died
    batch = BatchRecord(
        id="batch_0123456789abcdef0123456789abcdef",
        endpoint="/v1/embeddings",
        input_file_id=new_file_id(),
        completion_window="24h",
        created_at=1,
        expires_at=2**40,
        status=Status.FINALIZING,
        total=1,
        progress=Progress(next_line=2, output_bytes=len(lines), completed=1),
        output_file_id=output_id,
    )
    store.put_batch(batch)
    state: Any = SimpleNamespace(
        settings=ServerSettings(), draining=False, metrics=ServiceMetrics()
    )

    async def finalize() -> None:
        await BatchRunner(store, state)._finalize(batch)

    asyncio.run(finalize())
    published = store.file(output_id, None, time.time())
    assert published is not None and published.bytes == len(lines)
    assert store.data_path(output_id).read_bytes() == lines
    ended = store.batch(batch.id)
    assert ended is not None and ended.status is Status.COMPLETED

"""`POST /v1/files`: a multipart upload streamed into the batch directory, bounded as it arrives.

The form is OpenAI's: `purpose` (only `batch` is stored here), `file`, and optionally
`expires_after[anchor]` (`created_at`) with `expires_after[seconds]` (3600 to 2592000; a batch
file otherwise expires after 30 days, as OpenAI's do). The file's bytes go to a hidden file in
the directory as they arrive (never held whole, never in a temporary directory elsewhere), in
pieces written off the event loop; the file appears, record last, once the form is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

from poolserve.http.batches.store import BatchStore, FileRecord, Purpose, new_file_id
from poolserve.types.errors import (
    ClientDisconnectedError,
    InvalidRequestError,
    PayloadTooLargeError,
    clip,
)

# OpenAI's bounds of `expires_after[seconds]` and its default for batch files.
EXPIRES_SECONDS = (3600, 2_592_000)
DEFAULT_EXPIRES_S = 2_592_000
FIELDS = frozenset({"purpose", "expires_after[anchor]", "expires_after[seconds]"})
MOST_FIELD_BYTES = 1024  # a form field's value (a file name too)
MOST_PARTS = 8
WRITE_PIECE = 1 << 20  # bytes gathered before one write in a worker thread


@dataclass(frozen=True)
class Limits:
    """What one upload may take: its bytes, and the room left in the directory."""

    file_bytes: int
    room: int


@dataclass
class Form:
    """The parser's state: the part being read, the fields so far, the file's bytes."""

    limits: Limits
    header_name: bytearray = field(default_factory=bytearray)
    header_value: bytearray = field(default_factory=bytearray)
    headers: dict[str, str] = field(default_factory=dict)
    parts: int = 0
    name: str | None = None
    filename: str | None = None
    value: bytearray = field(default_factory=bytearray)
    fields: dict[str, str] = field(default_factory=dict)
    pending: bytearray = field(default_factory=bytearray)  # file bytes not written yet
    file_bytes: int = 0
    file_seen: bool = False

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def header_data(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def header_end(self) -> None:
        name = self.header_name.decode("latin-1").lower()
        self.headers[name] = self.header_value.decode("latin-1")
        self.header_name.clear()
        self.header_value.clear()

    def part_begin(self) -> None:
        self.parts += 1
        if self.parts > MOST_PARTS:
            raise InvalidRequestError(f"the form has more than {MOST_PARTS} parts", None)
        self.headers.clear()
        self.name = self.filename = None
        self.value.clear()

    def headers_done(self) -> None:
        _, options = parse_options_header(self.headers.get("content-disposition", ""))
        name = options.get(b"name")
        if name is None:
            raise InvalidRequestError("a form part has no name", None, "invalid_form")
        self.name = name.decode("utf-8", "replace")
        if self.name == "file":
            if self.file_seen:
                raise InvalidRequestError("the form has two files", "file", "invalid_form")
            self.file_seen = True
            given = options.get(b"filename", b"upload").decode("utf-8", "replace")
            self.filename = clip(os.path.basename(given.replace("\\", "/")) or "upload", 255)
        elif self.name not in FIELDS:
            message = f"unknown form field {clip(self.name)!r}: this route takes file, purpose "
            raise InvalidRequestError(message + "and expires_after", self.name, "invalid_form")

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self.name != "file":
            self.value += data[start:end]
            if len(self.value) > MOST_FIELD_BYTES:
                message = f"form field {self.name!r} is longer than {MOST_FIELD_BYTES} bytes"
                raise InvalidRequestError(message, self.name, "invalid_form")
            return
        self.file_bytes += end - start
        limits = self.limits
        if self.file_bytes > limits.file_bytes:
            raise PayloadTooLargeError(
                f"the file is larger than the {limits.file_bytes} bytes a batch file may have "
                "(--max-batch-file-bytes)",
                "file",
                "file_too_large",
            )
        if self.file_bytes > limits.room:
            raise storage_full(limits.room)
        self.pending += data[start:end]

    def part_end(self) -> None:
        if self.name is not None and self.name != "file":
            self.fields[self.name] = self.value.decode("utf-8", "replace")


def storage_full(room: int) -> InvalidRequestError:
    """What an upload or a batch meets when --batch-dir holds its --max-batch-storage-bytes."""
    return InvalidRequestError(
        f"the batch storage has room for {max(room, 0)} more bytes "
        "(--max-batch-storage-bytes): delete files first",
        "file",
        "storage_limit_exceeded",
    )


async def receive_file(
    content_type: str,
    chunks: AsyncIterator[bytes],
    store: BatchStore,
    limits: Limits,
    owner: str | None,
) -> FileRecord:
    """Read the form from `chunks` into the store; the stored file's record."""
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise InvalidRequestError(
            "POST /v1/files takes multipart/form-data with `file` and `purpose`",
            None,
            "invalid_form",
        )
    file_id = new_file_id()
    path = store.upload_path(file_id)
    form = Form(limits)
    try:
        handle = await asyncio.to_thread(open, path, "wb")
        try:
            await _parse(form, boundary, chunks, handle)
        finally:
            await asyncio.to_thread(handle.close)
        record = _record(form, file_id, owner)
        await asyncio.to_thread(store.add_file, record, path)
        return record
    finally:
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(os.unlink, path)


async def _parse(form: Form, boundary: bytes, chunks: AsyncIterator[bytes], handle: object) -> None:
    callbacks = {
        "on_part_begin": form.part_begin,
        "on_header_field": form.header_field,
        "on_header_value": form.header_data,
        "on_header_end": form.header_end,
        "on_headers_finished": form.headers_done,
        "on_part_data": form.part_data,
        "on_part_end": form.part_end,
    }
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    write = handle.write  # type: ignore[attr-defined]
    try:
        async for chunk in chunks:
            parser.write(chunk)
            if len(form.pending) >= WRITE_PIECE:
                piece = bytes(form.pending)
                form.pending.clear()
                await asyncio.to_thread(write, piece)
        parser.finalize()
    except MultipartParseError as exc:
        raise InvalidRequestError(f"the form is malformed: {exc}", None, "invalid_form") from None
    except ClientDisconnect:  # a 499, never a 500: the partial file is removed by the caller
        raise ClientDisconnectedError(
            "the client closed the connection during the upload"
        ) from None
    if form.pending:
        await asyncio.to_thread(write, bytes(form.pending))
        form.pending.clear()


def _record(form: Form, file_id: str, owner: str | None) -> FileRecord:
    """The stored file's record, once the form's fields are checked."""
    fields = form.fields
    purpose = fields.get("purpose")
    if purpose is None:
        raise InvalidRequestError(
            "the form has no `purpose`", "purpose", "missing_required_parameter"
        )
    if purpose != Purpose.BATCH:
        message = f"purpose {clip(purpose)!r} is not served: this server stores files for batches"
        raise InvalidRequestError(message + " only ('batch')", "purpose", "invalid_value")
    if form.filename is None:
        raise InvalidRequestError("the form has no `file`", "file", "missing_required_parameter")
    now = int(time.time())
    return FileRecord(
        id=file_id,
        bytes=form.file_bytes,
        created_at=now,
        filename=form.filename,
        purpose=Purpose.BATCH,
        expires_at=now + _expires_after(fields),
        owner=owner,
    )


def _expires_after(fields: dict[str, str]) -> int:
    """Seconds until the file expires: the form's `expires_after`, else OpenAI's 30 days."""
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return DEFAULT_EXPIRES_S
    if anchor != "created_at":
        message = "expires_after[anchor] must be 'created_at'"
        raise InvalidRequestError(message, "expires_after.anchor", "invalid_value")
    low, high = EXPIRES_SECONDS
    if seconds is None or not seconds.isdigit() or not low <= int(seconds) <= high:
        message = f"expires_after[seconds] must be an integer from {low} to {high}"
        raise InvalidRequestError(message, "expires_after.seconds", "invalid_value")
    return int(seconds)

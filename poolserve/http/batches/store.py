"""The Batch API's files and batches on disk (`--batch-dir`), shared by every front end.

The directory is the one source of truth, so any front end answers for any batch and a batch
outlives the process that ran it:

    files/<file-id>.json      a file's record (written last: a file exists once it is there)
    files/<file-id>           its bytes
    batches/<batch-id>.json   a batch's record, progress included (rewritten whole, atomically)
    batches/<batch-id>.cancel a cancel request (made once, by any front end; the runner acts)
    batches/<batch-id>.output, .errors   a running batch's output lines, appended in input order
    runner.lock               held by the one front end that runs batches

Only the runner changes a batch's record after it is created, so no two processes ever write the
same file. Records are msgspec structs; every JSON file is replaced by a rename, so a reader sees
the old record or the new one. An object belongs to the API key name that created it (`owner`;
None without --api-keys-file): another key is answered as if it did not exist.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

import msgspec

FILE_ID = re.compile(r"file-[0-9a-f]{32}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")
RECORD = ".json"
CANCEL = ".cancel"
PARTS = {"output": ".output", "errors": ".errors"}
T = TypeVar("T")


class Purpose(StrEnum):
    """What a stored file is for: an upload's input lines, or a batch's output or error lines."""

    BATCH = "batch"
    BATCH_OUTPUT = "batch_output"


class FileRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One stored file (OpenAI's File object, and its owner)."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: Purpose
    expires_at: int | None = None
    owner: str | None = None

    def public(self) -> dict[str, object]:
        """OpenAI's File object (`status` is deprecated there, and always `processed` here)."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose.value,
            "status": "processed",
            "status_details": None,
        }

    def expired(self, now: float) -> bool:
        """Whether the file's expiry has passed (it is then gone for every reader)."""
        return self.expires_at is not None and now >= self.expires_at


class Status(StrEnum):
    """OpenAI's batch lifecycle."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


# Statuses after which a batch never changes again.
ENDED = frozenset({Status.FAILED, Status.COMPLETED, Status.EXPIRED, Status.CANCELLED})
# The timestamp field each status sets when the batch enters it.
STAMPS = {
    Status.IN_PROGRESS: "in_progress_at",
    Status.FINALIZING: "finalizing_at",
    Status.COMPLETED: "completed_at",
    Status.FAILED: "failed_at",
    Status.EXPIRED: "expired_at",
    Status.CANCELLED: "cancelled_at",
}


class Progress(msgspec.Struct, frozen=True, kw_only=True):
    """How far a batch has run: every line before `next_line` is answered in the part files,
    which hold exactly `output_bytes` and `error_bytes` of them (anything after is discarded on
    resume, so every line is written exactly once)."""

    next_line: int = 1  # 1-based number of the next input line to run
    input_offset: int = 0  # the byte where that line starts
    output_bytes: int = 0
    error_bytes: int = 0
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0


class LineFault(msgspec.Struct, frozen=True):
    """One reason the input file failed validation (OpenAI's BatchError)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One batch: OpenAI's Batch object, its owner and its progress."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: Status = Status.VALIDATING
    ending: Status = Status.COMPLETED  # where a finalizing batch ends
    owner: str | None = None
    metadata: dict[str, str] | None = None
    output_expires_after: int | None = None  # seconds after which the output files expire
    total: int = 0
    progress: Progress = Progress()
    errors: tuple[LineFault, ...] = ()
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None

    def moved(self, status: Status, now: int, **changes: object) -> BatchRecord:
        """The record in `status`, stamped now, with `changes`."""
        stamp = STAMPS.get(status)
        if stamp is not None:
            changes[stamp] = now
        return msgspec.structs.replace(self, status=status, **changes)

    def public(self, cancelling_at: int | None = None) -> dict[str, object]:
        """OpenAI's Batch object; `cancelling_at`: when a cancel was asked of an unended batch."""
        status = self.status
        if cancelling_at is not None and status not in ENDED:
            status = Status.CANCELLING
        cancelling_at = self.cancelling_at or cancelling_at
        progress = self.progress
        errors = None
        if self.errors:
            data = [msgspec.structs.asdict(fault) for fault in self.errors]
            errors = {"object": "list", "data": data}
        tokens = progress.input_tokens
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": status.value,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {
                "total": self.total,
                "completed": progress.completed,
                "failed": progress.failed,
            },
            "metadata": self.metadata,
            "model": None,
            "usage": {
                "input_tokens": tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 0,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": tokens,
            },
        }


def new_file_id() -> str:
    """A fresh file id (OpenAI's `file-` prefix)."""
    return f"file-{_ordered_hex()}"


def new_batch_id() -> str:
    """A fresh batch id (OpenAI's `batch_` prefix)."""
    return f"batch_{_ordered_hex()}"


def _ordered_hex() -> str:
    """32 hex digits: the time in nanoseconds, then random ones, so ids made in the same
    second still list in the order they were made."""
    return f"{time.time_ns():016x}{os.urandom(8).hex()}"


class BatchStore:
    """The files and batches under one directory (every method does blocking file work: the
    routes call them in a worker thread)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.batches_dir = self.root / "batches"

    def prepare(self) -> None:
        """Create the directory tree (at start; OSError when it cannot be)."""
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.batches_dir.mkdir(parents=True, exist_ok=True)

    @property
    def lock_path(self) -> Path:
        """The runner's lock file."""
        return self.root / "runner.lock"

    # files

    def data_path(self, file_id: str) -> Path:
        """Where a file's bytes are."""
        return self.files_dir / file_id

    def upload_path(self, file_id: str) -> Path:
        """Where an upload's bytes go until the file is complete (a dot file: never listed)."""
        return self.files_dir / f".{file_id}.upload"

    def add_file(self, record: FileRecord, written: Path) -> None:
        """Publish a file whose bytes are complete at `written`: bytes first, record last. Done
        again after a crash between the two, it only writes the record (the bytes are there)."""
        if written.exists() or not self.data_path(record.id).exists():
            os.replace(written, self.data_path(record.id))
        _write_atomic(self.files_dir / f"{record.id}{RECORD}", msgspec.json.encode(record))

    def has_file(self, file_id: str) -> bool:
        """Whether the file is published (its record written), whoever owns it."""
        return (self.files_dir / f"{file_id}{RECORD}").exists()

    def file(self, file_id: str, owner: str | None, now: float) -> FileRecord | None:
        """The owner's live file `file_id`; None for any other id, owner or an expired file."""
        if not FILE_ID.fullmatch(file_id):
            return None
        record = _read(self.files_dir / f"{file_id}{RECORD}", FileRecord)
        if record is None or record.owner != owner or record.expired(now):
            return None
        return record

    def files(self, owner: str | None, now: float) -> list[FileRecord]:
        """The owner's live files, oldest first."""
        found = [f for f in self._records(self.files_dir, FileRecord) if f.owner == owner]
        live = [f for f in found if not f.expired(now)]
        return sorted(live, key=lambda f: (f.created_at, f.id))

    def delete_file(self, file_id: str) -> None:
        """Remove a file: its record first (it is gone for readers), then its bytes."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.files_dir / f"{file_id}{RECORD}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.data_path(file_id))

    def expired_files(self, now: float) -> list[FileRecord]:
        """Every owner's files whose expiry has passed (for the runner to delete)."""
        return [f for f in self._records(self.files_dir, FileRecord) if f.expired(now)]

    def stored_bytes(self) -> int:
        """Bytes held under the directory's files and running batches' part files."""
        total = 0
        for folder in (self.files_dir, self.batches_dir):
            for entry in _entries(folder):
                if not entry.name.endswith((RECORD, CANCEL)):
                    with contextlib.suppress(FileNotFoundError):
                        total += entry.stat().st_size
        return total

    # batches

    def put_batch(self, record: BatchRecord) -> None:
        """Write a batch's record whole (its creator once, then only the runner)."""
        _write_atomic(self.batches_dir / f"{record.id}{RECORD}", msgspec.json.encode(record))

    def batch(self, batch_id: str) -> BatchRecord | None:
        """Batch `batch_id` whoever owns it; None for an id that is no batch."""
        if not BATCH_ID.fullmatch(batch_id):
            return None
        return _read(self.batches_dir / f"{batch_id}{RECORD}", BatchRecord)

    def batches(self, owner: str | None) -> list[BatchRecord]:
        """The owner's batches, newest first."""
        found = [b for b in self._records(self.batches_dir, BatchRecord) if b.owner == owner]
        return sorted(found, key=lambda b: (b.created_at, b.id), reverse=True)

    def unended(self) -> list[BatchRecord]:
        """Every owner's batches still to run or finish, oldest first (the runner's queue)."""
        found = [b for b in self._records(self.batches_dir, BatchRecord) if b.status not in ENDED]
        return sorted(found, key=lambda b: (b.created_at, b.id))

    def ask_cancel(self, batch_id: str, now: int) -> int:
        """Record a cancel request once; when it was first made."""
        path = self.batches_dir / f"{batch_id}{CANCEL}"
        with contextlib.suppress(FileExistsError):
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(descriptor, "w") as marker:
                marker.write(str(now))
        asked = self.cancel_asked(batch_id)
        return now if asked is None else asked

    def cancel_asked(self, batch_id: str) -> int | None:
        """When a cancel of the batch was asked (None: never)."""
        try:
            text = (self.batches_dir / f"{batch_id}{CANCEL}").read_text()
        except FileNotFoundError:
            return None
        return int(text) if text.isdigit() else int(time.time())  # being written: now

    def part_path(self, batch_id: str, part: str) -> Path:
        """A running batch's output (`output`) or error (`errors`) lines."""
        return self.batches_dir / f"{batch_id}{PARTS[part]}"

    def _records(self, folder: Path, kind: type[T]) -> Iterator[T]:
        for entry in _entries(folder):
            if entry.name.endswith(RECORD) and not entry.name.startswith("."):
                record = _read(Path(entry.path), kind)
                if record is not None:
                    yield record


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as found:
            return list(found)
    except FileNotFoundError:
        return []


def _read(path: Path, kind: type[T]) -> T | None:
    """A record, or None when it is not there (deleted between listing and reading)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return msgspec.json.decode(data, type=kind)


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by `data` at once: a temporary file beside it, flushed, then renamed."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)

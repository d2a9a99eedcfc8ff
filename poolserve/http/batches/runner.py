"""The batch runner: the front end that holds `runner.lock` takes the unended batches oldest first
and carries each through OpenAI's lifecycle, one at a time.

- `validating`: the input file is checked whole (`validate.py`); any fault fails the batch with
  OpenAI's `errors` list, before any line runs.
- `in_progress`: lines are answered by this process's app (`asgi_call.py`) at `BATCH_PRIORITY`,
  about one step's budget of their prompt tokens in flight (the planner runs them as background
  work, in small steps of their own when no interactive prompt waits), and
  written in input order to the output (2xx) or error lines. Every second the lines written are
  flushed to disk, then the record's progress says how far they go: after a crash the batch
  resumes from there, the part files cut back to that length, so every line is written once.
  A line the engine could not take (429, 503) is sent again; while the server drains, no new
  line starts.
- A cancel request (`cancelling`) or the completion window's end stops the lines; the lines not
  run are dropped (cancelled) or written to the error lines as `batch_expired` (OpenAI's line).
- `finalizing`: the part files become the batch's output and error files.

The other front ends only create, list and cancel; the lock passes to another when its holder
exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgspec
from starlette.types import ASGIApp

from poolserve.frontend.state import ServiceState
from poolserve.http.batches.asgi_call import call_app
from poolserve.http.batches.lines import (
    LineError,
    answer_document,
    openai_line,
    parse_line,
    unanswered_line,
)
from poolserve.http.batches.store import (
    BatchRecord,
    BatchStore,
    FileRecord,
    LineFault,
    Progress,
    Purpose,
    Status,
    new_file_id,
)
from poolserve.http.batches.validate import check_input

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how soon a batch created by another front end is seen
CHECKPOINT_S = 1.0
WRITE_BYTES = 1 << 20  # answers gathered before one write in a worker thread
MOST_WINDOW = 64
LOOK_S = 0.02  # how often a waiting run looks again (a line answered, interactive traffic gone)
# The prompt tokens the batch's lines in flight may hold, in steps' budgets: the engine runs them
# in small background steps (the planner's BACKGROUND_SHARE), so this bounds the engine queue
# they hold, not an interactive request's wait.
STEP_SHARE = 1.0
GUESS_TOKENS_PER_BYTE = 0.25  # a line's tokens guessed from its bytes until answers tell
READ_LINES = 64
SWEEP_S = 60.0  # how often expired files are deleted
RETRY_FIRST_S, RETRY_MOST_S = 0.01, 0.5
RETRIED = frozenset({429, 503})  # the engine's queue was full, or it was not serving: again
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
PART_NAMES = {"output": "output", "errors": "error"}


# (the part it goes to, its output line, its prompt tokens)
Answered = tuple[str, bytes, int]


@dataclass(frozen=True)
class Line:
    """One request line of the input: its number, where the next line starts, its text."""

    number: int
    end: int
    text: bytes


class BatchRunner:
    """Runs the batches of one `BatchStore` in this process while it holds the store's lock."""

    def __init__(self, store: BatchStore, state: ServiceState) -> None:
        self.store = store
        self.state = state
        settings = state.settings
        self.body_limit = settings.payload_limit
        self.most_requests = settings.max_batch_requests
        self.most_bytes = settings.max_batch_storage_bytes
        self.window = max(1, min(MOST_WINDOW, settings.max_num_seqs))
        self.step_share = max(1, int(settings.max_num_batched_tokens * STEP_SHARE))
        self.wake = asyncio.Event()
        self._app: ASGIApp | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock: int | None = None
        self._swept = 0.0

    def start(self, app: ASGIApp) -> None:
        """Run batches with `app` answering their lines, from now until `stop`."""
        self._app = app
        self._task = asyncio.create_task(self._run(), name="batch runner")

    async def stop(self) -> None:
        """Stop at once: lines in flight are dropped (they run again on resume)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor releases the lock
            self._lock = None

    def poke(self) -> None:
        """A batch was created or cancelled here: look now rather than at the next poll."""
        self.wake.set()

    async def _run(self) -> None:
        while True:
            try:
                if self._lock is None:
                    self._lock = await asyncio.to_thread(_try_lock, self.store.lock_path)
                if self._lock is not None and not self._stopping():
                    await self._sweep()
                    queue = await asyncio.to_thread(self.store.unended)
                    if queue:
                        await self._advance(queue[0])
                        continue
            except Exception:  # a disk fault: said, and tried again at the next poll
                logger.exception("the batch runner failed; retrying in %.1f s", POLL_S)
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await self.wake.wait()

    def _stopping(self) -> bool:
        return self.state.draining

    async def _advance(self, batch: BatchRecord) -> None:
        """Move one batch one status on."""
        store = self.store
        asked = await asyncio.to_thread(store.cancel_asked, batch.id)
        now = int(time.time())
        if batch.status is Status.FINALIZING:
            await self._finalize(batch)
        elif asked is not None:
            await self._end(batch, Status.CANCELLED, cancelling_at=asked)
        elif now >= batch.expires_at:
            await self._expire(batch, batch.progress)
        elif batch.status is Status.VALIDATING:
            await self._validate(batch)
        else:
            await self._run_lines(batch)

    async def _validate(self, batch: BatchRecord) -> None:
        path = self.store.data_path(batch.input_file_id)
        try:
            checked = await asyncio.to_thread(
                check_input, path, batch.endpoint, self.body_limit, self.most_requests
            )
        except FileNotFoundError:
            fault = LineFault("input_file_missing", "the input file was deleted", None, None)
            await self._put(batch.moved(Status.FAILED, int(time.time()), errors=(fault,)))
            return
        now = int(time.time())
        if checked.faults:
            await self._put(batch.moved(Status.FAILED, now, errors=checked.faults))
        else:
            await self._put(batch.moved(Status.IN_PROGRESS, now, total=checked.total))

    async def _run_lines(self, batch: BatchRecord) -> None:
        """Answer the batch's lines from where its progress says, until done or stopped."""
        store = self.store
        try:
            source = await asyncio.to_thread(_open_input, store.data_path(batch.input_file_id))
        except FileNotFoundError:
            fault = LineFault("input_file_missing", "the input file was deleted", None, None)
            await self._end(batch, Status.FAILED, errors=(fault,))
            return
        parts = await asyncio.to_thread(_open_parts, store, batch)
        run = LineRun(self, batch, source, parts)
        try:
            ending = await run.all()
        finally:
            await asyncio.to_thread(_close, source, *parts.values())
        batch = run.batch
        if ending is Status.EXPIRED:
            await self._expire(batch, batch.progress)
        elif ending is Status.CANCELLED:
            asked = await asyncio.to_thread(store.cancel_asked, batch.id)
            await self._end(batch, Status.CANCELLED, cancelling_at=asked)
        elif ending is Status.FAILED:
            await self._end(batch, Status.FAILED, errors=run.faults)
        elif ending is Status.COMPLETED:
            await self._end(batch, Status.COMPLETED)

    async def _expire(self, batch: BatchRecord, progress: Progress) -> None:
        """Every line not run written as `batch_expired`, then the batch ends `expired`."""
        store = self.store
        path = store.data_path(batch.input_file_id)
        errors = store.part_path(batch.id, "errors")
        written, lines = await asyncio.to_thread(_write_expired, path, errors, progress)
        self.state.metrics.batch_lines.labels("failed").inc(lines)
        progress = msgspec.structs.replace(
            progress, error_bytes=progress.error_bytes + written, failed=progress.failed + lines
        )
        # a batch that expired before its validation counts its lines now
        total = batch.total or progress.completed + progress.failed
        expired = msgspec.structs.replace(batch, progress=progress, total=total)
        await self._end(expired, Status.EXPIRED)

    async def _end(self, batch: BatchRecord, status: Status, **changes: object) -> None:
        """Finalize towards `status`: the output files' ids chosen and recorded first, so a
        finalizing batch that is resumed publishes the same files."""
        sizes = await asyncio.to_thread(_part_sizes, self.store, batch)
        ids = {
            "output_file_id": new_file_id() if sizes["output"] else None,
            "error_file_id": new_file_id() if sizes["errors"] else None,
        }
        now = int(time.time())
        finalizing = batch.moved(Status.FINALIZING, now, ending=status, **ids, **changes)
        await self._put(finalizing)
        await self._finalize(finalizing)

    async def _finalize(self, batch: BatchRecord) -> None:
        """The part files published as files, then the batch in its ending status."""
        store = self.store
        now = int(time.time())
        expires = None if batch.output_expires_after is None else now + batch.output_expires_after
        for part, file_id in (("output", batch.output_file_id), ("errors", batch.error_file_id)):
            path = store.part_path(batch.id, part)
            if file_id is None:
                await asyncio.to_thread(_remove, path)
                continue
            if await asyncio.to_thread(store.has_file, file_id):
                continue  # published before a restart
            # the part file, or its bytes already moved when a crash came before the record
            source = path if path.exists() else store.data_path(file_id)
            size = (await asyncio.to_thread(source.stat)).st_size
            record = FileRecord(
                id=file_id,
                bytes=size,
                created_at=now,
                filename=f"{batch.id}_{PART_NAMES[part]}.jsonl",
                purpose=Purpose.BATCH_OUTPUT,
                expires_at=expires,
                owner=batch.owner,
            )
            await asyncio.to_thread(store.add_file, record, path)
        await self._put(batch.moved(batch.ending, now))
        self.state.metrics.batches_ended.labels(batch.ending.value).inc()
        logger.info(
            "batch %s %s: %d of %d lines completed, %d failed",
            batch.id,
            batch.ending.value,
            batch.progress.completed,
            batch.total,
            batch.progress.failed,
        )

    async def _put(self, batch: BatchRecord) -> None:
        await asyncio.to_thread(self.store.put_batch, batch)

    async def _sweep(self) -> None:
        """Delete expired files (not those a batch still reads), once a minute."""
        now = time.monotonic()
        if now - self._swept < SWEEP_S:
            return
        self._swept = now
        await asyncio.to_thread(_sweep_expired, self.store, time.time())


class LineRun:
    """One stretch of a batch's lines, from its progress to the end or a stop."""

    def __init__(
        self,
        runner: BatchRunner,
        batch: BatchRecord,
        source: BinaryIO,
        parts: dict[str, BinaryIO],
    ) -> None:
        self.runner = runner
        self.batch = batch
        self.source = source
        self.parts = parts
        self.pending: dict[str, list[bytes]] = {"output": [], "errors": []}
        self.pending_bytes = 0
        self.progress = self.counted = batch.progress
        self.faults: tuple[LineFault, ...] = ()
        self.window: deque[tuple[Line, asyncio.Task[Answered | None], int]] = deque()
        self.tokens_in_flight = 0  # the lines in flight's guessed prompt tokens
        self.seen_tokens = self.seen_bytes = 0  # of the lines answered: the guessing rate
        self.stopped = False
        self.checked = time.monotonic()

    async def all(self) -> Status | None:
        """Run until every line is written (COMPLETED), the batch is cancelled, expires or
        fails, or the server stops (None: resumed later)."""
        runner = self.runner
        lines: deque[Line] = deque()
        number, offset = self.progress.next_line, self.progress.input_offset
        more = True
        try:
            while True:
                stopping = runner._stopping()
                while more and not stopping:
                    if not lines:
                        read = await asyncio.to_thread(_read_lines, self.source, number, offset)
                        if not read:
                            more = False
                            break
                        lines.extend(read)
                        number, offset = read[-1].number + 1, read[-1].end
                    if not self._may_start(lines[0]):
                        break
                    self._start(lines.popleft())
                if self.window:
                    await self._take_head()
                elif not more or stopping:
                    await self._checkpoint()
                    return None if more else Status.COMPLETED
                else:  # interactive requests in flight: wait for them to end
                    await asyncio.sleep(LOOK_S)
                if self.stopped:
                    await self._checkpoint()
                    return None
                if time.monotonic() - self.checked >= CHECKPOINT_S:
                    ending = await self._checkpoint()
                    if ending is not None:
                        return ending
        finally:
            for _, task, _ in self.window:
                task.cancel()

    def _count(self, progress: Progress) -> None:
        """The lines recorded since the last count, in the metrics (a line run again after a
        crash was never recorded before it, so it is counted once)."""
        counted = self.counted
        lines = self.runner.state.metrics.batch_lines
        lines.labels("completed").inc(progress.completed - counted.completed)
        lines.labels("failed").inc(progress.failed - counted.failed)
        self.counted = progress

    def _may_start(self, line: Line) -> bool:
        """Whether the next line may start: never while interactive requests are in flight;
        else while the lines in flight hold less than the batch's share of a step's tokens (one
        line at least), their tokens guessed from their bytes at the rate seen so far."""
        if not self.window:
            return True
        if len(self.window) >= self.runner.window:
            return False
        guess = self._guess(line)
        return self.tokens_in_flight + guess <= self.runner.step_share

    def _guess(self, line: Line) -> int:
        rate = self.seen_tokens / self.seen_bytes if self.seen_bytes else GUESS_TOKENS_PER_BYTE
        return max(1, int(len(line.text) * rate))

    def _start(self, line: Line) -> None:
        guess = self._guess(line)
        self.tokens_in_flight += guess
        self.window.append((line, asyncio.create_task(self._answer(line)), guess))

    async def _take_head(self) -> None:
        """The first line's answer written when it is there; else a short wait (a line waiting
        for room must not hold back a cancel, the deadline, or lines that may start now)."""
        line, task, guess = self.window[0]
        if not task.done():
            await asyncio.wait((task,), timeout=LOOK_S)
            if not task.done():
                return
        self.window.popleft()
        self.tokens_in_flight -= guess
        answered = task.result()
        if answered is None:  # not answered: the server stops; resumed later
            self.stopped = True
            return
        part, text, tokens = answered
        self.seen_tokens += tokens
        self.seen_bytes += len(line.text)
        self._written(line, part, text, tokens)
        if self.pending_bytes >= WRITE_BYTES:
            await self._write()

    async def _answer(self, line: Line) -> Answered | None:
        """(part, output line, prompt tokens) of one line; None when the server stops first."""
        runner = self.runner
        app = runner._app
        assert app is not None
        try:
            request = parse_line(line.text, line.number)
        except LineError as exc:  # validated, so only a file changed on disk since
            return "errors", unanswered_line(exc.custom_id, exc.code, exc.message), 0
        delay = RETRY_FIRST_S
        while True:
            try:
                answer = await call_app(app, request.url, request.body, self.batch.owner)
            except Exception:  # the app failed and raised: a client would have seen its 500
                logger.exception("batch %s line %d: the server failed", self.batch.id, line.number)
                message = "internal server error"
                return "errors", unanswered_line(request.custom_id, "internal_error", message), 0
            if answer.status not in RETRIED:
                break
            if runner._stopping():
                return None
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MOST_S)
        document = answer_document(answer.headers, answer.body)
        request_id = answer.request_id
        if document is None:
            message = "the server answered no JSON document"
            return "errors", unanswered_line(request.custom_id, "not_json", message), 0
        part = "output" if 200 <= answer.status < 300 else "errors"
        text = openai_line(request.custom_id, answer.status, request_id, document)
        return part, text, answer.prompt_tokens

    def _written(self, line: Line, part: str, text: bytes, tokens: int) -> None:
        """A line's answer taken, in input order."""
        self.pending[part].append(text)
        self.pending_bytes += len(text)
        progress = self.progress
        ok = part == "output"
        self.progress = msgspec.structs.replace(
            progress,
            next_line=line.number + 1,
            input_offset=line.end,
            output_bytes=progress.output_bytes + (len(text) if ok else 0),
            error_bytes=progress.error_bytes + (0 if ok else len(text)),
            completed=progress.completed + ok,
            failed=progress.failed + (not ok),
            input_tokens=progress.input_tokens + tokens,
        )

    async def _write(self) -> None:
        pending = self.pending
        self.pending = {"output": [], "errors": []}
        self.pending_bytes = 0
        await asyncio.to_thread(_append, self.parts, pending)

    async def _checkpoint(self) -> Status | None:
        """Lines on disk, then the progress in the record; what ends the run now, if anything."""
        await self._write()
        await asyncio.to_thread(_sync, *self.parts.values())
        runner = self.runner
        store = runner.store
        self.batch = msgspec.structs.replace(self.batch, progress=self.progress)
        await runner._put(self.batch)
        self._count(self.progress)
        self.checked = time.monotonic()
        if await asyncio.to_thread(store.cancel_asked, self.batch.id) is not None:
            return Status.CANCELLED
        if time.time() >= self.batch.expires_at:
            return Status.EXPIRED
        room = runner.most_bytes - await asyncio.to_thread(store.stored_bytes)
        if room < 0:
            message = "the batch storage is full (--max-batch-storage-bytes)"
            self.faults = (LineFault("storage_limit_exceeded", message, None, None),)
            return Status.FAILED
        return None


def _try_lock(path: Path) -> int | None:
    """The lock's descriptor when this process got it, else None (another front end has it)."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None
    return descriptor


def _open_input(path: Path) -> BinaryIO:
    return open(path, "rb")  # closed by the run


def _open_parts(store: BatchStore, batch: BatchRecord) -> dict[str, BinaryIO]:
    """The part files, cut back to what the record's progress counts (a crash may have written
    lines after it: they run again)."""
    progress = batch.progress
    sizes = {"output": progress.output_bytes, "errors": progress.error_bytes}
    opened: dict[str, BinaryIO] = {}
    for part, size in sizes.items():
        path = store.part_path(batch.id, part)
        handle = open(path, "ab")  # noqa: SIM115 (closed by the run)
        handle.truncate(size)
        opened[part] = handle
    return opened


def _read_lines(source: BinaryIO, number: int, offset: int) -> list[Line]:
    """The next request lines from `offset` (line `number`), blank lines skipped."""
    source.seek(offset)
    lines: list[Line] = []
    while len(lines) < READ_LINES:
        text = source.readline()
        if not text:
            break
        offset += len(text)
        if text.strip():
            lines.append(Line(number, offset, text.strip()))
        number += 1
    return lines


def _append(parts: dict[str, BinaryIO], pending: dict[str, list[bytes]]) -> None:
    for part, texts in pending.items():
        if texts:
            parts[part].write(b"".join(texts))


def _sync(*handles: BinaryIO) -> None:
    for handle in handles:
        handle.flush()
        os.fsync(handle.fileno())


def _close(*handles: BinaryIO) -> None:
    for handle in handles:
        handle.close()


def _part_sizes(store: BatchStore, batch: BatchRecord) -> dict[str, int]:
    """The part files' sizes as the record counts them (what a crash added after is cut)."""
    progress = batch.progress
    sizes = {"output": progress.output_bytes, "errors": progress.error_bytes}
    for part, size in sizes.items():
        path = store.part_path(batch.id, part)
        if path.exists():
            with open(path, "ab") as handle:
                handle.truncate(size)
    return sizes


def _write_expired(path: Path, errors: Path, progress: Progress) -> tuple[int, int]:
    """`batch_expired` lines for every line from the progress on: (bytes, lines) written."""
    written = lines = 0
    try:
        source = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return 0, 0
    with source, open(errors, "ab") as out:
        out.truncate(progress.error_bytes)
        number, offset = progress.next_line, progress.input_offset
        while read := _read_lines(source, number, offset):
            texts = []
            for line in read:
                try:
                    custom_id: str | None = parse_line(line.text, line.number).custom_id
                except LineError as exc:
                    custom_id = exc.custom_id
                texts.append(unanswered_line(custom_id, "batch_expired", EXPIRED_MESSAGE))
            data = b"".join(texts)
            out.write(data)
            written += len(data)
            lines += len(texts)
            number, offset = read[-1].number + 1, read[-1].end
        out.flush()
        os.fsync(out.fileno())
    return written, lines


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _sweep_expired(store: BatchStore, now: float) -> None:
    """Delete expired files, keeping the inputs of batches that have not ended."""
    reading = {batch.input_file_id for batch in store.unended()}
    for record in store.expired_files(now):
        if record.id not in reading:
            store.delete_file(record.id)

"""`poolserve run-batch -i IN -o OUT --model M`: OpenAI batch lines answered by the server.

Every line's request goes through `AsyncPoolingEngine.request`, the server's own app without a
socket, so its answer is what the server answers. Lines are read incrementally in a worker
thread, answered concurrently within a bounded window, and written strictly in input order; a
file output is a temporary file renamed once complete, so a failed job leaves no output.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from poolserve.config.flags import add_settings_flags, settings_from_args
from poolserve.config.settings import ServerSettings
from poolserve.http.batches.lines import (
    LineError,
    LineReader,
    answer_line,
    error_line,
    internal_error_line,
    parse_line,
    too_long,
)
from poolserve.jobs.batch_output import JobError, Output
from poolserve.types.errors import command_error

if TYPE_CHECKING:
    from poolserve.offline.engine import AsyncPoolingEngine

    Commands = argparse._SubParsersAction[argparse.ArgumentParser]

logger = logging.getLogger("poolserve.run_batch")

# Requests in flight per sequence a step runs: the next requests are tokenized and the last
# answers encoded while the engine computes; capped so the lines and answers held stay few.
WINDOW_PER_SEQ = 2
MOST_WINDOW = 1024
# Bytes of request lines in flight, in body limits (a longer line still runs, alone).
WINDOW_BODIES = 4
READ_LINES = 64  # lines per hop to the reading thread
WRITE_BYTES = 1 << 20  # answers gathered before one hop to the writing thread
# A request the engine refused for a full queue (429) is sent again: our own window filled it.
RETRY_FIRST_S, RETRY_MOST_S = 0.01, 0.5


def add_run_batch(commands: Commands) -> None:
    """`run-batch -i IN -o OUT` and every server setting's flag."""
    parser = commands.add_parser(
        "run-batch",
        help="Answer a file of OpenAI batch requests (vLLM's run-batch format).",
        usage="poolserve run-batch -i INPUT.jsonl -o OUTPUT.jsonl --model MODEL [options]",
        description="Answer OpenAI batch request lines (embeddings, pooling, classify, score, "
        "rerank) with the server's own app in this process; one output line per input line, "
        "in order. See docs/jobs.md.",
    )
    parser.add_argument(
        "-i", "--input-file", required=True, help="Request lines (JSONL); '-' reads stdin."
    )
    parser.add_argument(
        "-o", "--output-file", required=True, help="Answer lines (JSONL); '-' writes stdout."
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="Replace OUTPUT if it exists (once it is whole)."
    )
    add_settings_flags(parser, "run-batch")
    parser.set_defaults(
        run=lambda args: run_batch(
            settings_from_args(parser, args), args.input_file, args.output_file, args.overwrite
        )
    )


def run_batch(
    settings: ServerSettings, input_name: str, output_name: str, overwrite: bool = False
) -> int:
    """Run the job; the exit code (0: every line answered, 1: the job could not run)."""
    from poolserve.observability.logs import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    # As `serve` does: idle OpenMP threads sleep, leaving the cores to tokenization and JSON.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    options = settings.model_dump(exclude_unset=True)
    # one access line (and one httpx line) per batch line is noise; POOLSERVE_ACCESS_LOG brings
    # it back
    options.setdefault("access_log", False)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        source, output = _open(input_name, output_name, overwrite)
    except JobError as exc:
        return command_error("run-batch", str(exc))
    try:
        counts = asyncio.run(_main(options, LineReader(source, settings.payload_limit), output))
        output.commit()
    except (JobError, KeyboardInterrupt) as exc:
        output.discard()
        code = 1 if isinstance(exc, JobError) else 130
        return command_error("run-batch", str(exc) or "interrupted", code)
    except BaseException:
        output.discard()
        raise
    finally:
        _close(source)
    failed = counts.lines - counts.succeeded
    logger.info(
        "run-batch: %d lines, %d succeeded, %d failed", counts.lines, counts.succeeded, failed
    )
    return 0


def _open(input_name: str, output_name: str, overwrite: bool) -> tuple[BinaryIO, Output]:
    """The input stream (stdin for '-') and the output, both checked before the model loads."""
    try:
        source = sys.stdin.buffer if input_name == "-" else open(input_name, "rb")  # noqa: SIM115
    except OSError as exc:
        raise JobError(f"cannot read the input {input_name}: {exc.strerror or exc}") from None
    try:
        return source, Output(output_name, overwrite)
    except JobError:
        _close(source)
        raise


def _close(stream: BinaryIO) -> None:
    if stream is not sys.stdin.buffer:
        stream.close()


@dataclass
class Counts:
    """Lines written and how many of them the server answered with 2xx."""

    lines: int = 0
    succeeded: int = 0


async def _main(options: dict[str, Any], reader: LineReader, output: Output) -> Counts:
    """Start the engine, answer every line, stop the engine."""
    from poolserve.offline.engine import AsyncPoolingEngine  # loads torch: not for --help

    try:
        engine = AsyncPoolingEngine(**options)
        await engine.start()
    except Exception as exc:
        raise JobError(f"the model failed to load: {exc}") from None
    try:
        settings = engine.settings
        in_flight = InFlight(
            min(MOST_WINDOW, WINDOW_PER_SEQ * settings.max_num_seqs),
            WINDOW_BODIES * settings.payload_limit,
        )
        return await _answer_all(engine, reader, output, in_flight)
    finally:
        await engine.close()


@dataclass(frozen=True)
class Answer:
    """One output line and whether the server answered its request with 2xx."""

    line: bytes
    succeeded: bool


class InFlight:
    """The lines being answered, in input order, bounded by count and by their bytes.

    The reader adds (after waiting for room), the writer takes answers from the front; a line's room
    frees once its answer is written. A line larger than the byte bound runs alone.
    """

    def __init__(self, most_lines: int, most_bytes: int) -> None:
        self.most_lines, self.most_bytes = most_lines, most_bytes
        self._items: deque[tuple[asyncio.Task[Answer], int]] = deque()
        self._lines = self._bytes = 0
        self._changed = asyncio.Event()
        self._closed = False

    async def room(self, size: int) -> None:
        """Wait until a line of `size` bytes may start."""
        while self._lines and (
            self._lines >= self.most_lines or self._bytes + size > self.most_bytes
        ):
            await self._wait()

    def add(self, answer: asyncio.Task[Answer], size: int) -> None:
        """A line's answer started (after `room`)."""
        self._lines += 1
        self._bytes += size
        self._items.append((answer, size))
        self._changed.set()

    def close(self) -> None:
        """No more lines."""
        self._closed = True
        self._changed.set()

    async def next(self) -> tuple[asyncio.Task[Answer], int] | None:
        """The next line's answer being made, in input order; None once every line is taken."""
        while not self._items:
            if self._closed:
                return None
            await self._wait()
        return self._items.popleft()

    def written(self, size: int) -> None:
        """A line's answer is written: its room is free."""
        self._lines -= 1
        self._bytes -= size
        self._changed.set()

    def next_done(self) -> bool:
        """Whether the next line's answer is ready now."""
        return bool(self._items) and self._items[0][0].done()

    async def _wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()


async def _answer_all(
    engine: AsyncPoolingEngine, reader: LineReader, output: Output, in_flight: InFlight
) -> Counts:
    """Read, answer and write every line; the first reading or writing failure stops all."""
    counts = Counts()
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(_read_all(engine, reader, in_flight, group))
            group.create_task(_write_all(in_flight, output, counts))
    except* JobError as failed:
        raise failed.exceptions[0] from None
    return counts


async def _read_all(
    engine: AsyncPoolingEngine, reader: LineReader, in_flight: InFlight, group: asyncio.TaskGroup
) -> None:
    """Each line's answer started as room frees, in input order (reading in a worker thread)."""
    limit = reader.limit
    while lines := await asyncio.to_thread(_read, reader, limit):
        for number, line in lines:
            size = 0 if line is None else len(line)
            await in_flight.room(size)
            in_flight.add(group.create_task(_answer(engine, number, line, limit)), size)
    in_flight.close()


def _read(reader: LineReader, most_bytes: int) -> list[tuple[int, bytes | None]]:
    try:
        return reader.read(READ_LINES, most_bytes)
    except OSError as exc:
        raise JobError(f"cannot read the input: {exc.strerror or exc}") from None


async def _write_all(in_flight: InFlight, output: Output, counts: Counts) -> None:
    """Answers written in input order, gathered into few writes; progress on a terminal."""
    from tqdm import tqdm  # huggingface_hub's dependency; imported late, as the engine is

    progress = tqdm(desc="Running batch", unit="line", disable=not sys.stderr.isatty())
    gathered: list[bytes] = []
    held = 0
    try:
        while (item := await in_flight.next()) is not None:
            task, size = item
            answer = await task
            in_flight.written(size)
            counts.lines += 1
            counts.succeeded += answer.succeeded
            gathered.append(answer.line)
            held += len(answer.line)
            if held >= WRITE_BYTES or not in_flight.next_done():
                await asyncio.to_thread(output.write, b"".join(gathered))
                progress.update(len(gathered))
                gathered, held = [], 0
    finally:
        progress.close()


async def _answer(
    engine: AsyncPoolingEngine, number: int, line: bytes | None, limit: int
) -> Answer:
    """One line's output: the server's answer to its request, or the error of a bad line."""
    if line is None:
        return Answer(error_line(too_long(number, limit)), False)
    try:
        request = parse_line(line, number)
    except LineError as exc:
        return Answer(error_line(exc), False)
    delay = RETRY_FIRST_S
    while True:
        try:
            reply = await engine.request("POST", request.url, request.body)
        except Exception:  # the app answered 500 and raised: the server's client sees the 500
            logger.exception("line %d: the server failed", number)
            return Answer(internal_error_line(request.custom_id), False)
        if reply.status != 429:
            line = answer_line(request.custom_id, reply.status, reply.headers, reply.body)
            return Answer(line, 200 <= reply.status < 300)
        await asyncio.sleep(delay)
        delay = min(2 * delay, RETRY_MOST_S)

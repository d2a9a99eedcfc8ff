"""The job itself: resume where the state folder says, keep the engine saturated, merge.

Batches are read ahead (in a worker thread) and IN_FLIGHT of them wait in the engine at once,
each cut into pieces by the Python API; results come back in input order and are written as
whole parts (also in a worker thread) while the engine runs the batches behind them. A batch
never spans two parts, so a resumed job cuts the same batches as an uninterrupted one.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from poolserve.frontend.jobs import Truncate
from poolserve.frontend.prompts import prepend
from poolserve.frontend.texts import (
    InputTooLongError,
    Truncation,
    encode_texts,
    truncation_for,
)
from poolserve.http.errors import ERROR_TABLE
from poolserve.jobs.arrow import output_table
from poolserve.jobs.corpus.errors import JobError, row_name
from poolserve.jobs.corpus.files import InputSpec, count_rows, fingerprint
from poolserve.jobs.corpus.progress import Progress, Totals
from poolserve.jobs.corpus.reader import CorpusReader, Rows
from poolserve.jobs.corpus.state import JobFolder, Resume, Stage
from poolserve.offline import AsyncPoolingEngine, Pooled
from poolserve.types.errors import APIError

# Batches waiting in the engine at once: with the API's pieces of 128 inputs, enough that the
# engine's slots never empty while one batch's result is turned into Arrow and written.
IN_FLIGHT = 4


@dataclass(frozen=True)
class EmbedOptions:
    """The embedding asked for, as the Python API takes it."""

    normalize: bool | None = None  # None: the model's own (--pooler-config, else the model)
    dimensions: int | None = None
    prompt_name: str | None = None
    embed_dtype: str = "float32"
    truncate: bool = True  # cut to the model's length, as sentence-transformers' encode does
    adapter: str | None = None  # a LoRA adapter's name (--lora-modules): the rows run through it

    def api(self) -> dict[str, Any]:
        """Keyword arguments of `AsyncPoolingEngine.embed`."""
        return {
            "model": self.adapter,  # an adapter is named as a model is
            "normalize": self.normalize,
            "dimensions": self.dimensions,
            "prompt_name": self.prompt_name,
            # -1 cuts at the model's length; without truncation, cut rows are found and
            # refused after the batch (`_refuse_cut`), so the common case pays nothing
            "truncate_prompt_tokens": -1,
        }


@dataclass(frozen=True)
class EmbedJob:
    """Everything one `poolserve embed` run needs; `model` is the settings that shape outputs."""

    spec: InputSpec
    output: Path
    options: EmbedOptions
    model: dict[str, Any]
    batch_rows: int = 512
    part_rows: int = 8192
    overwrite: bool = False
    progress: bool | None = None  # None: a bar when stderr is a terminal

    def manifest(self) -> dict[str, Any]:
        """What a rerun must match to resume: the input as found now, the model, the options."""
        spec = self.spec
        found = {**fingerprint(spec.path), "format": spec.format}
        columns = {"text_column": spec.text_column, "id_column": spec.id_column}
        return {
            "input": {**found, **columns},
            "model": self.model,
            "options": asdict(self.options),
        }


@dataclass(frozen=True)
class Outcome:
    """How a run went: where it started, the output's rows, this run's work."""

    stage: Stage
    rows: int
    totals: Totals


EngineSource = Callable[[], Awaitable[AsyncPoolingEngine]]


async def run_job(job: EmbedJob, engine: EngineSource) -> Outcome:
    """Embed what is left of the corpus and merge; the engine is asked for only when needed."""
    folder = JobFolder(job.output)
    resume = await asyncio.to_thread(lambda: folder.prepare(job.manifest(), job.overwrite))
    if resume.stage is Stage.COMPLETE:
        return Outcome(resume.stage, resume.rows_done, Totals(0, 0, 0.0))
    totals = Totals(0, 0, 0.0)
    if resume.stage is not Stage.MERGE:
        totals = await _embed_rest(job, folder, resume, engine)
    start = time.perf_counter()
    rows = await asyncio.to_thread(folder.merge)
    await asyncio.to_thread(folder.finish)
    seconds = totals.seconds + time.perf_counter() - start
    return Outcome(resume.stage, rows, Totals(totals.rows, totals.tokens, seconds))


async def _embed_rest(
    job: EmbedJob, folder: JobFolder, resume: Resume, engine: EngineSource
) -> Totals:
    """The rows after the whole parts, into new parts; then the manifest says all are done."""
    reader = await asyncio.to_thread(CorpusReader, job.spec, resume.rows_done)
    first = await asyncio.to_thread(reader.take, min(job.batch_rows, job.part_rows))
    if first is None and resume.rows_done == 0:
        raise JobError(f"{job.spec.path} has no rows to embed")
    totals = Totals(0, 0, 0.0)
    if first is not None:
        shown = Progress.shown(job.progress)
        # the bar's total (a pass over a CSV or JSONL file) only for a bar someone sees
        total = await asyncio.to_thread(count_rows, job.spec) if shown else None
        started = await engine()
        progress = Progress(total, resume.rows_done, enabled=shown)
        try:
            await _embed_rows(started, job, reader, first, folder, resume.parts, progress)
        finally:
            totals = progress.close()
    await asyncio.to_thread(folder.mark_embedded, resume.rows_done + totals.rows)
    return totals


async def _embed_rows(
    engine: AsyncPoolingEngine,
    job: EmbedJob,
    reader: CorpusReader,
    first: Rows,
    folder: JobFolder,
    part: int,
    progress: Progress,
) -> None:
    """Batches in order through the engine, IN_FLIGHT at once; each part written when whole.

    A bad row stops the job after the rows before it are written: a rerun goes on from there.
    """
    pending: collections.deque[tuple[Rows, bool, asyncio.Task[list[Pooled]]]] = collections.deque()
    tables: list[pa.Table] = []
    filled = 0  # rows of the current part already handed to the engine
    next_rows: Rows | None = first
    failure: JobError | None = None

    async def flush() -> None:
        nonlocal part, tables
        if tables:
            await asyncio.to_thread(folder.write_part, part, pa.concat_tables(tables))
            part, tables = part + 1, []

    try:
        while True:
            while next_rows is not None and len(pending) < IN_FLIGHT:
                filled += len(next_rows.texts)
                closes = filled >= job.part_rows
                filled = 0 if closes else filled
                task = asyncio.create_task(_embed_batch(engine, next_rows, job.options))
                pending.append((next_rows, closes, task))
                want = min(job.batch_rows, job.part_rows - filled)
                try:
                    next_rows = await asyncio.to_thread(reader.take, want)
                except JobError as exc:  # a bad row ahead: the rows before it finish first
                    failure, next_rows = exc, None
            if not pending:
                break
            rows, closes, task = pending.popleft()
            try:
                pooled = await task
            except JobError:
                await flush()
                raise
            tables.append(output_table(rows.ids, pooled, job.options.embed_dtype))
            progress.advance(len(pooled), sum(p.prompt_tokens for p in pooled))
            if closes:
                await flush()
        await flush()
    finally:
        for _, _, task in pending:
            task.cancel()
    if failure is not None:
        raise failure


async def _embed_batch(
    engine: AsyncPoolingEngine, rows: Rows, options: EmbedOptions
) -> list[Pooled]:
    """One batch's embeddings; a refusal is pinned to the row that caused it."""
    try:
        pooled = await engine.embed(rows.texts, **options.api())
    except Exception as exc:
        param = _refused_param(exc)
        if param is None:
            raise  # not the input's fault: the engine's own failure, reported as is
        if param != "input":
            raise JobError(f"the model refuses these options: {_message(exc)}") from None
        raise await _pin_to_row(engine, rows, options, exc) from None
    if not options.truncate:
        await _refuse_cut(engine, rows, pooled, options)
    return pooled


def _refused_param(exc: Exception) -> str | None:
    """For a refused request (400), the parameter it names ('' for none); None otherwise."""
    if isinstance(exc, APIError):
        return (exc.param or "") if exc.status == 400 else None
    for cls in type(exc).__mro__:
        shape = ERROR_TABLE.get(cls)
        if shape is not None:
            return (shape.param(exc) or "") if shape.status == 400 else None
    return None


def _message(exc: Exception) -> str:
    return exc.message if isinstance(exc, APIError) else str(exc)


async def _pin_to_row(
    engine: AsyncPoolingEngine, rows: Rows, options: EmbedOptions, exc: Exception
) -> JobError:
    """The first row the engine refuses alone, found by halving the batch (a failure path)."""
    low, high = 0, len(rows.texts)  # a refused row lies in [low, high)
    refusal = exc
    while high - low > 1:
        middle = (low + high) // 2
        try:
            await engine.embed(rows.texts[low:middle], **options.api())
        except Exception as inner:
            if _refused_param(inner) != "input":
                raise
            high, refusal = middle, inner
            continue
        low = middle
    try:  # the row alone, for the engine's own words about it
        await engine.embed(rows.texts[low : low + 1], **options.api())
    except Exception as inner:
        if _refused_param(inner) != "input":
            raise
        refusal = inner
    where = row_name(rows.first + low, rows.ids[low].as_py())
    return JobError(f"{where}: {_message(refusal)}")


async def _refuse_cut(
    engine: AsyncPoolingEngine, rows: Rows, pooled: list[Pooled], options: EmbedOptions
) -> None:
    """--no-truncate: a row whose prompt reached the model's length is tokenized again (up to
    one token past what the engine kept) and refused if the engine had cut it.

    The kept length is the engine's own count, so this holds whatever the limit was
    (sentence-transformers' max_seq_length, max_model_len, or chunked processing's
    max_embed_len); rows shorter than the smallest of them are never cut and never checked.
    """
    model = engine.model
    cut = truncation_for(Truncate(-1), model)
    shortest = cut.keep or model.max_model_len
    prompt = model.prompts.resolve(options.prompt_name, None)
    for index, output in enumerate(pooled):
        if output.prompt_tokens < shortest:
            continue
        whole = Truncation(None, cut.side, output.prompt_tokens)  # refuses one token more
        try:
            text = prepend(prompt, [rows.texts[index]])
            await asyncio.to_thread(encode_texts, model, text, whole)
        except InputTooLongError:
            where = row_name(rows.first + index, rows.ids[index].as_py())
            raise JobError(
                f"{where} has more than {output.prompt_tokens} tokens, the most the model takes, "
                "and --no-truncate is set: shorten it, or drop --no-truncate to cut it as "
                "sentence-transformers does"
            ) from None

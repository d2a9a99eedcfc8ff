"""The input corpus in bounded batches: JSONL, CSV or Parquet rows of an id and a text.

pyarrow's streaming readers do the reading (Parquet row groups through `iter_batches`, CSV and
JSONL in blocks of `block_bytes`), so memory follows the blocks read ahead and one batch, never
the file.
Every batch is checked before it goes anywhere: ids present, texts non-empty strings; a bad
cell is named by its row's id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from poolserve.jobs.corpus.errors import JobError, row_name
from poolserve.jobs.corpus.files import InputSpec, check_readable, diagnose_jsonl

# CSV and JSONL blocks. pyarrow's streaming readers read about 32 blocks ahead whatever their
# thread settings (measured: 2 MB held at 64 KiB blocks, 36 MB at 1 MiB), so the block sets
# the memory; a row longer than a block is read by reopening with blocks 8x larger (up to
# MAX_BLOCK_BYTES), from where the reader stood. One thread: parsing at 100+ MB/s in a worker
# thread beside the engine is far ahead of any model's rows per second.
BLOCK_BYTES = 1 << 20
MAX_BLOCK_BYTES = 64 << 20
# Parquet batches hold at most this many rows, fewer when rows are large (bytes as above).
PARQUET_BATCH_ROWS = 4096


@dataclass(frozen=True)
class Rows:
    """One checked batch: its first row's position in the input, the ids and the texts."""

    first: int
    ids: pa.Array
    texts: list[str]


@dataclass(frozen=True)
class _Opened:
    batches: Iterator[pa.RecordBatch]
    drop: int  # rows still to skip from the first batches


def _require_columns(spec: InputSpec, names: list[str]) -> None:
    missing = [c for c in (spec.id_column, spec.text_column) if c not in names]
    if missing:
        flags = {spec.id_column: "--id-column", spec.text_column: "--text-column"}
        wanted = ", ".join(f"{c!r} ({flags[c]})" for c in missing)
        raise JobError(
            f"{spec.path} has no column {wanted}; its columns are: "
            f"{', '.join(repr(n) for n in names) or 'none'}"
        )


def _open_parquet(spec: InputSpec, skip: int, block_bytes: int) -> _Opened:
    """Row groups from the one holding row `skip` (the ones before are never read)."""
    handle = pq.ParquetFile(spec.path)
    _require_columns(spec, handle.schema_arrow.names)
    meta = handle.metadata
    group, before = 0, 0
    while group < meta.num_row_groups and before + meta.row_group(group).num_rows <= skip:
        before += meta.row_group(group).num_rows
        group += 1
    if group == meta.num_row_groups:
        return _Opened(iter(()), 0)
    first = meta.row_group(group)
    row_bytes = max(1, first.total_byte_size // max(1, first.num_rows))
    batch_rows = max(1, min(PARQUET_BATCH_ROWS, block_bytes // row_bytes))
    batches = handle.iter_batches(
        batch_size=batch_rows,
        row_groups=list(range(group, meta.num_row_groups)),
        columns=[spec.id_column, spec.text_column],
        use_threads=False,
    )
    return _Opened(batches, skip - before)


def _open_csv(spec: InputSpec, skip: int, block_bytes: int) -> _Opened:
    """CSV blocks; the text column read as strings (a CSV cell has no type: "42" is a text)."""
    read = pacsv.ReadOptions(block_size=block_bytes, use_threads=False)
    parse = pacsv.ParseOptions(newlines_in_values=True)  # quoted texts may span lines
    header = pacsv.open_csv(spec.path, read_options=read, parse_options=parse)
    names = header.schema.names
    header.close()
    _require_columns(spec, names)
    convert = pacsv.ConvertOptions(
        include_columns=[spec.id_column, spec.text_column],
        column_types={spec.text_column: pa.string()},
    )
    reader = pacsv.open_csv(
        spec.path, read_options=read, parse_options=parse, convert_options=convert
    )
    return _Opened(iter(reader), skip)


def _open_jsonl(spec: InputSpec, skip: int, block_bytes: int) -> _Opened:
    """JSON lines in blocks; types inferred from the first block, as pyarrow does."""
    read = pajson.ReadOptions(block_size=block_bytes, use_threads=False)
    reader = pajson.open_json(spec.path, read_options=read)
    _require_columns(spec, reader.schema.names)
    return _Opened(iter(reader), skip)


OPENERS: dict[str, Callable[[InputSpec, int, int], _Opened]] = {
    "parquet": _open_parquet,
    "csv": _open_csv,
    "jsonl": _open_jsonl,
}


class CorpusReader:
    """Checked rows of the input in batches of a caller's size, from row `skip` on."""

    def __init__(self, spec: InputSpec, skip: int = 0, block_bytes: int = BLOCK_BYTES) -> None:
        check_readable(spec.path)
        self.spec = spec
        self.position = skip  # the next row's position in the input
        self.batches_read = 0  # pyarrow batches pulled so far (tests bound memory with it)
        self.block_bytes = block_bytes
        self._head: pa.RecordBatch | None = None
        self._open(skip)

    def take(self, most: int) -> Rows | None:
        """The next `most` rows (fewer at the end), checked; None when none are left."""
        pieces: list[pa.RecordBatch] = []
        count = 0
        while count < most:
            head = self._next()
            if head is None:
                break
            piece = head.slice(0, most - count)
            self._head = head.slice(piece.num_rows)
            pieces.append(piece)
            count += piece.num_rows
        if not pieces:
            return None
        first, self.position = self.position, self.position + count
        return _checked(pa.Table.from_batches(pieces), self.spec, first)

    def _open(self, skip: int) -> None:
        """pyarrow's reader from row `skip`: rows before it skipped unread where the format
        allows (Parquet row groups), else read and dropped as they come."""
        while True:
            try:
                opened = OPENERS[self.spec.format](self.spec, skip, self.block_bytes)
                break
            except (pa.ArrowException, OSError, ValueError) as exc:
                if not self._grow(exc):
                    raise self._read_error(exc) from None
        self._batches = opened.batches
        self._drop = opened.drop
        self._pulled = skip - opened.drop  # rows of the input behind the reader

    def _next(self) -> pa.RecordBatch | None:
        """The current batch with rows left, pulling the next one when it is spent."""
        while self._head is None or self._head.num_rows == 0:
            batch = self._pull()
            if batch is None:
                return None
            self._head = batch
        return self._head

    def _pull(self) -> pa.RecordBatch | None:
        """pyarrow's next batch, past the rows still to skip; None at the end."""
        while True:
            try:
                batch = next(self._batches, None)
            except (pa.ArrowException, OSError, ValueError) as exc:
                if not self._grow(exc):
                    raise self._read_error(exc) from None
                self._open(self._pulled)
                continue
            if batch is None:
                return None
            self.batches_read += 1
            self._pulled += batch.num_rows
            dropped = min(self._drop, batch.num_rows)
            self._drop -= dropped
            if dropped < batch.num_rows:
                return batch.slice(dropped)

    def _grow(self, exc: Exception) -> bool:
        """A row longer than the block: blocks 8x larger from here (False past the largest)."""
        if "straddl" not in str(exc) or self.block_bytes >= MAX_BLOCK_BYTES:
            return False
        self.block_bytes *= 8
        return True

    def _read_error(self, exc: Exception) -> JobError:
        """An unreadable stretch of the input, pinned to its row where a line reader can."""
        spec = self.spec
        if spec.format == "jsonl":
            found = diagnose_jsonl(spec)
            if found is not None:
                return JobError(f"{spec.path}: {found}")
        where = f" after row {self.position}" if self.position else ""
        if "straddl" in str(exc):
            return JobError(
                f"{spec.path}: a row{where} is longer than {MAX_BLOCK_BYTES >> 20} MiB, "
                f"the longest the {spec.format} reader takes"
            )
        return JobError(f"cannot read {spec.path} as {spec.format}{where}: {exc}")


def _checked(table: pa.Table, spec: InputSpec, first: int) -> Rows:
    """The batch's ids and texts, or a refusal naming the first bad row."""
    ids = table.column(spec.id_column).combine_chunks()
    texts = table.column(spec.text_column).combine_chunks()
    if ids.null_count:
        row = pc.index(ids.is_null(), True).as_py()
        raise JobError(f"{row_name(first + row)}: its id (column {spec.id_column!r}) is null")

    def name(row: int) -> str:
        return row_name(first + row, ids[row].as_py())

    if pa.types.is_dictionary(texts.type):
        texts = texts.dictionary_decode()
    if str(texts.type) == "string_view":  # pyarrow >= 16; read as the plain string types
        texts = texts.cast(pa.large_string())
    if texts.null_count:
        row = pc.index(texts.is_null(), True).as_py()
        raise JobError(f"{name(row)}: its text (column {spec.text_column!r}) is null")
    if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)):
        raise JobError(
            f"{name(0)}: its text (column {spec.text_column!r}) is {texts.type}, not text; "
            "every cell of the text column must be a string"
        )
    empty = pc.index(pc.equal(pc.utf8_length(texts), 0), True).as_py()
    if empty >= 0:
        raise JobError(f"{name(empty)}: its text (column {spec.text_column!r}) is empty")
    return Rows(first, ids, texts.to_pylist())

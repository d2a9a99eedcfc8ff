"""The input file itself: its format by name, a readability check, its fingerprint for the
manifest, a quick row count for the progress bar, and a line-by-line look at a JSONL file that
pyarrow could not parse (to name the bad line or row)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from poolserve.jobs.corpus.errors import JobError, row_name

# file name ending -> input format (--input-format overrides)
FORMATS: dict[str, str] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
}
COUNT_CHUNK = 1 << 20
FINGERPRINT_BYTES = 1 << 20  # the input's head, hashed into the manifest


@dataclass(frozen=True)
class InputSpec:
    """Which file, read how, and which columns hold the ids and the texts."""

    path: Path
    format: str
    text_column: str
    id_column: str


def input_format(path: Path, override: str | None) -> str:
    """The format: `--input-format`, else the file name's ending."""
    if override is not None:
        return override
    for ending, name in FORMATS.items():
        if path.name.lower().endswith(ending):
            return name
    raise JobError(
        f"cannot tell the format of {path}: its name ends in none of "
        f"{', '.join(FORMATS)}; pass --input-format jsonl, csv or parquet"
    )


def check_readable(path: Path) -> None:
    """A clear refusal for a missing, unreadable or empty file, before any reader runs."""
    try:
        with path.open("rb") as handle:
            empty = not handle.read(1)
    except OSError as exc:
        raise JobError(f"cannot read {path}: {exc.strerror or exc}") from None
    if empty:
        raise JobError(f"{path} is empty (0 bytes): there are no rows to embed")


def diagnose_jsonl(spec: InputSpec) -> str | None:
    """The first line pyarrow could not take, read line by line (one line in memory at a time)."""
    position = 0
    id_kind: type | None = None
    with spec.path.open("rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError:
                return f"line {number} is not valid JSON"
            if not isinstance(value, dict):
                return f"line {number} is not a JSON object"
            row_id = value.get(spec.id_column)
            text = value.get(spec.text_column)
            if text is not None and not isinstance(text, str):
                return (
                    f"{row_name(position, row_id)}: its text (column {spec.text_column!r}) is "
                    f"{type(text).__name__} {text!r:.40}, not text"
                )
            kind = type(row_id) if row_id is not None else None
            if id_kind is not None and kind is not None and kind is not id_kind:
                return (
                    f"{row_name(position, row_id)}: its id is {kind.__name__}, the ids before "
                    f"it are {id_kind.__name__}; one column holds one type"
                )
            id_kind = id_kind or kind
            position += 1
    return None


def fingerprint(path: Path) -> dict[str, object]:
    """What tells the input apart from a changed one: its path, size, mtime and first bytes."""
    check_readable(path)
    status = path.stat()
    with path.open("rb") as handle:
        head = hashlib.sha256(handle.read(FINGERPRINT_BYTES)).hexdigest()
    return {
        "path": str(path.resolve()),
        "size": status.st_size,
        "mtime_ns": status.st_mtime_ns,
        "head_sha256": head,
    }


def count_rows(spec: InputSpec) -> int | None:
    """Rows in the input for the progress bar: Parquet's metadata, else a pass counting lines."""
    try:
        if spec.format == "parquet":
            return int(pq.ParquetFile(spec.path).metadata.num_rows)
        lines = 0
        last = b"\n"
        with spec.path.open("rb") as handle:
            while chunk := handle.read(COUNT_CHUNK):
                lines += chunk.count(b"\n")
                last = chunk[-1:]
        lines += last != b"\n"
    except (pa.ArrowException, OSError, ValueError):
        return None  # the reader reports what is wrong; the bar goes without a total
    return max(0, lines - (spec.format == "csv"))

"""A job's state folder beside its output: the manifest, whole parts, resume and the merge.

`OUTPUT.partial/` holds `manifest.json` (the job: input fingerprint, columns, model settings
and options) and `part-NNNNNN.parquet`, each written under a temporary name and renamed once
whole, so a kill at any moment leaves only whole parts. A rerun of the same job counts the rows
in its parts and goes on from there; when every row is done the parts are merged, row group by
row group, into a temporary file renamed to OUTPUT, and the folder is removed (renamed away
first, so a half-removed folder never looks like a job). The manifest records the merged file's
size before that rename: a rerun that finds OUTPUT and the folder knows whether OUTPUT is its
own finished work (it then removes the folder) or someone else's file (refused).
"""

from __future__ import annotations

import enum
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from poolserve.jobs.corpus.errors import JobError

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
PART_PREFIX, PART_SUFFIX = "part-", ".parquet"
MERGED = "output.parquet.tmp"
TMP = ".tmp"
# The merged output's row groups: this many rows at most, and about this many bytes.
ROW_GROUP_ROWS = 65536
ROW_GROUP_BYTES = 64 << 20
PROVENANCE_KEY = b"poolserve.embed"


class Stage(enum.Enum):
    """Where a job stands when its command starts."""

    FRESH = "fresh"  # nothing done yet
    RESUME = "resume"  # some parts done, rows left to embed
    MERGE = "merge"  # every row embedded, the parts not yet merged into OUTPUT
    COMPLETE = "complete"  # OUTPUT was already this job's finished work; the folder is gone


@dataclass(frozen=True)
class Resume:
    """What a rerun finds: the stage, the rows in whole parts and how many parts."""

    stage: Stage
    rows_done: int = 0
    parts: int = 0


class JobFolder:
    """The state folder of the job writing `output`."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.state = output.with_name(output.name + ".partial")
        self._new = output.with_name(output.name + ".partial.new")  # a folder being created
        self._trash = output.with_name(output.name + ".partial.removing")  # one being removed
        self._manifest: dict[str, Any] = {}

    def prepare(self, job: dict[str, Any], overwrite: bool) -> Resume:
        """Check a rerun against what is on disk; refuse anything that is not this job's.

        `overwrite` lets the job replace OUTPUT and discards another job's folder; this job's
        own folder is still resumed (rerunning the same command goes on, with the flag too).
        """
        if not self.output.parent.is_dir():
            raise JobError(f"the output's folder {self.output.parent} does not exist")
        if self.output.is_dir():
            raise JobError(f"{self.output} is a folder: name the Parquet file to write")
        for leftover in (self._new, self._trash):  # only ever written by this class
            shutil.rmtree(leftover, ignore_errors=True)
        new = {"version": MANIFEST_VERSION, "job": job, "rows": None, "merged": None}
        self._manifest = {**new, "replaces": overwrite}
        found = self._own_manifest(job, overwrite)
        if found is None:
            if self.output.exists() and not overwrite:
                raise JobError(
                    f"{self.output} already exists and no unfinished job writes it: "
                    "nothing is overwritten (pass --overwrite to replace it)"
                )
            return Resume(Stage.FRESH)
        self._manifest = {**found, "replaces": bool(found.get("replaces")) or overwrite}
        if self.output.exists():
            if self._is_merged_output():
                self.finish()  # killed after the final rename: only the clean-up was left
                return Resume(Stage.COMPLETE, int(found["rows"]))
            if not self._manifest["replaces"]:
                raise JobError(
                    f"{self.output} exists, and {self.state} holds an unfinished job that "
                    "would write it: move the file away, or pass --overwrite to replace it"
                )
        for stray in self.state.glob("*" + TMP):  # files a kill cut short
            stray.unlink()
        parts = self.part_paths()
        rows = sum(part_rows(p) for p in parts)
        if found.get("rows") is not None:
            if rows != found["rows"]:
                raise JobError(
                    f"{self.state} is damaged: its parts hold {rows} rows, not {found['rows']}"
                )
            return Resume(Stage.MERGE, rows, len(parts))
        return Resume(Stage.RESUME, rows, len(parts))

    def _own_manifest(self, job: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
        """The state folder's manifest when it is this job's; None when there is no folder (or
        another job's, discarded with `overwrite`)."""
        if not self.state.exists():
            return None
        try:
            found = self._read_manifest()
        except JobError:
            if not overwrite:
                raise
            self._remove_state()
            return None
        changed = differences(found.get("job", {}), job)
        if changed and not overwrite:
            raise JobError(
                f"{self.state} holds a different job (changed: {', '.join(changed)}): rerun the "
                "command that started it to resume, or pass --overwrite to start over"
            )
        if changed:
            self._remove_state()
            return None
        return found

    def create(self) -> None:
        """The folder with its manifest, appearing at once (built under another name); a job
        refused before its first part leaves nothing behind."""
        if self.state.exists():
            return
        self._new.mkdir()
        _write_json(self._new / MANIFEST, self._manifest)
        os.rename(self._new, self.state)
        _sync_dir(self.state.parent)

    def write_part(self, index: int, table: pa.Table) -> None:
        """Part `index`, whole or not at all (the folder appears with the first one)."""
        self.create()
        path = self.state / f"{PART_PREFIX}{index:06d}{PART_SUFFIX}"
        tmp = path.with_name(path.name + TMP)
        pq.write_table(table, tmp, row_group_size=max(1, table.num_rows))
        _sync_file(tmp)
        os.rename(tmp, path)
        _sync_dir(self.state)

    def mark_embedded(self, rows: int) -> None:
        """Every row is in a part: a rerun merges without loading the model."""
        self._manifest["rows"] = rows
        _write_json(self.state / MANIFEST, self._manifest)

    def merge(self) -> int:
        """The parts into OUTPUT, row group by row group; the rows written."""
        parts = self.part_paths()
        if not parts:
            raise JobError(f"{self.state} holds no parts to merge")
        tmp = self.state / MERGED
        schema = pq.read_schema(parts[0])
        provenance = json.dumps({k: self._manifest["job"][k] for k in ("model", "options")})
        schema = schema.with_metadata({**(schema.metadata or {}), PROVENANCE_KEY: provenance})
        rows = 0
        with pq.ParquetWriter(tmp, schema) as writer:
            for group in _row_groups(parts):
                writer.write_table(group, row_group_size=group.num_rows)
                rows += group.num_rows
        _sync_file(tmp)
        self._manifest["rows"] = rows
        self._manifest["merged"] = {"bytes": tmp.stat().st_size}
        _write_json(self.state / MANIFEST, self._manifest)
        os.replace(tmp, self.output)
        _sync_dir(self.output.parent)
        return rows

    def finish(self) -> None:
        """Remove the state folder: renamed away in one step, then deleted."""
        self._remove_state()

    def part_paths(self) -> list[Path]:
        """The whole parts in order; a gap in their numbers means the folder was tampered with."""
        paths = sorted(self.state.glob(f"{PART_PREFIX}*{PART_SUFFIX}"))
        for index, path in enumerate(paths):
            if path.name != f"{PART_PREFIX}{index:06d}{PART_SUFFIX}":
                raise JobError(f"{self.state} is damaged: part {index} is missing")
        return paths

    def _is_merged_output(self) -> bool:
        """Whether OUTPUT is the file this job's merge renamed (its size and rows recorded)."""
        merged = self._manifest.get("merged")
        if not merged:
            return False
        try:
            return (
                self.output.stat().st_size == merged["bytes"]
                and pq.read_metadata(self.output).num_rows == self._manifest["rows"]
            )
        except (OSError, pa.ArrowException):
            return False

    def _read_manifest(self) -> dict[str, Any]:
        try:
            found = json.loads((self.state / MANIFEST).read_text())
        except (OSError, ValueError):
            found = None
        if not isinstance(found, dict) or found.get("version") != MANIFEST_VERSION:
            raise JobError(
                f"{self.state} exists but holds no manifest of this command's jobs: "
                "remove it, or pass --overwrite to start over"
            )
        return found

    def _remove_state(self) -> None:
        if self.state.exists():
            os.rename(self.state, self._trash)
            _sync_dir(self._trash.parent)
        shutil.rmtree(self._trash, ignore_errors=True)


def differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two jobs."""
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            changed.append(f"{prefix}{key}")
    return changed


def part_rows(path: Path) -> int:
    """Rows in one whole part (its footer only)."""
    return int(pq.read_metadata(path).num_rows)


def _row_groups(parts: list[Path]) -> Iterator[pa.Table]:
    """The parts' rows as tables of about ROW_GROUP_BYTES (one part's row group at a time)."""
    pending: list[pa.Table] = []
    rows = size = 0
    for path in parts:
        handle = pq.ParquetFile(path)
        for index in range(handle.num_row_groups):
            table = handle.read_row_group(index)
            pending.append(table)
            rows, size = rows + table.num_rows, size + table.nbytes
            if rows >= ROW_GROUP_ROWS or size >= ROW_GROUP_BYTES:
                yield pa.concat_tables(pending).combine_chunks()
                pending, rows, size = [], 0, 0
    if pending:
        yield pa.concat_tables(pending).combine_chunks()


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + TMP)
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    _sync_file(tmp)
    os.replace(tmp, path)
    _sync_dir(path.parent)


def _sync_file(path: Path) -> None:
    """Durable on disk before it is renamed into place (a power cut keeps whole files too)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sync_dir(path: Path) -> None:
    """The folder's entries (a rename) durable."""
    _sync_file(path)

"""`poolserve embed` killed with SIGKILL and rerun: the final file equals an uninterrupted run's
row for row (no row lost or repeated), whether the kill lands while rows are embedded, inside
the merge or inside the clean-up. Real CLI processes, a few hundred short rows, small parts."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROWS = 240
IDS = [f"r{i:04d}" for i in range(ROWS)]
TEXTS = [f"row {i} is about topic {i % 11} and item {i * 7 % 13}" for i in range(ROWS)]
# The job's own files in its state folder; anything else there would be a stray.
STATE_FILES = ("manifest.json", "manifest.json.tmp", "output.parquet.tmp")

# Runs the CLI after arranging for the process to SIGKILL itself at one point of the merge or
# the clean-up (moments too short for a timed kill from outside to hit reliably).
KILL_AT = """
import os, signal, shutil, sys
import poolserve.jobs.corpus.state as state

point = os.environ["KILL_POINT"]

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if point == "merge-write":  # after the merged file's second row group, before its footer
    state.ROW_GROUP_ROWS = 50
    groups = state._row_groups
    def dying(parts):
        for index, group in enumerate(groups(parts)):
            if index == 2:
                die()
            yield group
    state._row_groups = dying
elif point == "before-rename":  # the merged file whole, not yet renamed to OUTPUT
    replace = os.replace
    def dying_replace(source, target):
        if str(source).endswith(state.MERGED):
            die()
        return replace(source, target)
    os.replace = dying_replace
elif point == "before-cleanup":  # OUTPUT in place, the state folder still there
    state.JobFolder.finish = die
elif point == "during-cleanup":  # the state folder renamed away, not yet deleted
    rmtree = shutil.rmtree
    def dying_rmtree(path, *args, **kwargs):
        if str(path).endswith(".partial.removing") and os.path.exists(path):
            die()
        return rmtree(path, *args, **kwargs)
    shutil.rmtree = dying_rmtree

from poolserve.cli import main
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.parquet"
    pq.write_table(pa.table({"id": IDS, "text": TEXTS}), path, row_group_size=50)
    return path


def embed_argv(corpus: Path, output: Path) -> list[str]:
    """The CLI's arguments: parts of 10 rows, batches of 5."""
    return ["embed", str(corpus), "-o", str(output), "--part-rows", "10", "--batch-rows", "5"]


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "poolserve", *argv]


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> pa.Table:
    """An uninterrupted run's output (the CLI in this process: no second interpreter start)."""
    output = tmp_path_factory.mktemp("reference") / "out.parquet"
    assert run_here(*embed_argv(corpus, output)) == 0
    return pq.read_table(output)


def run_here(*argv: str) -> int:
    """The CLI in this process (its log handler kept off pytest's streams); the exit code."""
    from poolserve.cli import main
    from poolserve.jobs.corpus import command

    with mock.patch.object(command, "configure_logging"), pytest.raises(SystemExit) as exited:
        main(list(argv))
    return int(exited.value.code or 0)


def state_of(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


def check_whole_parts(output: Path) -> int:
    """After a kill: only whole parts, holding the input's first rows in order; their rows."""
    state = state_of(output)
    if not state.exists():
        return ROWS if output.exists() else 0
    parts = sorted(state.glob("part-*.parquet"))
    names = {p.name for p in state.iterdir()}
    allowed = {*STATE_FILES, *(p.name for p in parts), *(p.name + ".tmp" for p in parts)}
    allowed.add(f"part-{len(parts):06d}.parquet.tmp")  # the part being written when killed
    assert names <= allowed
    ids = [i for p in parts for i in pq.read_table(p).column("id").to_pylist()]
    assert ids == IDS[: len(ids)]
    return len(ids)


def assert_same_rows(output: Path, reference: pa.Table) -> None:
    """The file the reruns finished equals the uninterrupted run's, row for row."""
    assert not state_of(output).exists()
    assert not output.with_name(output.name + ".partial.removing").exists()
    table = pq.read_table(output)
    assert table.column("id").to_pylist() == IDS
    assert table.column("prompt_tokens").equals(reference.column("prompt_tokens"))
    assert table.schema.equals(reference.schema)
    got = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    want = np.stack(reference.column("embedding").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(got, want, atol=1e-6)


def started_embedding(process: subprocess.Popen[bytes], output: Path) -> bool:
    """Wait until the first part is written (the interpreter's imports are long done)."""
    while process.poll() is None:
        if state_of(output).exists():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_killed_at_random_moments(
    tmp_path: Path, corpus: Path, reference: pa.Table, seed: int
) -> None:
    output = tmp_path / "out.parquet"
    process = subprocess.Popen(cli(*embed_argv(corpus, output)), stderr=subprocess.PIPE)
    if started_embedding(process, output):
        # anywhere from the first part to the end: embedding, the merge or the clean-up
        time.sleep(random.Random(seed).uniform(0.0, 1.5))
        process.kill()
    _, err = process.communicate()
    assert process.returncode in (0, -9), err
    before = check_whole_parts(output)
    if output.exists() and not state_of(output).exists():
        # killed after the final rename: a rerun is refused (and clears what the kill left)
        assert run_here(*embed_argv(corpus, output)) == 1
    else:
        rerun = subprocess.run(cli(*embed_argv(corpus, output)), capture_output=True, text=True)
        assert rerun.returncode == 0, rerun.stderr
        # it went on from the whole parts: only the rows after them were embedded again
        assert (
            f"embedded {ROWS - before} rows" in rerun.stderr or "already complete" in rerun.stderr
        )
    assert_same_rows(output, reference)


def test_killed_inside_the_merge_and_the_clean_up(
    tmp_path: Path, corpus: Path, reference: pa.Table
) -> None:
    output = tmp_path / "out.parquet"
    state = state_of(output)
    argv = [sys.executable, "-c", KILL_AT, *embed_argv(corpus, output), "--log-level", "warning"]

    def killed_at(point: str) -> None:
        run = subprocess.run(argv, env={**os.environ, "KILL_POINT": point}, capture_output=True)
        assert run.returncode == -9, run.stderr.decode()

    killed_at("merge-write")  # every row embedded; the merged file cut short
    assert check_whole_parts(output) == ROWS
    assert (state / "output.parquet.tmp").exists() and not output.exists()
    killed_at("before-rename")  # the rerun merges again (no model needed), killed before rename
    assert check_whole_parts(output) == ROWS and not output.exists()
    killed_at("before-cleanup")  # merged and renamed, the folder left behind
    assert output.exists() and state.exists()
    killed_at("during-cleanup")  # the rerun sees its own finished file: only clean-up is left
    assert output.exists() and not state.exists()
    assert run_here(*embed_argv(corpus, output)) == 1  # finished: never redone, only refused
    assert_same_rows(output, reference)

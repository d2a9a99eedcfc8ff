"""poolserve.jobs.ray_data on a local Ray cluster (CPU): Parquet files embedded by one and two
actors equal, row for row by id, what `poolserve embed` (run as a process) writes for the same
rows, model and options; bad rows are refused by id through Ray; the module loads without Ray."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from poolserve.jobs import arrow
from poolserve.jobs.corpus.errors import JobError
from poolserve.jobs.corpus.run import EmbedOptions
from poolserve.jobs.ray_data import PoolserveEmbedder, checked_rows, embed_dataset, job_error
from tests.deploy.tools import in_ci

try:
    import ray
except ImportError:  # the dev extra installs it: only a venv older than pyproject.toml lacks it
    message = "ray is not installed: pip install -e '.[dev]' (or '.[ray-data]')"
    if in_ci():
        pytest.fail(f"{message} (CI is set: a missing package is a failure)", pytrace=False)
    pytest.skip(message, allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
LONG = " ".join(f"word{i} and more" for i in range(200))  # past MiniLM's 256 tokens: truncated
TEXTS = [
    LONG,
    "Ünïcödé text — with accents, 中文字符 and an emoji 🙂",
    *(f"row {i} on topic {i % 7}: " + "filler " * (i % 23) for i in range(238)),
]
FILES = 4
# Cheap engine settings: a small step budget keeps each actor's warm-up and memory small.
SERVER = {"max_num_batched_tokens": 512}
SERVER_FLAGS = ("--max-num-batched-tokens", "512")


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A local Ray cluster: 4 logical CPUs (2 actors, reads, writes) on this 2-core machine."""
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=256 << 20,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


def write_corpus(root: Path, ids: list[object], texts: list[str]) -> tuple[Path, Path]:
    """The rows as FILES Parquet files in a folder (Ray's input) and as one file (the command's)."""
    folder = root / "corpus"
    folder.mkdir()
    for part in range(FILES):
        rows = slice(part * len(ids) // FILES, (part + 1) * len(ids) // FILES)
        pq.write_table(pa.table({"id": ids[rows], "text": texts[rows]}), folder / f"{part}.parquet")
    whole = root / "whole.parquet"
    pq.write_table(pa.table({"id": ids, "text": texts}), whole)
    return folder, whole


def poolserve_embed(source: Path, output: Path, *flags: str) -> pa.Table:
    """`poolserve embed SOURCE -o OUTPUT FLAGS`, the command as a user runs it."""
    command = [sys.executable, "-m", "poolserve", "embed", str(source), "-o", str(output)]
    done = subprocess.run(
        [*command, *SERVER_FLAGS, *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return pq.read_table(output)


def assert_same_rows(got: pa.Table, want: pa.Table, atol: float) -> None:
    """Equal fields (types and the embed_dtype metadata), ids, token counts; close embeddings."""
    assert got.schema.remove_metadata().equals(want.schema.remove_metadata(), check_metadata=True)
    got, want = got.sort_by("id"), want.sort_by("id")
    assert got.column("id").to_pylist() == want.column("id").to_pylist()
    assert got.column("prompt_tokens").to_pylist() == want.column("prompt_tokens").to_pylist()
    np.testing.assert_allclose(vectors(got), vectors(want), rtol=0, atol=atol)


def vectors(table: pa.Table) -> np.ndarray:
    column = table.column("embedding").combine_chunks()
    values = column.values.to_numpy(zero_copy_only=False).astype(np.float32)
    return values.reshape(len(column), -1)


@pytest.mark.usefixtures("cluster")
def test_two_actors_equal_poolserve_embed(tmp_path: Path, minilm_dir: Path) -> None:
    folder, whole = write_corpus(tmp_path, list(range(len(TEXTS))), TEXTS)
    out = tmp_path / "ray"
    embed_dataset(folder, out, actors=2, batch_size=32, model=str(minilm_dir), **SERVER)
    want = poolserve_embed(whole, tmp_path / "want.parquet", "--model", str(minilm_dir))
    got = pq.read_table(out)
    assert got.num_rows == len(TEXTS)
    assert_same_rows(got, want, atol=1e-6)
    assert max(got.column("prompt_tokens").to_pylist()) == 256  # LONG cut as the command cuts it


@pytest.mark.usefixtures("cluster")
def test_one_actor_with_options_equals_poolserve_embed(tmp_path: Path, minilm_dir: Path) -> None:
    ids = [f"doc-{i}" for i in range(len(TEXTS))]
    folder, whole = write_corpus(tmp_path, ids, TEXTS)
    options = EmbedOptions(normalize=False, embed_dtype="float16")
    out = tmp_path / "ray"
    embed_dataset(
        folder, out, actors=1, batch_size=64, options=options, model=str(minilm_dir), **SERVER
    )
    flags = ("--model", str(minilm_dir), "--no-normalize", "--embed-dtype", "float16")
    want = poolserve_embed(whole, tmp_path / "want.parquet", *flags)
    assert_same_rows(pq.read_table(out), want, atol=1e-3)  # float16: a rounding step at most


@pytest.mark.usefixtures("cluster")
def test_a_null_text_is_refused_by_its_id(tmp_path: Path, minilm_dir: Path) -> None:
    folder = tmp_path / "bad"
    folder.mkdir()
    pq.write_table(pa.table({"id": [1, 2, 3], "text": ["a", None, "c"]}), folder / "0.parquet")
    with pytest.raises(JobError) as refused:
        embed_dataset(folder, tmp_path / "out", model=str(minilm_dir), **SERVER)
    assert str(job_error(refused.value)) == "row id=2: its text (column 'text') is null"
    with pytest.raises(JobError, match="no column 'body'"):
        embed_dataset(folder, tmp_path / "out2", text_column="body", model=str(minilm_dir))


@pytest.mark.usefixtures("cluster")
def test_a_pool_that_starves_reads_and_writes_is_refused(tmp_path: Path) -> None:
    """Actors holding every CPU would leave Ray Data's read and write tasks waiting forever."""
    folder, _ = write_corpus(tmp_path, [1, 2], ["a", "b"])
    with pytest.raises(JobError, match="4 actors x 1 CPUs leave none of the cluster's 4 CPUs"):
        embed_dataset(folder, tmp_path / "out", actors=4)


def test_in_process_numpy_batches(minilm_dir: Path) -> None:
    """The class without Ray: a dict of numpy arrays (Ray's default batch format) gives the
    engine's own embeddings in the layout; truncate=False (the command's alone) is refused."""
    texts = ["a short text", "another one"]
    batch = {"id": np.array([7, 9]), "text": np.array(texts, dtype=object)}
    embedder = PoolserveEmbedder(model=str(minilm_dir), **SERVER)
    try:
        want = arrow.output_table(pa.array([7, 9]), embedder.engine.embed(texts), "float32")
        assert embedder(batch).equals(want)
        empty = embedder(
            pa.table({"id": pa.array([], pa.int64()), "text": pa.array([], pa.string())})
        )
        assert empty.num_rows == 0 and empty.schema.equals(want.schema, check_metadata=True)
    finally:
        embedder.close()
    with pytest.raises(ValueError, match="truncate=False is poolserve embed's alone"):
        PoolserveEmbedder(options=EmbedOptions(truncate=False))


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        (pa.array(["a", ""]), "row id=2: its text (column 'text') is empty"),
        (pa.array([1, 2]), "the text column 'text' is int64, not text"),
    ],
)
def test_checked_rows_names_the_bad_row(texts: pa.Array, message: str) -> None:
    table = pa.table({"id": [1, 2], "text": texts})
    with pytest.raises(JobError, match=f"^{re.escape(message)}$"):
        checked_rows(table, "text", "id")


def test_module_loads_without_ray() -> None:
    code = "import sys; sys.modules['ray'] = None; import poolserve.jobs.ray_data"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr

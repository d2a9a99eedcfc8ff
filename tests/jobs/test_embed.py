"""`poolserve embed`: outputs against sentence-transformers, the stored dtypes, bounded reading
and every bad input's message and exit code (the CLI run in process)."""

from __future__ import annotations

import ast
import asyncio
import gc
import io
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch
from sentence_transformers import SentenceTransformer

from poolserve.cli import main
from poolserve.jobs import arrow
from poolserve.jobs.corpus import command
from poolserve.jobs.corpus.files import InputSpec
from poolserve.jobs.corpus.progress import Progress
from poolserve.jobs.corpus.reader import CorpusReader
from poolserve.jobs.corpus.run import EmbedJob, EmbedOptions, run_job
from poolserve.jobs.corpus.state import JobFolder
from poolserve.offline import AsyncPoolingEngine

LONG = " ".join(f"word{i} and more" for i in range(200))  # far past MiniLM's 256 tokens
TEXTS = [
    "A short sentence.",
    'Quoted, with commas, "quotes" and\na line break inside',
    "Ünïcödé text — with accents, 中文字符 and an emoji 🙂",
    " ",
    LONG,
    *(f"document {i} about topic {i % 5}: " + "filler " * (i * 4) for i in range(10)),
]
IDS = [f"doc-{i}" for i in range(len(TEXTS))]
BLOCK = 16 << 10  # the readers' block in the streaming tests


@pytest.fixture(autouse=True)
def _keep_pytest_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command installs its own stderr handler; in process it would outlive the test."""
    monkeypatch.setattr(command, "configure_logging", lambda *args: None)


@pytest.fixture(scope="module")
def minilm(minilm_dir: Path) -> SentenceTransformer:
    return SentenceTransformer(str(minilm_dir), device="cpu")


@pytest.fixture(scope="module")
def reference(minilm: SentenceTransformer) -> tuple[np.ndarray, list[int]]:
    """sentence-transformers' embeddings and the tokenizer's counts (cut at max_seq_length)."""
    vectors = minilm.encode(TEXTS, convert_to_numpy=True, batch_size=8)
    counts = minilm.tokenizer(TEXTS, truncation=True, max_length=minilm.max_seq_length)
    return vectors, [len(ids) for ids in counts["input_ids"]]


def embed(*argv: str) -> int:
    """`poolserve embed ARGV` in this process; its exit code."""
    with pytest.raises(SystemExit) as exited:
        main(["embed", *argv])
    return int(exited.value.code or 0)


def write_corpus(
    path: Path, ids: Sequence[object], texts: Sequence[object], row_group: int = 7
) -> Path:
    """The rows in the format the file name says (Parquet in row groups of `row_group`)."""
    table = pa.table({"id": ids, "text": texts})
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=row_group)
    elif path.suffix == ".csv":
        pacsv.write_csv(table, path)
    else:
        path.write_text(
            "".join(
                json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids, texts, strict=True)
            )
        )
    return path


def vectors_of(table: pa.Table) -> np.ndarray:
    column = table.column("embedding").combine_chunks()
    return column.values.to_numpy(zero_copy_only=False).reshape(len(column), -1)


@pytest.mark.parametrize("name", ["corpus.jsonl", "corpus.csv", "corpus.parquet"])
def test_each_format_equals_sentence_transformers(
    tmp_path: Path, name: str, reference: tuple[np.ndarray, list[int]]
) -> None:
    source = write_corpus(tmp_path / name, IDS, TEXTS)
    output = tmp_path / "out.parquet"
    assert embed(str(source), "-o", str(output), "--batch-rows", "7", "--part-rows", "10") == 0
    table = pq.read_table(output)
    assert table.column("id").to_pylist() == IDS
    vectors, counts = reference
    np.testing.assert_allclose(vectors_of(table), vectors, atol=2e-5)
    assert table.column("prompt_tokens").to_pylist() == counts
    assert counts[4] == 256  # the long row was cut as sentence-transformers cuts it
    assert not (tmp_path / "out.parquet.partial").exists()


def test_integer_ids_keep_their_type_and_no_normalize(
    tmp_path: Path, minilm: SentenceTransformer
) -> None:
    source = write_corpus(tmp_path / "c.parquet", list(range(100, 105)), TEXTS[:5])
    output = tmp_path / "out.parquet"
    assert embed(str(source), "-o", str(output), "--no-normalize") == 0
    table = pq.read_table(output)
    assert table.schema.field("id").type == pa.int64()
    assert table.column("id").to_pylist() == list(range(100, 105))
    unnormalized = SentenceTransformer(modules=[minilm[0], minilm[1]], device="cpu")
    np.testing.assert_allclose(vectors_of(table), unnormalized.encode(TEXTS[:5]), atol=5e-5)


def test_rows_run_through_a_lora_adapter(tmp_path: Path, minilm_dir: Path) -> None:
    """`--adapter NAME` embeds through a --lora-modules adapter as the API's `model` does: equal
    to sentence-transformers over PEFT's merged model."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    base = AutoModel.from_pretrained(minilm_dir)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value", "output.dense"])
    adapted = get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    adapted.save_pretrained(tmp_path / "tuned")
    source = write_corpus(tmp_path / "c.jsonl", IDS[:5], TEXTS[:5])
    output = tmp_path / "out.parquet"
    argv = ["--lora-modules", f"tuned={tmp_path / 'tuned'}", "--adapter", "tuned"]
    assert embed(str(source), "-o", str(output), *argv) == 0
    reference = SentenceTransformer(str(minilm_dir), device="cpu")
    reference[0].model = adapted.merge_and_unload().eval()
    want = reference.encode(TEXTS[:5], convert_to_numpy=True)
    got = vectors_of(pq.read_table(output))
    np.testing.assert_allclose(got, want, atol=5e-5)
    plain = SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS[:5])
    assert float(np.abs(got - plain).max()) > 1e-3  # the adapter ran, not the base model


def test_embed_dtypes_stored_as_documented(tmp_path: Path, minilm_dir: Path) -> None:
    source = write_corpus(tmp_path / "c.jsonl", IDS, TEXTS)
    spec = InputSpec(source, "jsonl", "text", "id")
    dtypes = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")

    async def every_dtype() -> dict[str, pa.Table]:
        # one engine for the five jobs (the CLI starts one per run: seconds each)
        async with AsyncPoolingEngine(str(minilm_dir)) as engine:

            async def started() -> AsyncPoolingEngine:
                return engine

            tables = {}
            for dtype in dtypes:
                output = tmp_path / f"{dtype}.parquet"
                job = EmbedJob(spec, output, EmbedOptions(embed_dtype=dtype), {})
                await run_job(job, started)
                tables[dtype] = pq.read_table(output)
            return tables

    stored = {}
    for dtype, table in asyncio.run(every_dtype()).items():
        field = table.schema.field("embedding")
        assert field.metadata == {b"poolserve.embed_dtype": dtype.encode()}
        assert field.type.value_type == arrow.EMBED_DTYPES[dtype]
        stored[dtype] = vectors_of(table)
    full = torch.from_numpy(stored["float32"].copy())
    assert stored["float32"].dtype == np.float32
    np.testing.assert_array_equal(stored["float16"], stored["float32"].astype(np.float16))
    casts = {
        "bfloat16": (torch.bfloat16, torch.uint16),
        "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
        "fp8_e5m2": (torch.float8_e5m2, torch.uint8),
    }
    for dtype, (cast, bits) in casts.items():
        np.testing.assert_array_equal(stored[dtype], full.to(cast).view(bits).numpy())


def test_flag_dtypes_are_arrow_dtypes() -> None:
    assert tuple(arrow.EMBED_DTYPES) == command.EMBED_DTYPES


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_reader_streams_in_bounded_batches(tmp_path: Path, suffix: str) -> None:
    texts = [f"row {i} " + "x" * 200 for i in range(20_000)]  # about 4 MB of text
    source = write_corpus(tmp_path / f"big{suffix}", list(range(len(texts))), texts, 500)
    gc.collect()
    baseline = pa.total_allocated_bytes()  # before the reader: its read-ahead counts too
    reader = CorpusReader(
        InputSpec(source, suffix[1:], "text", "id"), skip=5_000, block_bytes=BLOCK
    )
    peak, rows, first = 0, 0, None
    while (batch := reader.take(300)) is not None:
        first = batch.first if first is None else first
        assert len(batch.texts) <= 300
        rows += len(batch.texts)
        peak = max(peak, pa.total_allocated_bytes() - baseline)
    assert (first, rows) == (5_000, 15_000)
    assert reader.batches_read > 20  # many blocks or row groups, never the whole file
    # pyarrow's CSV and JSON readers hold about 32 blocks (read ahead): 0.5 MB of 4 MB of text
    assert peak < sum(len(text) for text in texts) // 4


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_row_longer_than_a_block_is_read(tmp_path: Path, suffix: str) -> None:
    texts = [f"row {i}" for i in range(300)]
    texts[150] = "long " * 20_000  # 100 KB: six 16 KiB blocks
    source = write_corpus(tmp_path / f"long{suffix}", list(range(300)), texts)
    reader = CorpusReader(InputSpec(source, suffix[1:], "text", "id"), skip=10, block_bytes=BLOCK)
    got = []
    while (batch := reader.take(64)) is not None:
        got += batch.texts
    assert got == texts[10:]
    assert reader.block_bytes == 8 * BLOCK  # reopened once, with larger blocks, where it stood


def test_command_module_loads_nothing_heavy() -> None:
    """`poolserve --help` imports the command: pyarrow and the engine load only in `run`."""
    tree = ast.parse(Path(command.__file__).read_text())
    top = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not {
        name
        for name in top
        if name and name.startswith(("pyarrow", "poolserve.jobs", "poolserve.offline"))
    }


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run, expect exit 1 and one error line on stderr; the line."""
    assert embed(*argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("poolserve embed: error: ")]
    assert len(lines) == 1, err
    return lines[0]


BadInput = Callable[[Path], Path]


def _text(name: str, content: str) -> BadInput:
    def make(folder: Path) -> Path:
        (folder / name).write_text(content)
        return folder / name

    return make


def _rows(name: str, ids: Sequence[object], texts: Sequence[object]) -> BadInput:
    return lambda folder: write_corpus(folder / name, ids, texts)


def _folder(name: str) -> BadInput:
    def make(folder: Path) -> Path:
        (folder / name).mkdir()
        return folder / name

    return make


BAD_INPUTS: dict[str, tuple[BadInput, str]] = {
    "missing file": (lambda folder: folder / "nope.jsonl", "cannot read"),
    "a folder": (_folder("dir.csv"), "cannot read"),
    # what it is, not the format its name lacks (docs/jobs.md's table)
    "a folder without an ending": (_folder("corpus"), "Is a directory"),
    "unknown format": (_text("c.txt", "id,text\n1,a\n"), "--input-format"),
    "empty file": (_text("e.jsonl", ""), "is empty (0 bytes)"),
    "header only": (_text("h.csv", "id,text\n"), "has no rows"),
    "no rows": (_rows("n.parquet", [], []), "has no rows"),
    "missing text column": (
        _text("b.jsonl", '{"id": 1, "body": "a"}\n'),
        "no column 'text' (--text-column); its columns are: 'id', 'body'",
    ),
    "missing id column": (
        _text("b.csv", "key,text\n1,a\n"),
        "no column 'id' (--id-column); its columns are: 'key', 'text'",
    ),
    "null text": (
        _rows("n.parquet", ["a", "b"], ["x", None]),
        "row id='b' (row 2): its text (column 'text') is null",
    ),
    "number texts": (
        _rows("i.parquet", ["a", "b"], [1, 2]),
        "row id='a' (row 1): its text (column 'text') is int64, not text",
    ),
    "a number among texts": (
        _text("m.jsonl", '{"id": 1, "text": "a"}\n{"id": 2, "text": 3}\n'),
        "row id=2 (row 2): its text (column 'text') is int 3, not text",
    ),
    "empty csv cell": (
        _text("e.csv", 'id,text\n1,a\n2,""\n'),
        "row id=2 (row 2): its text (column 'text') is empty",
    ),
    "null id": (_rows("n.parquet", [1, None], ["a", "b"]), "row 2: its id (column 'id') is null"),
    "not json": (_text("j.jsonl", '{"id": 1, "text": "a"}\nnope\n'), "line 2 is not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_one_line_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    make, expected = BAD_INPUTS[case]
    source = make(tmp_path)
    output = tmp_path / "out.parquet"
    line = refused(capsys, str(source), "-o", str(output))
    assert expected in line
    assert not output.exists() and not (tmp_path / "out.parquet.partial").exists()


def test_bad_row_after_whole_parts_is_named_and_a_changed_rerun_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts: list[object] = [f"text {i}" for i in range(30)]
    texts[23] = None
    source = write_corpus(tmp_path / "c.parquet", list(range(30)), texts)
    output = tmp_path / "out.parquet"
    argv = [str(source), "-o", str(output), "--batch-rows", "5", "--part-rows", "10"]
    assert "row id=23 (row 24): its text (column 'text') is null" in refused(capsys, *argv)
    state = tmp_path / "out.parquet.partial"
    # the batches before the bad row's are kept (parts of 10 rows; its batch is 20 to 24)
    parts = sorted(state.glob("part-*"))
    assert [pq.read_table(p).column("id").to_pylist() for p in parts] == [
        list(range(10)),
        list(range(10, 20)),
    ]
    line = refused(capsys, *argv, "--embed-dtype", "float16")
    assert "holds a different job (changed: options.embed_dtype)" in line
    line = refused(capsys, *argv, "--max-model-len", "128")
    assert "changed: model.max_model_len" in line
    assert "row id=23" in refused(capsys, *argv)  # the same command resumes, and stops there
    (state / "manifest.json").unlink()
    assert "holds no manifest" in refused(capsys, *argv)
    assert not output.exists()


def test_existing_output_is_never_overwritten(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = write_corpus(tmp_path / "c.jsonl", IDS[:6], TEXTS[:6])
    output = tmp_path / "out.parquet"
    output.write_bytes(b"not mine")
    argv = [str(source), "-o", str(output), "--part-rows", "2"]
    assert "already exists" in refused(capsys, *argv)
    assert output.read_bytes() == b"not mine"
    # --overwrite, interrupted before the merge: the old file stays until the new one is whole
    merge = JobFolder.merge
    monkeypatch.setattr(JobFolder, "merge", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    assert embed(*argv, "--overwrite") == 130
    assert output.read_bytes() == b"not mine"
    monkeypatch.setattr(JobFolder, "merge", merge)
    capsys.readouterr()
    assert "holds a different job" in refused(capsys, *argv, "--embed-dtype", "float16")
    caplog.set_level(logging.INFO, logger="poolserve.jobs.embed")
    # the job resumes (with or without the flag: it was started to replace OUTPUT), and
    # embeds nothing again
    assert embed(*argv) == 0
    assert "embedded 0 rows" in caplog.text
    assert pq.read_table(output).column("id").to_pylist() == IDS[:6]
    assert "already exists" in refused(capsys, *argv)


def test_no_truncate_refuses_the_long_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], minilm: SentenceTransformer
) -> None:
    source = write_corpus(tmp_path / "c.jsonl", IDS, TEXTS)
    output = tmp_path / "out.parquet"
    line = refused(capsys, str(source), "-o", str(output), "--no-truncate")
    assert "row id='doc-4' (row 5) has more than 256 tokens, the most the model takes" in line
    exact = "hello " * 254  # 256 tokens with [CLS] and [SEP]: at the limit, not past it
    assert len(minilm.tokenizer(exact)["input_ids"]) == 256
    short = write_corpus(tmp_path / "s.jsonl", IDS[:4], [*TEXTS[:3], exact])
    assert embed(str(short), "-o", str(output), "--no-truncate") == 0
    assert pq.read_table(output).column("prompt_tokens").to_pylist()[3] == 256


def test_options_the_model_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_corpus(tmp_path / "c.jsonl", IDS[:3], TEXTS[:3])
    output = tmp_path / "out.parquet"
    assert "dimensions" in refused(capsys, str(source), "-o", str(output), "--dimensions", "8")
    assert "prompt_name" in refused(capsys, str(source), "-o", str(output), "--prompt-name", "q")
    line = refused(capsys, str(source), "-o", str(output), "--model", str(tmp_path / "none"))
    assert "the model could not start: " in line and "no such folder" in line


def test_a_row_the_engine_refuses_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = [f"short text {i}" for i in range(40)]
    texts[27] = "x" * 300  # past --max-input-chars, with too few tokens there to cut it exactly
    source = write_corpus(tmp_path / "c.jsonl", [f"d{i}" for i in range(40)], texts)
    output = tmp_path / "out.parquet"
    line = refused(capsys, str(source), "-o", str(output), "--max-input-chars", "100")
    assert "row id='d27' (row 28): input has fewer than 254 tokens in the 100 characters" in line


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream", [_Terminal(), io.StringIO()])
def test_progress_bar_on_a_terminal_only(stream: io.StringIO) -> None:
    progress = Progress(1000, 100, stream=stream)
    progress.advance(50, 4000)
    totals = progress.close()
    assert (totals.rows, totals.tokens) == (50, 4000)
    shown = stream.getvalue()
    if not stream.isatty():
        assert shown == ""
        return
    assert "150/1000" in shown and "tokens/s" in shown and "row/s" in shown
    assert "<" in shown  # tqdm's elapsed<remaining: the ETA
    line = totals.summary()
    assert line.startswith("embedded 50 rows (4000 prompt tokens) in ")
    assert "rows/s" in line and "tokens/s" in line

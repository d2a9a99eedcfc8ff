"""`poolserve run-batch` as a real process: every line's answer is the server's.

References: sentence-transformers' embeddings and cosine similarities of the real MiniLM,
transformers' softmax of a tiny classifier, and the in-process server's own answers
(`AsyncPoolingEngine.request`) for the bodies it refuses.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer, util
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from poolserve.http.batches.lines import DROP_PIECE, LineError, LineReader, parse_line
from poolserve.offline import AsyncPoolingEngine
from tests.tiny_encoders import save_tiny_encoder

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD_LIMIT = 4096  # small, so one line of the mixed file is over it
HEX32 = re.compile(r"[0-9a-f]{32}")
KEYS = {"id", "custom_id", "response", "error"}
TEXTS = [
    "A man is eating food.",
    "A man is riding a horse.",
    "The new movie is awesome.",
    "The cat sits outside.",
    "A woman is playing the violin.",
]
QUERY = "Someone eats a meal."
# Bodies the server refuses, as raw text (sent unchanged): custom_id -> (url, body)
REFUSED = {
    "empty-input": ("/v1/embeddings", '{"input": []}'),
    "bad-format": ("/v1/embeddings", '{"input": "a", "encoding_format": 3}'),
    "dup-key": ("/v1/embeddings", '{"input": "a", "input": "b"}'),
}
# Lines that are no request: (line, custom_id written back, status, error param)
BAD = [
    (
        '{"custom_id": "cut", "method": "POST", "url": "/v1/embeddings", "body": {"inp',
        None,
        400,
        None,
    ),
    (
        '{"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": {}}',
        "chat",
        400,
        "url",
    ),
    (
        '{"custom_id": "get", "method": "GET", "url": "/v1/embeddings", "body": {}}',
        "get",
        400,
        "method",
    ),
    ("[1, 2]", None, 400, None),
]


def _line(custom_id: str, url: str, body: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    command = [sys.executable, "-m", "poolserve", "run-batch", *args]
    return subprocess.run(command, input=stdin, capture_output=True, cwd=ROOT, timeout=120)


def _order_inputs() -> list[list[str]]:
    """Each order line's texts: every fourth line a heavy one (tokenized in a worker thread, past
    the server's inline 1024 characters), the others one short text, so answers finish out of
    input order."""
    words = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "near", "bank")
    inputs = []
    for i in range(40):
        count = 8 if i % 4 == 0 else 1
        length = 70 if i % 4 == 0 else 1 + i % 11
        inputs.append([" ".join((words * 7)[j : j + length]) for j in range(count)])
    return inputs


def _mixed_lines() -> list[tuple[str, str | None]]:
    """(input line, custom_id of its output line; None for a blank line or an unreadable id)."""
    good = [
        _line("embed-float", "/v1/embeddings", {"input": TEXTS[:2]}),
        _line("embed-b64", "/v1/embeddings", {"input": [TEXTS[2]], "encoding_format": "base64"}),
        _line("pool", "/v1/pooling", {"input": TEXTS[3:], "task": "embed"}),
        _line("score", "/score", {"text_1": QUERY, "text_2": TEXTS}),
        _line("rerank", "/rerank", {"query": QUERY, "documents": TEXTS}),
    ]
    refused = [
        f'{{"custom_id": "{cid}", "method": "POST", "url": "{url}", "body": {body}}}'
        for cid, (url, body) in REFUSED.items()
    ]
    order = [
        _line(f"order-{i}", "/v1/embeddings", {"input": t}) for i, t in enumerate(_order_inputs())
    ]
    oversize = _line("oversize", "/v1/embeddings", {"input": "word " * PAYLOAD_LIMIT})
    return [
        *((line, json.loads(line)["custom_id"]) for line in good[:2]),
        ("", None),
        *((line, json.loads(line)["custom_id"]) for line in good[2:]),
        *((line, cid) for line, cid, _, _ in BAD),
        ("   ", None),
        *((line, json.loads(line)["custom_id"]) for line in refused),
        (oversize, None),
        *((line, json.loads(line)["custom_id"]) for line in order),
    ]


@pytest.fixture(scope="module")
def sentence_transformer(minilm_dir: Path) -> SentenceTransformer:
    return SentenceTransformer(str(minilm_dir), device="cpu")


def _assert_same_vectors(got: np.ndarray, want: np.ndarray) -> None:
    cosine = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert cosine.min() >= 0.9999
    np.testing.assert_allclose(got, want, atol=1e-5)


async def _server_answers(model: Path) -> dict[str, tuple[int, Any]]:
    """The in-process server's status and document for each refused body."""
    answers = {}
    async with AsyncPoolingEngine(str(model), payload_limit=PAYLOAD_LIMIT) as engine:
        for custom_id, (url, body) in REFUSED.items():
            reply = await engine.request("POST", url, body.encode())
            answers[custom_id] = (reply.status, json.loads(reply.body))
    return answers


def test_mixed_file_answers_each_line_as_the_server(
    tmp_path: Path, minilm_dir: Path, sentence_transformer: SentenceTransformer
) -> None:
    lines = _mixed_lines()
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(line for line, _ in lines) + "\n")
    target.write_text("an earlier run's answers\n")  # replaced, as --overwrite asks
    model = ("--model", str(minilm_dir), "--payload-limit", str(PAYLOAD_LIMIT))
    result = _run("-i", str(source), "-o", str(target), "--overwrite", *model)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]

    outputs = [json.loads(text) for text in target.read_text().splitlines()]
    sent = [custom_id for line, custom_id in lines if line.strip()]
    assert [o["custom_id"] for o in outputs] == sent  # one line per request line, in input order
    for output in outputs:
        assert set(output) == KEYS and set(output["response"]) == {
            "status_code",
            "request_id",
            "body",
        }
        assert re.fullmatch(r"batch-[0-9a-f]{32}", output["id"])
        assert HEX32.fullmatch(output["response"]["request_id"])
    by_id = {o["custom_id"]: o for o in outputs if o["custom_id"] is not None}

    _check_embeddings(by_id, sentence_transformer)
    _check_scores(by_id, sentence_transformer)
    _check_bad_lines(outputs, by_id)
    for custom_id, (status, document) in asyncio.run(_server_answers(minilm_dir)).items():
        answer = by_id[custom_id]
        assert (answer["response"]["status_code"], answer["response"]["body"]) == (status, None)
        assert answer["error"] == document
    succeeded = sum(200 <= o["response"]["status_code"] < 300 for o in outputs)
    assert succeeded == 5 + len(_order_inputs())
    summary = f"{len(outputs)} lines, {succeeded} succeeded, {len(outputs) - succeeded} failed"
    assert summary in result.stderr.decode()


def _body(answer: dict[str, Any]) -> dict[str, Any]:
    assert answer["response"]["status_code"] == 200 and answer["error"] is None
    body: dict[str, Any] = answer["response"]["body"]
    assert body["id"].endswith(answer["response"]["request_id"])  # the id the server answered
    return body


def _check_embeddings(by_id: dict[str | None, Any], model: SentenceTransformer) -> None:
    order = [text for texts in _order_inputs() for text in texts]
    want = model.encode(TEXTS + order, convert_to_numpy=True, batch_size=64)
    floats = [d["embedding"] for d in _body(by_id["embed-float"])["data"]]
    _assert_same_vectors(np.array(floats, dtype=np.float32), want[:2])
    (packed,) = [d["embedding"] for d in _body(by_id["embed-b64"])["data"]]
    _assert_same_vectors(np.frombuffer(base64.b64decode(packed), dtype="<f4")[None], want[2:3])
    pooled = [d["data"] for d in _body(by_id["pool"])["data"]]
    _assert_same_vectors(np.array(pooled, dtype=np.float32), want[3:5])
    ordered = [
        item["embedding"]
        for i in range(len(_order_inputs()))
        for item in _body(by_id[f"order-{i}"])["data"]
    ]
    _assert_same_vectors(np.array(ordered, dtype=np.float32), want[len(TEXTS) :])


def _check_scores(by_id: dict[str | None, Any], model: SentenceTransformer) -> None:
    """MiniLM is a bi-encoder: /score and /rerank are cosines of its embeddings."""
    query, documents = (
        model.encode([QUERY], convert_to_tensor=True),
        model.encode(TEXTS, convert_to_tensor=True),
    )
    want = util.cos_sim(query, documents)[0].numpy()
    scores = [d["score"] for d in _body(by_id["score"])["data"]]
    np.testing.assert_allclose(scores, want, atol=1e-5)
    results = _body(by_id["rerank"])["results"]
    assert [r["index"] for r in results] == np.argsort(-want, kind="stable").tolist()
    np.testing.assert_allclose(
        [r["relevance_score"] for r in results], np.sort(want)[::-1], atol=1e-5
    )


def _check_bad_lines(outputs: list[dict[str, Any]], by_id: dict[str | None, Any]) -> None:
    """Lines that are no request: error lines in the server's shape; the job went on."""
    unnamed = [o for o in outputs if o["custom_id"] is None]
    assert [o["response"]["status_code"] for o in unnamed] == [400, 400, 413]
    named = [(by_id[cid], status, param) for _, cid, status, param in BAD if cid is not None]
    for answer, status, param in [*named, *((o, 400, None) for o in unnamed[:2])]:
        assert (answer["response"]["status_code"], answer["response"]["body"]) == (status, None)
        assert set(answer["error"]) == {"error"}
        error = answer["error"]["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
        assert error["type"] == "invalid_request_error"
    assert unnamed[2]["error"]["error"]["code"] == "payload_too_large"


def test_classify_from_stdin_to_stdout(tmp_path: Path) -> None:
    directory = save_tiny_encoder("bert_cls", tmp_path / "bert_cls")
    texts = ["a fine day", "rain again today", "the river bank"]
    lines = [
        _line("c1", "/classify", {"input": texts[:2]}),
        _line("c2", "/v1/classify", {"input": texts[2]}),
    ]
    result = _run("-i", "-", "-o", "-", "--model", str(directory), stdin="\n".join(lines).encode())
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    outputs = [json.loads(text) for text in result.stdout.splitlines()]  # nothing else on stdout
    assert [o["custom_id"] for o in outputs] == ["c1", "c2"]
    probs = [d["probs"] for o in outputs for d in _body(o)["data"]]

    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    with torch.no_grad():
        want = [model(**tokenizer(t, return_tensors="pt")).logits.softmax(-1)[0] for t in texts]
    np.testing.assert_allclose(np.array(probs), torch.stack(want).numpy(), atol=1e-5)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing-input", "cannot read the input"),
        ("unwritable-output", "cannot write the output"),
        ("no-model", "the model failed to load"),
    ],
)
def test_job_that_cannot_run_exits_1_and_leaves_no_output(
    tmp_path: Path, case: str, message: str
) -> None:
    source, out = tmp_path / "in.jsonl", tmp_path / "out"
    source.write_text(_line("a", "/v1/embeddings", {"input": "a"}) + "\n")
    out.mkdir()
    target = out / "missing-folder" / "o.jsonl" if case == "unwritable-output" else out / "o.jsonl"
    args = [
        "-i",
        str(tmp_path / "nope.jsonl" if case == "missing-input" else source),
        "-o",
        str(target),
    ]
    model = str(tmp_path / "no-model") if case == "no-model" else str(tmp_path)
    result = _run(*args, "--model", model)
    stderr = result.stderr.decode()
    assert result.returncode == 1 and "Traceback" not in stderr
    assert f"poolserve run-batch: error: {message}" in stderr  # the style of every command
    assert list(out.iterdir()) == []


def test_existing_output_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(_line("a", "/v1/embeddings", {"input": "a"}) + "\n")
    target.write_text("not mine\n")
    result = _run("-i", str(source), "-o", str(target), "--model", str(tmp_path / "no-model"))
    assert result.returncode == 1
    assert result.stderr.decode().strip() == (
        f"poolserve run-batch: error: {target} already exists: nothing is overwritten "
        "(pass --overwrite to replace it)"
    )
    assert target.read_text() == "not mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_long_line_is_read_in_bounded_pieces() -> None:
    """A line above the limit is dropped piece by piece, never read whole; the next line is read."""

    sizes: list[int | None] = []

    class Recording(io.BytesIO):
        def readline(self, size: int | None = -1, /) -> bytes:
            sizes.append(size)
            return super().readline(size)

    limit = 100
    stream = Recording(b'{"a": 1}\n' + b"x" * (3 * DROP_PIECE) + b"\n\n" + b'{"b": 2}')
    reader = LineReader(stream, limit)
    assert reader.read(10, 10_000) == [(1, b'{"a": 1}'), (2, None), (4, b'{"b": 2}')]
    assert reader.read(10, 10_000) == []
    assert all(size is not None and 0 < size <= max(limit + 1, DROP_PIECE) for size in sizes)


def test_body_is_sent_as_the_line_holds_it() -> None:
    body = '{"text_1": "x",  "text_1": "y", "n": 1.50}'
    line = f'{{"custom_id": "a", "method": "POST", "url": "/score", "body":  {body} }}'
    request = parse_line(line.encode(), 1)
    assert (request.custom_id, request.url, request.body) == ("a", "/score", body.encode())


@pytest.mark.parametrize(
    ("line", "param", "code", "custom_id"),
    [
        (b'{"custom_id": "a", "custom_id": "b"}', None, "duplicate_key", None),
        (b'{"custom_id": "a", "url": "/score", "url": "/rerank"}', None, "duplicate_key", "a"),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/score"}',
            "body",
            "invalid_parameter",
            "a",
        ),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/score", "body": []}',
            "body",
            "invalid_parameter",
            "a",
        ),
        (
            b'{"custom_id": 1, "method": "POST", "url": "/score", "body": {}}',
            "custom_id",
            "invalid_parameter",
            None,
        ),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/pooling", "body": {"stream": true}}',
            "body.stream",
            "invalid_parameter",
            "a",
        ),
        (
            b'{"custom_id": "a", "method": "PUT", "url": "/score", "body": {}}',
            "method",
            "method_not_allowed",
            "a",
        ),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/embeddings", "body": {}}',
            "url",
            "unsupported_url",
            "a",
        ),
        (b'{"custom_id": "\xff"}', None, "invalid_request", None),
        (b'{"custom_id": "a"} x', None, "invalid_request", None),
    ],
)
def test_bad_lines_name_the_problem(
    line: bytes, param: str | None, code: str, custom_id: str | None
) -> None:
    with pytest.raises(LineError) as caught:
        parse_line(line, 7)
    error = caught.value
    assert (error.param, error.code, error.custom_id, error.status) == (param, code, custom_id, 400)
    assert json.loads(error.document())["error"]["param"] == param

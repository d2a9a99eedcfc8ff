"""OpenAI's Batch API (--batch-dir) through the `openai` client and plain HTTP, in process: the
lifecycle, outputs equal to the online answers on every endpoint family, validation, bounds,
cancel, expiry, tenants, and the priority batch lines run at."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from starlette.testclient import TestClient

from poolserve.http.batches import BATCH_PRIORITY
from tests.http.serving import queue_taken

FULL_QUEUE = 1024  # --max-num-queued-requests' default: held, every line waits for room
TEXTS = ["a cat sat on the mat", "stock markets fell sharply", "the weather is mild", "hello"]


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def _wait(client: openai.OpenAI, batch_id: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)


def _counted(served: TestClient) -> dict[str, float]:
    """The batch series of /metrics: `lines:OUTCOME` and `ended:STATUS`."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(served.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "poolserve_batch_lines_total":
                found[f"lines:{sample.labels['outcome']}"] = sample.value
            elif sample.name == "poolserve_batches_ended_total":
                found[f"ended:{sample.labels['status']}"] = sample.value
    return found


def _grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def served(
    make_client: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestClient]:
    """MiniLM with the Batch API, small bounds to test them."""
    folder = tmp_path_factory.mktemp("batches")
    with make_client(
        None, batch_dir=str(folder), max_batch_file_bytes=200_000, max_batch_requests=50
    ) as client:
        yield client


@pytest.fixture
def oai(served: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=served)


def _run(oai: openai.OpenAI, endpoint: str, lines: list[str], **options: Any) -> Any:
    uploaded = oai.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    created = oai.batches.create(
        input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", **options
    )
    assert created.status == "validating"
    return _wait(oai, created.id)


def test_the_openai_client_runs_a_batch_of_embeddings(
    served: TestClient, oai: openai.OpenAI
) -> None:
    lines = [
        _line(f"r{i}", "/v1/embeddings", {"model": "minilm", "input": [text, TEXTS[0]]})
        for i, text in enumerate(TEXTS)
    ]
    lines.append(_line("unknown-model", "/v1/embeddings", {"model": "nope", "input": "x"}))
    before = _counted(served)
    batch = _run(oai, "/v1/embeddings", lines, metadata={"job": "nightly"})
    assert batch.status == "completed"
    grown = _grown(before, _counted(served))
    assert grown == {"lines:completed": 4, "lines:failed": 1, "ended:completed": 1}
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (5, 4, 1)
    assert batch.metadata == {"job": "nightly"}
    assert batch.in_progress_at is not None and batch.completed_at is not None
    outputs = _lines(oai, batch.output_file_id)
    assert [o["custom_id"] for o in outputs] == ["r0", "r1", "r2", "r3"]  # input order
    tokens = 0
    for output, text in zip(outputs, TEXTS, strict=True):
        assert output["error"] is None and output["id"].startswith("batch_req_")
        response = output["response"]
        online = served.post("/v1/embeddings", json={"model": "minilm", "input": [text, TEXTS[0]]})
        assert response["status_code"] == 200
        got = [d["embedding"] for d in response["body"]["data"]]
        want = [d["embedding"] for d in online.json()["data"]]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        tokens += response["body"]["usage"]["prompt_tokens"]
    assert batch.usage is not None and batch.usage.input_tokens == tokens
    (failed,) = _lines(oai, batch.error_file_id)
    assert failed["custom_id"] == "unknown-model" and failed["error"] is None
    assert failed["response"]["status_code"] == 404
    assert failed["response"]["body"]["error"]["code"] == "model_not_found"
    # the output files are the caller's files, with OpenAI's purpose and names
    output_file = oai.files.retrieve(batch.output_file_id)
    assert output_file.purpose == "batch_output"
    assert output_file.filename == f"{batch.id}_output.jsonl"
    assert output_file.bytes == len(oai.files.content(batch.output_file_id).content)


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("/v1/score", {"model": "minilm", "text_1": TEXTS[0], "text_2": TEXTS[1:]}),
        ("/v1/rerank", {"model": "minilm", "query": TEXTS[0], "documents": TEXTS[1:]}),
        ("/v1/pooling", {"model": "minilm", "input": TEXTS, "task": "embed"}),
    ],
)
def test_each_endpoint_answers_as_online(
    served: TestClient, oai: openai.OpenAI, endpoint: str, body: dict[str, Any]
) -> None:
    batch = _run(oai, endpoint, [_line("only", endpoint, body)])
    assert batch.status == "completed", batch
    (output,) = _lines(oai, batch.output_file_id)
    online = served.post(endpoint, json=body).json()
    got = output["response"]["body"]
    assert _shape(got) == _shape(online)  # the same document, numbers aside
    np.testing.assert_allclose(_numbers(got), _numbers(online), rtol=0, atol=1e-6)


def _shape(document: object) -> object:
    """The document with its numbers zeroed and its per-request id and time left out."""
    if isinstance(document, dict):
        return {k: _shape(v) for k, v in document.items() if k not in ("id", "created")}
    if isinstance(document, list):
        return [_shape(item) for item in document]
    if isinstance(document, (int, float)) and not isinstance(document, bool):
        return 0
    return document


def _numbers(document: object) -> list[float]:
    """Every number of a document but its time, in order (the answers' floats and counts)."""
    if isinstance(document, dict):
        return [n for k in sorted(document) if k != "created" for n in _numbers(document[k])]
    if isinstance(document, list):
        return [n for item in document for n in _numbers(item)]
    if isinstance(document, (int, float)) and not isinstance(document, bool):
        return [float(document)]
    return []


def test_a_classify_batch_answers_as_online(
    make_client: Callable[..., Any], tmp_path: Path
) -> None:
    body = {"model": "llama_cls3", "input": TEXTS}
    with make_client("llama_cls3", batch_dir=str(tmp_path)) as served:
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=served)
        batch = _run(oai, "/v1/classify", [_line("c", "/v1/classify", body)])
        (output,) = _lines(oai, batch.output_file_id)
        online = served.post("/v1/classify", json=body).json()
    got = [d["probs"] for d in output["response"]["body"]["data"]]
    np.testing.assert_allclose(got, [d["probs"] for d in online["data"]], rtol=0, atol=1e-6)


def test_a_bad_input_file_fails_validation_with_each_line_named(oai: openai.OpenAI) -> None:
    good = {"model": "minilm", "input": "x"}
    lines = [
        _line("a", "/v1/embeddings", good),
        "{not json",
        _line("a", "/v1/embeddings", good),  # a duplicate custom_id
        _line("b", "/v1/score", {"text_1": "x", "text_2": "y"}),  # another endpoint
        json.dumps({"custom_id": "c", "method": "GET", "url": "/v1/embeddings", "body": good}),
        json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/embeddings"}),
    ]
    batch = _run(oai, "/v1/embeddings", lines)
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.output_file_id is None and batch.error_file_id is None
    faults = [(e.line, e.code) for e in batch.errors.data]
    assert faults == [
        (2, "invalid_request"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_endpoint"),
        (5, "method_not_allowed"),
        (6, "invalid_parameter"),
    ]


def test_too_many_requests_and_an_empty_file_fail(oai: openai.OpenAI) -> None:
    lines = [_line(f"r{i}", "/v1/embeddings", {"input": "x"}) for i in range(51)]
    batch = _run(oai, "/v1/embeddings", lines)
    assert batch.status == "failed"
    assert [e.code for e in batch.errors.data] == ["too_many_requests"]
    empty = oai.files.create(file=("empty.jsonl", b"\n\n"), purpose="batch")
    created = oai.batches.create(
        input_file_id=empty.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    assert [e.code for e in _wait(oai, created.id).errors.data] == ["empty_file"]


def test_uploads_are_bounded_and_checked(served: TestClient, oai: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as large:
        oai.files.create(file=("big.jsonl", b"x" * 200_001), purpose="batch")
    assert large.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="purpose"):
        oai.files.create(file=("a.jsonl", b"{}"), purpose="fine-tune")
    refused = {
        "not a form": served.post("/v1/files", json={"purpose": "batch"}),
        "no file": served.post("/v1/files", files={"purpose": (None, "batch")}),
        "unknown field": served.post(
            "/v1/files", files={"purpose": (None, "batch"), "x": (None, "1"), "file": b"{}"}
        ),
        "bad expiry": served.post(
            "/v1/files",
            files={
                "purpose": (None, "batch"),
                "expires_after[anchor]": (None, "created_at"),
                "expires_after[seconds]": (None, "60"),
                "file": b"{}",
            },
        ),
    }
    for why, answer in refused.items():
        assert answer.status_code == 400, (why, answer.text)
        assert answer.json()["error"]["type"] == "invalid_request_error", why
    kept = oai.files.create(
        file=("a.jsonl", b"{}"),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert kept.expires_at == kept.created_at + 3600


def test_unknown_and_malformed_ids_are_404(served: TestClient, oai: openai.OpenAI) -> None:
    for path in (
        "/v1/files/file-00000000000000000000000000000000",
        "/v1/files/..%2F..%2Fetc%2Fpasswd/content",
        "/v1/batches/batch_00000000000000000000000000000000",
        "/v1/batches/batch_..%2F..%2Ffiles",
    ):
        assert served.get(path).status_code == 404, path
    with pytest.raises(openai.NotFoundError):
        oai.batches.create(
            input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h"
        )


def test_batch_create_checks_its_fields(oai: openai.OpenAI) -> None:
    uploaded = oai.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
    bad: list[dict[str, Any]] = [
        {"endpoint": "/v1/chat/completions", "completion_window": "24h"},
        {"endpoint": "/v1/embeddings", "completion_window": "tomorrow"},
        {"endpoint": "/v1/embeddings", "completion_window": "31d"},
        {"endpoint": "/v1/embeddings", "completion_window": "24h", "metadata": {"k" * 65: "v"}},
    ]
    for fields in bad:
        with pytest.raises(openai.BadRequestError):
            oai.batches.create(input_file_id=uploaded.id, **fields)


def test_listing_pages_newest_first(served: TestClient, oai: openai.OpenAI) -> None:
    uploaded = oai.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
    made = [
        oai.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        ).id
        for _ in range(3)
    ]
    first = oai.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    second = oai.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == made[0]
    assert [f.id for f in oai.files.list(purpose="batch", order="asc").data][-1] == uploaded.id
    assert oai.files.list(purpose="batch").data[0].id == uploaded.id
    for batch_id in made:
        _wait(oai, batch_id)
    assert oai.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(uploaded.id)


def test_the_input_of_a_running_batch_is_kept(served: TestClient, oai: openai.OpenAI) -> None:
    line = _line("r", "/v1/embeddings", {"input": "x"})
    uploaded = oai.files.create(file=("in.jsonl", _jsonl([line])), purpose="batch")
    with queue_taken(served, requests=FULL_QUEUE, tokens=0):
        created = oai.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        with pytest.raises(openai.BadRequestError, match="has not ended"):
            oai.files.delete(uploaded.id)
    assert _wait(oai, created.id).status == "completed"
    assert oai.files.delete(uploaded.id).deleted


def test_a_cancelled_batch_stops_and_says_so(served: TestClient, oai: openai.OpenAI) -> None:
    lines = [_line(f"r{i}", "/v1/embeddings", {"input": TEXTS[i % 4]}) for i in range(8)]
    uploaded = oai.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    with queue_taken(served, requests=FULL_QUEUE, tokens=0):
        created = oai.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        _until(lambda: oai.batches.retrieve(created.id).status == "in_progress")
        asked = oai.batches.cancel(created.id)
        assert asked.status == "cancelling" and asked.cancelling_at is not None
        batch = _wait(oai, created.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert batch.request_counts.completed == 0 and batch.output_file_id is None
    assert oai.batches.cancel(created.id).status == "cancelled"  # cancelling again: as it is


def test_a_batch_past_its_window_expires_line_by_line(
    served: TestClient, oai: openai.OpenAI
) -> None:
    lines = [_line(f"r{i}", "/v1/embeddings", {"input": TEXTS[i % 4]}) for i in range(5)]
    uploaded = oai.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    before = _counted(served)
    with queue_taken(served, requests=FULL_QUEUE, tokens=0):
        created = oai.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="2s"
        )
        batch = _wait(oai, created.id)
    assert batch.status == "expired" and batch.expired_at is not None
    assert _grown(before, _counted(served)) == {"lines:failed": 5, "ended:expired": 1}
    assert (batch.request_counts.total, batch.request_counts.failed) == (5, 5)
    expired = _lines(oai, batch.error_file_id)
    assert [line["custom_id"] for line in expired] == [f"r{i}" for i in range(5)]
    assert {line["error"]["code"] for line in expired} == {"batch_expired"}
    assert all(line["response"] is None for line in expired)


def _until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_batch_lines_run_behind_interactive_requests(
    served: TestClient, oai: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    import poolserve.http.calls as calls

    priorities: list[int] = []
    real = calls.submit_job

    async def noted(state: Any, job: Any, caller: Any) -> Any:
        priorities.append(job.priority)
        return await real(state, job, caller)

    monkeypatch.setattr(calls, "submit_job", noted)
    served.post("/v1/embeddings", json={"input": "interactive", "priority": 5})
    batch = _run(oai, "/v1/embeddings", [_line("b", "/v1/embeddings", {"input": "x"})])
    assert batch.status == "completed"
    assert priorities == [5, BATCH_PRIORITY]


def test_without_a_batch_dir_the_routes_say_how_to_have_them(
    make_client: Callable[..., Any],
) -> None:
    with make_client(None) as client:
        answer = client.get("/v1/batches")
        assert answer.status_code == 404
        assert "--batch-dir" in answer.json()["error"]["message"]


KEYS = """
keys:
  - {name: alpha, key: key-a}
  - {name: beta, key: key-b, models: [other-model]}
"""


def test_each_key_sees_only_its_own_files_and_batches(
    make_client: Callable[..., Any], tmp_path: Path
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)
    folder = tmp_path / "batches"
    with make_client(None, batch_dir=str(folder), api_keys_file=str(keys)) as served:

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=served)

        alpha, beta = client("key-a"), client("key-b")
        line = _line("r", "/v1/embeddings", {"input": "x"})
        mine = alpha.files.create(file=("in.jsonl", _jsonl([line])), purpose="batch")
        batch = alpha.batches.create(
            input_file_id=mine.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        with pytest.raises(openai.NotFoundError):
            beta.files.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            beta.files.content(mine.id)
        with pytest.raises(openai.NotFoundError):
            beta.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            beta.batches.cancel(batch.id)
        with pytest.raises(openai.NotFoundError):  # another key's file is no input either
            beta.batches.create(
                input_file_id=mine.id, endpoint="/v1/embeddings", completion_window="24h"
            )
        assert beta.batches.list().data == [] and beta.files.list().data == []
        assert _wait(alpha, batch.id).request_counts.completed == 1
        with pytest.raises(openai.AuthenticationError):
            client("wrong").batches.list()
        # a batch line is held to its owner's models: beta may not use MiniLM
        theirs = beta.files.create(file=("in.jsonl", _jsonl([line])), purpose="batch")
        refused = beta.batches.create(
            input_file_id=theirs.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        ended = _wait(beta, refused.id)
        (error,) = _lines(beta, ended.error_file_id)
        assert error["response"]["status_code"] == 403
        assert error["response"]["body"]["error"]["code"] == "model_not_allowed"

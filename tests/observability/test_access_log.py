"""The access log: one line per request with its fields, the switch, the JSON log format."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from poolserve.config.flags import parse_settings
from poolserve.observability.logs import (
    ACCESS_LOGGER,
    FIELDS_ATTR,
    JSONFormatter,
    configure_logging,
)
from tests.tiny_models import MINILM_DIR

TEXTS = ["an access log line per request", "with its prompt tokens"]
KEYS = {
    "method",
    "path",
    "route",
    "status",
    "duration_ms",
    "model",
    "prompt_tokens",
    "request_id",
    "client",
    "trace_id",
}


@pytest.fixture(scope="module")
def client(make_client: Callable[..., Any]) -> Iterator[TestClient]:
    with make_client(None) as started:
        yield started


def _access(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ACCESS_LOGGER]


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields: dict[str, Any] = getattr(record, FIELDS_ATTR)
    return fields


def test_an_inference_request_is_logged_with_its_fields(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(MINILM_DIR)
    want_tokens = sum(len(ids) for ids in tokenizer(TEXTS)["input_ids"])
    with caplog.at_level(logging.DEBUG, ACCESS_LOGGER):
        response = client.post(
            "/v1/embeddings", json={"input": TEXTS}, headers={"x-request-id": "req-42"}
        )
    assert response.status_code == 200
    (record,) = _access(caplog)
    fields = _fields(record)
    assert fields.keys() == KEYS
    assert record.levelno == logging.INFO
    assert fields["method"] == "POST"
    assert fields["path"] == fields["route"] == "/v1/embeddings"
    assert fields["status"] == 200
    assert fields["prompt_tokens"] == want_tokens == response.json()["usage"]["prompt_tokens"]
    assert fields["request_id"] == "req-42" == response.headers["x-request-id"]
    assert fields["client"] == "testclient"  # the ASGI client address TestClient reports
    assert fields["trace_id"] is None  # tracing is off
    assert fields["duration_ms"] > 0
    assert fields["model"] == "minilm"  # the served name the request was routed to
    message = record.getMessage()
    assert message.startswith("POST /v1/embeddings 200 ")
    assert f"model=minilm prompt_tokens={want_tokens} request_id=req-42" in message


def test_refusals_unmatched_paths_and_probes(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, ACCESS_LOGGER):
        bad = client.post("/v1/embeddings", json={"input": []})
        missing = client.get("/no/such%0Apath")  # a decoded newline must not break the line
        health = client.get("/health")
    assert (bad.status_code, missing.status_code, health.status_code) == (400, 404, 200)
    refused, unmatched, probe = _access(caplog)
    assert _fields(refused)["status"] == 400
    assert _fields(refused)["prompt_tokens"] is None  # nothing was tokenized
    assert _fields(refused)["model"] == "minilm"  # refused after routing
    assert _fields(unmatched)["model"] is None and "model=- " in unmatched.getMessage()
    assert _fields(refused)["request_id"] == bad.headers["x-request-id"]  # a generated one
    assert _fields(unmatched)["route"] == "unmatched"
    assert _fields(unmatched)["path"] == "/no/such%0Apath"
    assert "\n" not in unmatched.getMessage()
    assert _fields(probe)["route"] == "/health"
    assert probe.levelno == logging.DEBUG  # probes and scrapes stay out of an INFO log


def test_the_access_log_can_be_switched_off(
    make_client: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    with make_client(None, access_log=False) as quiet, caplog.at_level(logging.DEBUG):
        assert quiet.post("/v1/embeddings", json={"input": "x"}).status_code == 200
    assert not _access(caplog)


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = parse_settings(["serve"])
    assert (defaults.access_log, defaults.log_format) == (True, "text")
    flags = parse_settings(["serve", "--no-access-log", "--log-format", "json"])
    assert (flags.access_log, flags.log_format) == (False, "json")
    monkeypatch.setenv("POOLSERVE_ACCESS_LOG", "false")
    monkeypatch.setenv("POOLSERVE_LOG_FORMAT", "json")
    from_env = parse_settings(["serve"])
    assert (from_env.access_log, from_env.log_format) == (False, "json")
    assert parse_settings(["serve", "--access-log"]).access_log is True


def test_json_lines_carry_stable_keys_and_exceptions() -> None:
    formatter = JSONFormatter()
    access = logging.LogRecord(ACCESS_LOGGER, logging.INFO, __file__, 1, "%s", ("GET / 200",), None)
    setattr(access, FIELDS_ATTR, {"status": 200, "request_id": "r"})
    line = formatter.format(access)
    parsed = orjson.loads(line)
    assert parsed["message"] == "GET / 200"
    assert (parsed["level"], parsed["logger"]) == ("INFO", ACCESS_LOGGER)
    assert (parsed["status"], parsed["request_id"]) == (200, "r")
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = formatter.format(failed)
    assert "\n" not in line  # one object per line, tracebacks included
    parsed = orjson.loads(line)
    assert "ValueError: boom" in parsed["exception"]
    assert parsed.keys() >= {"time", "level", "logger", "message"}


def test_configure_logging_puts_one_handler_on_the_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    configure_logging("warning", "json")
    (handler,) = root.handlers
    assert isinstance(handler.formatter, JSONFormatter)
    assert root.level == logging.WARNING
    configure_logging("info", "text")
    (handler,) = root.handlers
    assert not isinstance(handler.formatter, JSONFormatter)
    logging.captureWarnings(False)

"""Batch request lines, for `poolserve run-batch` and the online Batch API: bounded reading, the
request a line holds, the line written back.

A line is OpenAI's batch request, `{"custom_id", "method", "url", "body"}`. Its body is sent as
the exact text the line holds (found by scanning the line's top-level object), so the server sees
what a client would have sent, duplicate keys included. Output lines are assembled around the
server's answer bytes without parsing them again: vLLM's `BatchRequestOutput` for run-batch (an
error document under `error`), OpenAI's batch output for the Batch API (the answer under
`response.body` whatever its status; `error` only for a request that got no answer).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import orjson

from poolserve.http.errors import error_document
from poolserve.types.errors import clip

# The routes a line may name: vLLM's run-batch families (embeddings, score, rerank), at every path
# the server serves them, plus pooling and classify, which vLLM's run-batch does not take.
URLS = frozenset(
    {
        "/v1/embeddings",
        "/pooling",
        "/v1/pooling",
        "/classify",
        "/v1/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    }
)
# field -> (its type, the type's name in an error)
FIELDS: dict[str, tuple[type, str]] = {
    "custom_id": (str, "a string"),
    "method": (str, "a string"),
    "url": (str, "a string"),
    "body": (dict, "an object"),
}
# An oversize line is read and dropped in pieces of this many bytes.
DROP_PIECE = 1 << 20
_DECODER = json.JSONDecoder()
# the C string scanner json.loads uses (typeshed does not declare it)
_SCAN_STRING: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_SPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class BatchRequest:
    """One line's request: where it goes and the body text it sends."""

    custom_id: str
    url: str
    body: bytes


class LineError(Exception):
    """A line that is no request: answered by an error line, never sent to the server."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str = "invalid_request",
        status: int = 400,
        custom_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.status, self.custom_id = status, custom_id

    def document(self) -> bytes:
        """The error in the server's OpenAI shape."""
        return orjson.dumps(
            error_document(self.message, "invalid_request_error", self.param, self.code)
        )


class LineReader:
    """Lines of a binary stream, numbered from 1; a line above `limit` bytes is never held whole."""

    def __init__(self, stream: BinaryIO, limit: int) -> None:
        self.stream = stream
        self.limit = limit
        self.number = 0

    def read(self, most_lines: int, most_bytes: int) -> list[tuple[int, bytes | None]]:
        """The next non-blank lines, `(number, text)`, `None` for a line above the limit; [] at end.

        Stops after `most_lines` lines or once `most_bytes` are held (one line at least).
        """
        lines: list[tuple[int, bytes | None]] = []
        held = 0
        while len(lines) < most_lines and held < most_bytes:
            line = self.stream.readline(self.limit + 1)
            if not line:
                break
            self.number += 1
            if len(line) > self.limit and not line.endswith(b"\n"):
                self._drop_rest()
                lines.append((self.number, None))
                continue
            line = line.strip()
            if line:
                lines.append((self.number, line))
                held += len(line)
        return lines

    def _drop_rest(self) -> None:
        """Read the rest of an oversize line in bounded pieces and forget it."""
        while (piece := self.stream.readline(DROP_PIECE)) and not piece.endswith(b"\n"):
            pass


def parse_line(line: bytes, number: int) -> BatchRequest:
    """The request one line holds; `LineError` names the first thing wrong with it."""
    try:
        members = _members(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise LineError(f"line {number} is not a JSON document") from None
    if members is None:
        raise LineError(f"line {number} is not a JSON object")
    found: dict[str, tuple[Any, str]] = {}
    repeated = None
    for key, value, text in members:
        repeated = key if key in found and repeated is None else repeated
        found.setdefault(key, (value, text))
    custom_id = found.get("custom_id", (None,))[0]
    custom_id = custom_id if isinstance(custom_id, str) and repeated != "custom_id" else None
    if repeated is not None:
        message = f"duplicate key {clip(repeated)!r} in line {number}"
        raise LineError(message, code="duplicate_key", custom_id=custom_id)
    for field, (kind, kind_name) in FIELDS.items():
        if field not in found:
            raise _bad(f"line {number} has no {field!r}", field, custom_id)
        if not isinstance(found[field][0], kind):
            raise _bad(f"line {number}: {field!r} must be {kind_name}", field, custom_id)
    method, url = found["method"][0], found["url"][0]
    if method != "POST":
        message = f"line {number}: method {clip(method)!r} is not supported: only POST is"
        raise _bad(message, "method", custom_id, "method_not_allowed")
    if url not in URLS:
        message = (
            f"line {number}: url {clip(url)!r} is not supported: one of {', '.join(sorted(URLS))}"
        )
        raise _bad(message, "url", custom_id, "unsupported_url")
    if found["body"][0].get("stream") is True:  # one JSON document per answer, never a stream
        message = f"line {number}: a batch request can't be streamed"
        raise _bad(message, "body.stream", custom_id)
    return BatchRequest(found["custom_id"][0], url, found["body"][1].encode())


def _bad(
    message: str, param: str, custom_id: str | None, code: str = "invalid_parameter"
) -> LineError:
    return LineError(message, param, code, custom_id=custom_id)


def too_long(number: int, limit: int) -> LineError:
    """The error of a line above the server's body limit (413, as the server answers that body)."""
    message = f"line {number} is longer than the {limit} bytes a request body may have"
    return LineError(message, code="payload_too_large", status=413)


def _members(text: str) -> list[tuple[str, Any, str]] | None:
    """`(key, value, value's text)` of a JSON object's members in order; None for another value.

    Malformed JSON raises ValueError (json.JSONDecodeError), as `json.loads` would.
    """
    pos = _skip(text, 0)
    if text[pos : pos + 1] != "{":
        json.loads(text)  # raises for malformed JSON; well-formed, it is another kind of value
        return None
    members: list[tuple[str, Any, str]] = []
    pos = _skip(text, pos + 1)
    closed = text[pos : pos + 1] == "}"
    pos += closed
    while not closed:
        if text[pos : pos + 1] != '"':
            raise json.JSONDecodeError("Expecting property name", text, pos)
        key, pos = _SCAN_STRING(text, pos + 1)
        pos = _skip(text, pos)
        if text[pos : pos + 1] != ":":
            raise json.JSONDecodeError("Expecting ':' delimiter", text, pos)
        start = _skip(text, pos + 1)
        value, pos = _DECODER.raw_decode(text, start)
        members.append((key, value, text[start:pos]))
        pos = _skip(text, pos)
        delimiter = text[pos : pos + 1]
        if delimiter not in (",", "}"):
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
        closed = delimiter == "}"
        pos = _skip(text, pos + 1)
    if pos != len(text):
        raise json.JSONDecodeError("Extra data", text, pos)
    return members


def _skip(text: str, pos: int) -> int:
    """The position after the JSON whitespace at `pos`."""
    match = _SPACE.match(text, pos)
    return pos if match is None else match.end()


def output_line(
    custom_id: str | None,
    status: int,
    request_id: str,
    body: bytes | None = None,
    error: bytes | None = None,
) -> bytes:
    """vLLM's `BatchRequestOutput` as one line, every key present; body and error are JSON."""
    return b"".join(
        (
            b'{"id":"batch-',
            uuid.uuid4().hex.encode(),
            b'","custom_id":',
            orjson.dumps(custom_id),
            b',"response":{"status_code":',
            str(status).encode(),
            b',"request_id":',
            orjson.dumps(request_id),
            b',"body":',
            b"null" if body is None else body,
            b'},"error":',
            b"null" if error is None else error,
            b"}\n",
        )
    )


def internal_error_line(custom_id: str) -> bytes:
    """The output line of a request the app failed on: the server's own 500 document."""
    error = error_document("internal server error", "internal_error", None, "internal_error")
    return output_line(custom_id, 500, uuid.uuid4().hex, error=orjson.dumps(error))


def error_line(error: LineError) -> bytes:
    """The output line of a line that was never sent (a request id of the server's form)."""
    return output_line(error.custom_id, error.status, uuid.uuid4().hex, error=error.document())


def answer_line(custom_id: str, status: int, headers: Mapping[str, str], body: bytes) -> bytes:
    """The output line of a request the server answered: its document in `body` or `error`."""
    request_id = headers.get("x-request-id") or uuid.uuid4().hex
    document = answer_document(headers, body)
    if document is None:
        # no route of URLS answers anything else: a guard, so a line is always one JSON document
        message = f"the server answered {clip(headers.get('content-type', 'nothing'))}"
        error = error_document(message, "internal_error", None, "not_json")
        return output_line(custom_id, status, request_id, error=orjson.dumps(error))
    if 200 <= status < 300:
        return output_line(custom_id, status, request_id, body=document)
    return output_line(custom_id, status, request_id, error=document)


def answer_document(headers: Mapping[str, str], body: bytes) -> bytes | None:
    """The answer's JSON document, or None when the server answered something else."""
    document = body.strip()
    if not headers.get("content-type", "").startswith("application/json") or not document:
        return None
    return document


def openai_line(custom_id: str, status: int, request_id: str, document: bytes) -> bytes:
    """OpenAI's output line of an answered request: the answer, error or not, as the body."""
    return b"".join(
        (
            b'{"id":"batch_req_',
            uuid.uuid4().hex.encode(),
            b'","custom_id":',
            orjson.dumps(custom_id),
            b',"response":{"status_code":',
            str(status).encode(),
            b',"request_id":',
            orjson.dumps(request_id),
            b',"body":',
            document,
            b'},"error":null}\n',
        )
    )


def unanswered_line(custom_id: str | None, code: str, message: str) -> bytes:
    """OpenAI's output line of a request that got no answer (`batch_expired`, a failure)."""
    line = {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return orjson.dumps(line) + b"\n"

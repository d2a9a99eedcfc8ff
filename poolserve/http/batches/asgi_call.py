"""One batch line answered by the app of this process, as an HTTP request would be.

The request is handed to the app's ASGI callable directly (no socket, no HTTP client): the scope
carries `BATCH_LINE`, which only a caller in this process can set, and the answer is gathered
from what the app sends.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

from poolserve.http.batches import BATCH_LINE
from poolserve.observability.logs import PROMPT_TOKENS_KEY


@dataclass(frozen=True)
class LineAnswer:
    """The app's answer to one line: status, headers (lower-case names), body, the request id
    the edge gave it, its prompt tokens."""

    status: int
    headers: dict[str, str]
    body: bytes
    request_id: str
    prompt_tokens: int


async def call_app(app: ASGIApp, path: str, body: bytes, owner: str | None) -> LineAnswer:
    """POST `body` (JSON) to `path` as a batch line of `owner`'s."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"poolserve"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": None,
        "server": None,
        "extensions": {BATCH_LINE: owner},
        "state": {},
    }
    sent = False
    never = asyncio.Event()  # the line's "connection" never closes: it waits for its answer
    status = 500
    headers: dict[str, str] = {}
    pieces: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            for name, value in message.get("headers", ()):
                headers[name.decode("latin-1").lower()] = value.decode("latin-1")
        elif message["type"] == "http.response.body":
            pieces.append(message.get("body", b""))

    await app(scope, receive, send)
    noted = scope["state"]
    tokens = noted.get(PROMPT_TOKENS_KEY, 0)
    return LineAnswer(
        status,
        headers,
        b"".join(pieces),
        str(noted.get("request_id", "")),
        tokens if isinstance(tokens, int) else 0,
    )

"""Pure-ASGI edge: auth, payload limit (streamed, never buffered), request id, metrics."""

from __future__ import annotations

import hmac
import time
import uuid
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import AuthenticationError, PayloadTooLargeError, response_for
from service.state import ServiceState

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


class _BodyTooLarge(HTTPException):
    """Raised from receive() once the body passes the limit (the app renders it as 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            413, f"request body is larger than the limit of {limit} bytes (--payload-limit)"
        )


class EdgeMiddleware:
    """Everything a request meets before its route, and the accounting after it."""

    def __init__(self, app: ASGIApp, *, state: ServiceState) -> None:
        self.app = app
        self.state = state
        api_key = state.settings.api_key
        self.api_key = api_key.encode() if api_key else None
        self.payload_limit = state.settings.payload_limit
        self.metrics = state.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        status = {"code": 500, "started": False}

        async def send_wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                ]
            await send(message)

        counted = scope["path"] not in OPEN_PATHS
        self.state.active_requests += counted
        try:
            self._check_auth(scope["path"], headers)
            self._check_declared_length(headers)
            await self.app(scope, self._limited(receive), send_wrapped)
        except (AuthenticationError, PayloadTooLargeError) as exc:
            await response_for(exc)(scope, receive, send_wrapped)
        except _BodyTooLarge:
            if not status["started"]:
                await response_for(self._too_large())(scope, receive, send_wrapped)
        finally:
            self.state.active_requests -= counted
            self._record(scope, int(status["code"]), time.perf_counter() - start)

    def _check_auth(self, path: str, headers: dict[str, str]) -> None:
        if self.api_key is None or path in OPEN_PATHS:
            return
        given = headers.get("authorization", "")
        token = given[7:].strip() if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key):
            raise AuthenticationError("missing or invalid API key (send Authorization: Bearer KEY)")

    def _too_large(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(
            f"request body is larger than the limit of {self.payload_limit} bytes (--payload-limit)"
        )

    def _check_declared_length(self, headers: dict[str, str]) -> None:
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.payload_limit:
            raise self._too_large()

    def _limited(self, receive: Receive) -> Receive:
        """Count body bytes as they arrive and stop at the limit."""
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.payload_limit:
                    raise _BodyTooLarge(self.payload_limit)
            return message

        return limited

    def _record(self, scope: Scope, status: int, duration_s: float) -> None:
        route: Any = scope.get("route")
        endpoint = getattr(route, "path", None) or "unmatched"
        task = str(scope.get("state", {}).get("task", "none"))
        self.metrics.requests.labels(endpoint, task, str(status)).inc()
        self.metrics.request_duration.labels(endpoint).observe(duration_s)

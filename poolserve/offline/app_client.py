"""Raw HTTP answers in process: the server's app on the Python API's started front end.

Only `AsyncPoolingEngine.request` needs the app (run-batch replays request bodies through it),
so FastAPI and httpx are imported when it first opens one, never by the engine's own calls. The
app is built on the engine's state, already started: its lifespan runs only the app's own parts
(the keys file, the batch runner), the models and the engine core are started once.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from poolserve.frontend.state import ServiceState
from poolserve.offline.outputs import Reply

if TYPE_CHECKING:
    import httpx

# What `request` sends: the body's bytes or text as they are, or a JSON document to encode.
RequestBody = bytes | str | Mapping[str, Any] | None
BASE_URL = "http://poolserve"


@dataclass(frozen=True)
class AppClient:
    """The app of a started state, reached through httpx's ASGI transport (no socket)."""

    client: httpx.AsyncClient
    lifespan: contextlib.AbstractAsyncContextManager[Any]

    @classmethod
    async def open(cls, state: ServiceState) -> AppClient:
        """The app on `state`, its own start-up run; requests carry the --api-key when set."""
        import httpx

        from poolserve.http.app import create_app

        app = create_app(state.settings, state=state)
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        headers = {}
        if state.settings.api_key is not None:
            headers["authorization"] = f"Bearer {state.settings.api_key}"
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url=BASE_URL, headers=headers, timeout=None
        )
        return cls(client, lifespan)

    async def request(
        self, method: str, path: str, body: RequestBody, headers: dict[str, str] | None
    ) -> Reply:
        """One request answered by the app, exactly as it would be over a socket."""
        sent = {"content-type": "application/json", **(headers or {})}
        response = await self.client.request(method, path, content=_content(body), headers=sent)
        return Reply(response.status_code, dict(response.headers), response.content)

    async def close(self) -> None:
        """Close the client, then the app's own parts (its batch runner stops)."""
        await self.client.aclose()
        await self.lifespan.__aexit__(None, None, None)


def _content(body: RequestBody) -> bytes | str | None:
    """A request's body as sent: a mapping as its JSON (so callers need not encode it)."""
    if body is None or isinstance(body, bytes | str):
        return body
    if isinstance(body, Mapping):
        return json.dumps(body).encode()
    raise TypeError(f"body must be bytes, str or a dict, not {type(body).__name__}")

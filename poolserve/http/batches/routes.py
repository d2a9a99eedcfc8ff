"""OpenAI's Files and Batches routes, in OpenAI's shapes (read from the `openai` client's types):
`/v1/files` (upload, list, retrieve, delete, content) and `/v1/batches` (create, list,
retrieve, cancel). Each answers only for the API key name that made the object."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Query, Request
from pydantic import Field, StrictStr
from starlette.responses import FileResponse, Response

from poolserve.config.settings import ServerSettings
from poolserve.frontend.encoding import dumps
from poolserve.http.batches import MULTIPART_ROOM, UPLOAD_PATH
from poolserve.http.batches.runner import BatchRunner
from poolserve.http.batches.store import (
    ENDED,
    BatchRecord,
    BatchStore,
    FileRecord,
    Purpose,
    Status,
    new_batch_id,
)
from poolserve.http.batches.upload import EXPIRES_SECONDS, Limits, receive_file, storage_full
from poolserve.http.bodies import RequestBody
from poolserve.http.routing import StrictJSONRoute
from poolserve.observability.logs import API_KEY_NAME_KEY
from poolserve.types.errors import InvalidRequestError, NotFoundError, clip

router = APIRouter(route_class=StrictJSONRoute)

# The routes a batch may run (`endpoint`; every line's `url` must be the same).
ENDPOINTS = ("/v1/embeddings", "/v1/score", "/v1/rerank", "/v1/classify", "/v1/pooling")
WINDOW = re.compile(r"([1-9][0-9]{0,6})([smhd])")  # OpenAI's "24h", and shorter or longer ones
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
WINDOW_S = (1, 30 * 86400)
MOST_OPEN_BATCHES = 1000  # batches not ended, every key's together
OFF = "the Batch API is not served: start the server with --batch-dir DIR"
# What the schema says of each route's errors beyond the edge's (handlers.py adds the bodies).
MISSING: dict[str, Any] = {"description": "No such file or batch for this key, or no --batch-dir."}
ANSWERS: dict[int | str, dict[str, Any]] = {400: {}, 404: MISSING}
UPLOAD_FORM = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                        "expires_after[seconds]": {"type": "integer"},
                    },
                }
            }
        },
    }
}
T = TypeVar("T")


@dataclass(frozen=True)
class Batches:
    """The Batch API of one front end: its store, its runner, its limits."""

    store: BatchStore
    runner: BatchRunner
    settings: ServerSettings


def _batches(request: Request) -> Batches:
    found: Batches | None = request.app.state.batches
    if found is None:
        raise NotFoundError(OFF, None, "batch_api_off")
    return found


def _owner(request: Request) -> str | None:
    owner = request.scope.get("state", {}).get(API_KEY_NAME_KEY)
    return owner if isinstance(owner, str) else None


def _json(document: object, status: int = 200) -> Response:
    return Response(dumps(document), status_code=status, media_type="application/json")


def _listed(data: list[dict[str, object]], has_more: bool) -> Response:
    return _json(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


def _page(items: list[T], ids: list[str], after: str | None, limit: int) -> tuple[list[T], bool]:
    """The page after the item `after` (an id not among them: from the start)."""
    start = ids.index(after) + 1 if after in ids else 0
    page = items[start : start + limit]
    return page, start + limit < len(items)


# files


@router.post(UPLOAD_PATH, responses=ANSWERS, openapi_extra=UPLOAD_FORM)
async def create_file(request: Request) -> Response:
    """OpenAI's upload: a multipart form streamed into --batch-dir."""
    batches = _batches(request)
    store, settings = batches.store, batches.settings
    room = settings.max_batch_storage_bytes - await asyncio.to_thread(store.stored_bytes)
    declared = request.headers.get("content-length", "")
    if room <= 0 or (declared.isdigit() and int(declared) - MULTIPART_ROOM > room):
        raise storage_full(room)
    limits = Limits(settings.max_batch_file_bytes, room)
    content_type = request.headers.get("content-type", "")
    record = await receive_file(content_type, request.stream(), store, limits, _owner(request))
    return _json(record.public())


@router.get("/v1/files", responses=ANSWERS)
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> Response:
    """The caller's files, newest first unless `order=asc` (OpenAI's cursor pagination)."""
    store = _batches(request).store
    files = await asyncio.to_thread(store.files, _owner(request), time.time())
    if purpose is not None:
        files = [f for f in files if f.purpose.value == purpose]
    if order == "desc":
        files.reverse()
    page, more = _page(files, [f.id for f in files], after, limit)
    return _listed([f.public() for f in page], more)


async def _file(request: Request, file_id: str) -> tuple[BatchStore, FileRecord]:
    store = _batches(request).store
    record = await asyncio.to_thread(store.file, file_id, _owner(request), time.time())
    if record is None:
        raise NotFoundError(f"no file {clip(file_id)!r}", "file_id")
    return store, record


@router.get("/v1/files/{file_id}", responses=ANSWERS)
async def retrieve_file(request: Request, file_id: str) -> Response:
    """One file's record."""
    _, record = await _file(request, file_id)
    return _json(record.public())


@router.delete("/v1/files/{file_id}", responses=ANSWERS)
async def delete_file(request: Request, file_id: str) -> Response:
    """Delete a file, unless a batch that has not ended reads it."""
    store, record = await _file(request, file_id)
    reading = await asyncio.to_thread(store.unended)
    users = [b.id for b in reading if b.input_file_id == record.id]
    if users:
        message = f"file {record.id!r} is the input of batch {users[0]!r}, which has not ended"
        raise InvalidRequestError(message, "file_id", "file_in_use")
    await asyncio.to_thread(store.delete_file, record.id)
    return _json({"id": record.id, "object": "file", "deleted": True})


@router.get(
    "/v1/files/{file_id}/content",
    responses={**ANSWERS, 200: {"content": {"application/octet-stream": {}}}},
)
async def file_content(request: Request, file_id: str) -> Response:
    """A file's bytes, streamed from disk."""
    store, record = await _file(request, file_id)
    return FileResponse(
        store.data_path(record.id), media_type="application/octet-stream", filename=record.filename
    )


# batches

Metadata = Annotated[
    dict[Annotated[StrictStr, Field(max_length=64)], Annotated[StrictStr, Field(max_length=512)]],
    Field(max_length=16),
]


class ExpiresAfter(RequestBody):
    """OpenAI's `output_expires_after`."""

    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=EXPIRES_SECONDS[0], le=EXPIRES_SECONDS[1])]


class BatchCreate(RequestBody):
    """OpenAI's `POST /v1/batches` body."""

    input_file_id: Annotated[StrictStr, Field(max_length=64)]
    endpoint: Annotated[StrictStr, Field(max_length=64)]
    completion_window: Annotated[StrictStr, Field(max_length=16)]
    metadata: Metadata | None = None
    output_expires_after: ExpiresAfter | None = None


@router.post("/v1/batches", responses=ANSWERS)
async def create_batch(body: BatchCreate, request: Request) -> Response:
    """A batch of the caller's uploaded file, `validating` until the runner takes it."""
    batches = _batches(request)
    store, owner = batches.store, _owner(request)
    if body.endpoint not in ENDPOINTS:
        message = f"endpoint {clip(body.endpoint)!r} is not served: one of {', '.join(ENDPOINTS)}"
        raise InvalidRequestError(message, "endpoint", "invalid_value")
    window_s = _window_seconds(body.completion_window)
    record = await asyncio.to_thread(store.file, body.input_file_id, owner, time.time())
    if record is None:
        raise NotFoundError(f"no file {clip(body.input_file_id)!r}", "input_file_id")
    if record.purpose is not Purpose.BATCH:
        message = f"file {record.id!r} was not uploaded with purpose 'batch'"
        raise InvalidRequestError(message, "input_file_id", "invalid_value")
    if len(await asyncio.to_thread(store.unended)) >= MOST_OPEN_BATCHES:
        message = f"{MOST_OPEN_BATCHES} batches are waiting or running: retry once some end"
        raise InvalidRequestError(message, None, "too_many_batches")
    now = int(time.time())
    expires = body.output_expires_after
    batch = BatchRecord(
        id=new_batch_id(),
        endpoint=body.endpoint,
        input_file_id=record.id,
        completion_window=body.completion_window,
        created_at=now,
        expires_at=now + window_s,
        owner=owner,
        metadata=body.metadata,
        output_expires_after=None if expires is None else expires.seconds,
    )
    await asyncio.to_thread(store.put_batch, batch)
    batches.runner.poke()
    return _json(batch.public())


def _window_seconds(window: str) -> int:
    """`completion_window` in seconds: a count and a unit (s, m, h, d), 1 minute to 30 days."""
    match = WINDOW.fullmatch(window)
    low, high = WINDOW_S
    seconds = 0 if match is None else int(match[1]) * UNIT_S[match[2]]
    if not low <= seconds <= high:
        raise InvalidRequestError(
            f"completion_window {clip(window)!r} is not a duration from 1s to 30d such as '24h'",
            "completion_window",
            "invalid_value",
        )
    return seconds


@router.get("/v1/batches", responses=ANSWERS)
async def list_batches(
    request: Request,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Response:
    """The caller's batches, newest first (OpenAI's cursor pagination)."""
    store = _batches(request).store
    found = await asyncio.to_thread(store.batches, _owner(request))
    page, more = _page(found, [b.id for b in found], after, limit)
    shown = await asyncio.to_thread(lambda: [_public(store, b) for b in page])
    return _listed(shown, more)


def _public(store: BatchStore, batch: BatchRecord) -> dict[str, object]:
    asked = None if batch.status in ENDED else store.cancel_asked(batch.id)
    return batch.public(asked)


async def _batch(request: Request, batch_id: str) -> tuple[Batches, BatchRecord]:
    batches = _batches(request)
    record = await asyncio.to_thread(batches.store.batch, batch_id)
    if record is None or record.owner != _owner(request):
        raise NotFoundError(f"no batch {clip(batch_id)!r}", "batch_id")
    return batches, record


@router.get("/v1/batches/{batch_id}", responses=ANSWERS)
async def retrieve_batch(request: Request, batch_id: str) -> Response:
    """One batch, as it stands."""
    batches, record = await _batch(request, batch_id)
    return _json(await asyncio.to_thread(_public, batches.store, record))


@router.post("/v1/batches/{batch_id}/cancel", responses=ANSWERS)
async def cancel_batch(request: Request, batch_id: str) -> Response:
    """Ask a batch to stop: `cancelling` until the runner has stopped it (`cancelled`)."""
    batches, record = await _batch(request, batch_id)
    if record.status in ENDED and record.status is not Status.CANCELLED:
        message = f"batch {record.id!r} is {record.status.value}: only a batch not ended cancels"
        raise InvalidRequestError(message, "batch_id", "invalid_state")
    if record.status is Status.CANCELLED:
        return _json(record.public())
    asked = await asyncio.to_thread(batches.store.ask_cancel, record.id, int(time.time()))
    batches.runner.poke()
    return _json(record.public(asked))

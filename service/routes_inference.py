"""Inference routes: /v1/embeddings (OpenAI), /v1/pooling (vLLM), /v1/classify."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pooling.params import PoolingParams, PoolingTask
from scheduler.request import PoolingOutput
from service.encoding import (
    StrictJSONRoute,
    document,
    dumps,
    encode_item,
    sparse_parts,
    stream_item,
)
from service.errors import InvalidRequestError, error_line
from service.pooler_config import PoolerDefaults
from service.runs import (
    Submitted,
    as_completed,
    encoded,
    gather,
    service_state,
    submit,
    timing_headers,
)
from service.schemas import ClassifyRequest, EmbeddingRequest, PoolingRequestBody

router = APIRouter(route_class=StrictJSONRoute)
# /v1/pooling answers NDJSON when asked to stream
STREAMED: dict[int | str, dict[str, Any]] = {200: {"content": {"application/x-ndjson": {}}}}


class NDJSONResponse(StreamingResponse):
    """NDJSON lines whose iterator is closed however the response ends.

    A stream cut short (client gone, drain deadline) thus cancels its engine work at once
    rather than when the garbage collector finalizes the generator.
    """

    media_type = "application/x-ndjson"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream, then close the line iterator."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def _params(task: PoolingTask, defaults: PoolerDefaults, **given: object) -> PoolingParams:
    """A request's pooling parameters: its own values, else the server's --pooler-config."""
    merged = {k: (v if v is not None else getattr(defaults, k, None)) for k, v in given.items()}
    if merged.get("returned_token_ids") is not None:
        merged["returned_token_ids"] = tuple(merged["returned_token_ids"])  # type: ignore[arg-type]
    return PoolingParams(task=task, **merged)  # type: ignore[arg-type]


def _usage(run: Submitted) -> dict[str, int]:
    return {"prompt_tokens": run.num_prompt_tokens, "total_tokens": run.num_prompt_tokens}


async def _respond(request: Request, body: bytes, outputs: list[PoolingOutput]) -> Response:
    """Account the bytes and answer with the timing headers."""
    service_state(request).metrics.output_bytes.inc(len(body))
    return Response(body, media_type="application/json", headers=timing_headers(outputs))


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """OpenAI embeddings."""
    defaults = _defaults(request)
    params = _params(
        PoolingTask.EMBED, defaults, dimensions=body.dimensions, normalize=body.normalize
    )
    run = await submit(request, body, PoolingTask.EMBED, params)
    outputs = await gather(request, run)
    fields = {"object": "list", "model": run.model.served_name, "usage": _usage(run)}

    def encode() -> bytes:
        items = (
            encode_item(
                {"object": "embedding", "index": i}, "embedding", o.data, body.encoding_format
            )
            for i, o in enumerate(outputs)
        )
        return document(fields, "data", items)

    return await _respond(request, await encoded(request, encode), outputs)


@router.post("/v1/pooling", responses=STREAMED)
@router.post("/pooling", responses=STREAMED)
async def pooling(body: PoolingRequestBody, request: Request) -> Response:
    """vLLM-compatible pooling for every task, optionally streamed as NDJSON."""
    state = service_state(request)
    task = body.task or state.default_task
    if task is PoolingTask.EMBED_SPARSE and body.encoding_format == "base64":
        message = "encoding_format base64 does not apply to task 'embed_sparse'"
        raise InvalidRequestError(message, "encoding_format")
    params = _params(
        task,
        _defaults(request),
        dimensions=body.dimensions,
        normalize=body.normalize,
        use_activation=body.use_activation,
        step_tag_id=body.step_tag_id,
        returned_token_ids=body.returned_token_ids,
    )
    run = await submit(request, body, task, params)
    if body.stream:
        return NDJSONResponse(_stream(request, body, run))
    outputs = await gather(request, run)
    fields = {
        "id": f"pool-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": run.model.served_name,
        "usage": _usage(run),
    }

    def encode() -> bytes:
        return document(
            fields, "data", (_pooling_item(i, o.data, body) for i, o in enumerate(outputs))
        )

    return await _respond(request, await encoded(request, encode), outputs)


def _pooling_item(index: int, data: np.ndarray, body: PoolingRequestBody) -> bytes:
    fields: dict[str, object] = {"index": index, "object": "pooling"}
    if body.task is PoolingTask.EMBED_SPARSE:
        ids, weights = sparse_parts(data)
        return dumps({**fields, "data": {"indices": ids, "values": weights}})
    if body.encoding_format == "base64":
        fields["shape"] = list(data.shape)
    return encode_item(fields, "data", data, body.encoding_format, body.embed_dtype)


async def _stream(
    request: Request, body: PoolingRequestBody, run: Submitted
) -> AsyncIterator[bytes]:
    """One line per input as it finishes (float token-level outputs in row pieces), then usage.

    Each piece is encoded in a worker thread just before it is sent, so at most one piece of
    one output exists as JSON at a time. An error mid-stream ends it with an error line.
    """
    metrics = service_state(request).metrics
    at_line_end = True
    try:
        async with aclosing(as_completed(run)) as outputs:
            async for index, output in outputs:
                if body.encoding_format == "base64" or body.task is PoolingTask.EMBED_SPARSE:
                    line = _pooling_item(index, output.data, body) + b"\n"
                    pieces: Iterator[bytes] = iter([line])
                else:
                    pieces = stream_item({"index": index, "object": "pooling"}, output.data)
                while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
                    metrics.output_bytes.inc(len(piece))
                    at_line_end = piece.endswith(b"\n")
                    yield piece
    except Exception as exc:  # the status line is sent: the error can only be the last line
        yield (b"" if at_line_end else b"\n") + error_line(exc)
        return
    yield dumps({"object": "usage", "usage": _usage(run)}) + b"\n"


@router.post("/v1/classify")
@router.post("/classify")
async def classify(body: ClassifyRequest, request: Request) -> Response:
    """Sequence classification with labels."""
    params = _params(PoolingTask.CLASSIFY, _defaults(request), use_activation=body.use_activation)
    run = await submit(request, body, PoolingTask.CLASSIFY, params)
    outputs = await gather(request, run)
    labels = run.model.loaded.spec.labels
    data = []
    for i, o in enumerate(outputs):
        best = int(np.argmax(o.data))
        label = labels[best] if best < len(labels) else f"LABEL_{best}"
        data.append(
            {"index": i, "label": label, "probs": o.data, "num_classes": int(o.data.shape[-1])}
        )
    answer = {
        "id": f"classify-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": run.model.served_name,
        "data": data,
        "usage": _usage(run),
    }
    return await _respond(request, await encoded(request, dumps, answer), outputs)


def _defaults(request: Request) -> PoolerDefaults:
    model = service_state(request).model
    return model.defaults if model is not None else PoolerDefaults()

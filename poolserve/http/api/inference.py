"""Inference routes: /v1/embeddings (OpenAI), /v1/pooling (vLLM), /v1/classify."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import aclosing
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from poolserve.frontend.encoding import (
    Encoded,
    binary_parts,
    document,
    dumps,
    encode_item,
    sparse_parts,
    stream_item,
)
from poolserve.frontend.jobs import MediaJob, Requested
from poolserve.frontend.pipeline import Submitted, as_completed, check_serving, gather
from poolserve.frontend.quantize import quantize
from poolserve.http.api.embedding_fields import agreed, nim_model_suffix
from poolserve.http.api.schemas import (
    ClassifyRequest,
    EmbeddingRequest,
    InputBody,
    PoolingRequestBody,
)
from poolserve.http.api.span_items import SpanRows, span_rows
from poolserve.http.calls import answer, service_state, submit
from poolserve.http.errors import ERROR_FAMILY_KEY, VOYAGE_FAMILY, error_line
from poolserve.http.routing import StrictJSONRoute
from poolserve.types.errors import InvalidRequestError
from poolserve.types.outputs import PoolingOutput
from poolserve.types.tasks import NORMALIZING_TASKS, PoolingTask

router = APIRouter(route_class=StrictJSONRoute)
# the path Voyage's client posts to: errors to its requests take Voyage's body
VOYAGE_PATHS = frozenset({"/v1/embeddings"})
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


BINARY_FORMATS = frozenset({"bytes", "bytes_only"})


def _normalize(
    task: PoolingTask, normalize: bool | None, use_activation: bool | None
) -> bool | None:
    """An embedding's normalize under either name (vLLM calls it use_activation)."""
    if task not in NORMALIZING_TASKS or use_activation is None:
        return normalize
    if normalize is not None and normalize != use_activation:
        raise InvalidRequestError(
            "normalize and use_activation mean the same for embeddings and must agree",
            "use_activation",
        )
    return use_activation


def _response_id(prefix: str, request: Request, body: InputBody) -> str:
    """vLLM's response id: prefix-, then the x-request-id header, else the body's request_id."""
    state = request.state
    if body.request_id is not None and not getattr(state, "request_id_given", False):
        state.request_id = body.request_id  # the edge echoes it in x-request-id
    return f"{prefix}-{getattr(state, 'request_id', None) or uuid.uuid4().hex}"


def _usage(run: Submitted) -> dict[str, int | None]:
    """vLLM's UsageInfo as it serializes it: pooling completes no tokens."""
    return {
        "prompt_tokens": run.num_prompt_tokens,
        "total_tokens": run.num_prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


# vLLM's bytes metadata header carries only these two usage counts
BINARY_USAGE = ("prompt_tokens", "total_tokens")


def _binary(
    fields: dict[str, object],
    arrays: Iterable[np.ndarray],
    body: EmbeddingRequest | PoolingRequestBody,
    where: Iterable[dict[str, object]] = (),
) -> Encoded:
    """vLLM's bytes formats: the raw outputs back to back; `bytes` adds a metadata header.

    With late chunking the arrays are the span rows and `where` adds each one's origin.
    """
    parts, items = binary_parts(arrays, body.embed_dtype, body.endianness)
    for item, origin in zip(items, where, strict=False):
        item.update(origin)
    headers = {}
    if body.encoding_format == "bytes":
        usage = fields["usage"]
        assert isinstance(usage, dict)
        counts = {name: usage[name] for name in BINARY_USAGE}
        headers["metadata"] = dumps({**fields, "usage": counts, "data": items}).decode()
    return Encoded(b"".join(parts), "application/octet-stream", headers)


async def _reply(
    request: Request,
    fields: dict[str, object],
    outputs: list[PoolingOutput],
    body: EmbeddingRequest | PoolingRequestBody,
    encode: Callable[[], bytes],
    rows: SpanRows | None = None,
) -> Response:
    """The JSON document, or the binary body vLLM's bytes formats ask for (both output-sized)."""
    if body.encoding_format not in BINARY_FORMATS:
        return await answer(request, outputs, encode, inline=True)

    def binary() -> Encoded:
        if rows is not None:  # late chunking: one part per span
            return _binary(fields, rows.arrays, body, rows.where)
        return _binary(fields, (o.data for o in outputs), body)

    return await answer(request, outputs, binary, inline=True)


def _embedding_head(index: int) -> dict[str, object]:
    """An embedding item's first fields, as OpenAI orders them."""
    return {"object": "embedding", "index": index}


def _pooling_head(index: int) -> dict[str, object]:
    """A pooling item's first fields, as vLLM orders them."""
    return {"index": index, "object": "pooling"}


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """OpenAI embeddings, with vLLM's fields (messages, request_id, embed_dtype, ...) and the
    fields Voyage, NIM and Jina send to the same path (embedding_fields.py)."""
    if "truncation" in body.model_fields_set:
        # Voyage's client always sends `truncation` (Voyage's field alone): it reads its errors
        # from Voyage's body, `{"detail"}` (the body's own schema errors came before: OpenAI's)
        request.scope.setdefault("state", {})[ERROR_FAMILY_KEY] = VOYAGE_FAMILY
    task = PoolingTask.EMBED
    normalize = agreed(
        ("normalize", _normalize(task, body.normalize, body.use_activation)),
        ("normalized", body.normalized),
    )
    dimensions = agreed(
        ("dimensions", body.dimensions), ("output_dimension", body.output_dimension)
    )
    form = body.output_form(body.encoding_format, body.embed_dtype, body.model_fields_set)
    requested = Requested(dimensions=dimensions, normalize=normalize)
    job = body.job(task, requested)
    truncate = body.client_truncate(body.truncate_prompt_tokens)
    state = service_state(request)
    model, named_type = nim_model_suffix(body.model, lambda name: state.find(name) is not None)
    input_type = agreed(("input_type", body.input_type), ("model", named_type))
    if isinstance(job, MediaJob):
        late = body.late_chunking or None  # Jina's false asks for nothing
        text_only = (("task", body.task), ("input_type", input_type), ("late_chunking", late))
        for name, value in text_only:
            if value is not None:  # a prompt, an adapter or spans of texts: never dropped
                raise InvalidRequestError(f"{name} does not apply to image inputs", name)
        job = dataclasses.replace(
            job, model=model, truncate=job.truncate if truncate is None else truncate
        )
    else:
        job = dataclasses.replace(
            job,
            model=model,
            adapter=body.task,  # Jina's `task`
            input_type=input_type,
            truncate=job.truncate if truncate is None else truncate,
        )
    run = await submit(request, job)
    outputs = await gather(run)
    rows = span_rows(run.char_spans, outputs)  # late chunking: an item per span
    if rows is not None and body.late_chunking is True:  # Jina's: an item per input, as sent
        rows = rows.without_origin()
    fields: dict[str, object] = {
        "id": _response_id("embd", request, body),
        "object": "list",
        "created": int(time.time()),
        "model": run.model.served_name,
        "usage": _usage(run),
    }

    def encode() -> bytes:
        if rows is not None:
            quantized = SpanRows([quantize(a, form.precision) for a in rows.arrays], rows.where)
            items = quantized.items(_embedding_head, "embedding", form, body.endianness)
            return document(fields, "data", items)
        arrays = [quantize(o.data, form.precision) for o in outputs]
        if form.encoding_format == "float":  # one document, the numbers straight from numpy
            data = [
                {"object": "embedding", "index": i, "embedding": array}
                for i, array in enumerate(arrays)
            ]
            return dumps({**fields, "data": data})
        items = (
            encode_item(
                {"object": "embedding", "index": i},
                "embedding",
                array,
                form.encoding_format,
                form.embed_dtype,
                body.endianness,
            )
            for i, array in enumerate(arrays)
        )
        return document(fields, "data", items)

    return await _reply(request, fields, outputs, body, encode, rows)


@router.post("/v1/pooling", responses=STREAMED)
@router.post("/pooling", responses=STREAMED)
async def pooling(body: PoolingRequestBody, request: Request) -> Response:
    """vLLM-compatible pooling for every task, optionally streamed as NDJSON."""
    # the task a request names, else the named model's main one
    task = body.task or check_serving(service_state(request), body.model)[1].default_task
    if task is PoolingTask.EMBED_SPARSE and body.encoding_format != "float":
        message = f"encoding_format {body.encoding_format} does not apply to task 'embed_sparse'"
        raise InvalidRequestError(message, "encoding_format")
    if body.stream and body.encoding_format in BINARY_FORMATS:
        message = f"encoding_format {body.encoding_format} cannot be streamed"
        raise InvalidRequestError(message, "encoding_format")
    if body.stream and body.late_chunking is not None:
        raise InvalidRequestError("late_chunking answers cannot be streamed", "stream")
    returned = body.returned_token_ids
    requested = Requested(
        dimensions=body.dimensions,
        normalize=_normalize(task, body.normalize, body.use_activation),
        use_activation=None if task in NORMALIZING_TASKS else body.use_activation,
        step_tag_id=body.step_tag_id,
        returned_token_ids=None if returned is None else tuple(returned),
    )
    run = await submit(request, body.job(task, requested))
    response_id = _response_id("pool", request, body)  # also sets x-request-id for a stream
    if body.stream:
        return NDJSONResponse(_stream(request, body, run))
    outputs = await gather(run)
    rows = span_rows(run.char_spans, outputs)  # late chunking: an item per span
    fields: dict[str, object] = {
        "id": response_id,
        "object": "list",
        "created": int(time.time()),
        "model": run.model.served_name,
        "usage": _usage(run),
    }

    def encode() -> bytes:
        if rows is not None:
            base64 = body.encoding_format == "base64"
            items = rows.items(_pooling_head, "data", body, body.endianness, shape=base64)
            return document(fields, "data", items)
        return document(
            fields, "data", (_pooling_item(i, o.data, body) for i, o in enumerate(outputs))
        )

    return await _reply(request, fields, outputs, body, encode, rows)


def _pooling_item(index: int, data: np.ndarray, body: PoolingRequestBody) -> bytes:
    fields: dict[str, object] = {"index": index, "object": "pooling"}
    if body.task is PoolingTask.EMBED_SPARSE:
        ids, weights = sparse_parts(data)
        return dumps({**fields, "data": {"indices": ids, "values": weights}})
    if body.encoding_format == "base64":
        fields["shape"] = list(data.shape)
    return encode_item(
        fields, "data", data, body.encoding_format, body.embed_dtype, body.endianness
    )


async def _stream(
    request: Request, body: PoolingRequestBody, run: Submitted
) -> AsyncIterator[bytes]:
    """One line per input as it finishes (float token-level outputs in row pieces), then usage.

    Each piece is encoded in a worker thread just before it is sent, so at most one piece of
    one output exists as JSON at a time. An error mid-stream ends it with an error line.
    """
    model = run.model
    metrics = service_state(request).metrics.model(model.model_name).through(model.lora_name)
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
    use_activation = next(
        (v for v in (body.use_activation, body.softmax, body.activation) if v is not None), None
    )
    requested = Requested(use_activation=use_activation)
    run = await submit(request, body.job(PoolingTask.CLASSIFY, requested))
    outputs = await gather(run)
    data = [
        {
            "index": i,
            "label": run.model.label_of(o.data),
            "probs": o.data,
            "num_classes": int(o.data.shape[-1]),
        }
        for i, o in enumerate(outputs)
    ]
    reply = {
        "id": _response_id("classify", request, body),
        "object": "list",
        "created": int(time.time()),
        "model": run.model.served_name,
        "data": data,
        "usage": _usage(run),
    }
    return await answer(request, outputs, lambda: dumps(reply), inline=True)

"""The HTTP request's side of the front end's pipeline: the server state of the app a request
reached, its job submitted as an `HTTPCaller` (its span, its access-log fields, the connection
that may close), its scores, and its answer encoded into a response.

The front end itself (poolserve/frontend/) knows no web framework: the Python API runs the same
pipeline with its in-process caller.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence

from fastapi import Request
from starlette.responses import Response

from poolserve.frontend.callers import CLOSE_WATCH
from poolserve.frontend.encoding import INLINE_VALUES, JSON, Encoded, timing_headers
from poolserve.frontend.jobs import Job, ScoreJob
from poolserve.frontend.pipeline import Submitted, submit_job
from poolserve.frontend.scoring import Scored, scores_of
from poolserve.frontend.state import ServiceState
from poolserve.http.batches import BATCH_LINE, BATCH_PRIORITY
from poolserve.http.tenants import TENANT_KEY, served_names
from poolserve.http.visible import restricts, tenant_of, unseen
from poolserve.observability.logs import LORA_KEY, MODEL_KEY, PROMPT_TOKENS_KEY
from poolserve.observability.metrics import NO_LORA
from poolserve.observability.tracing import LORA_SPAN_ATTRIBUTE, NO_TRACE, SpanRecord, trace_of
from poolserve.types.errors import ModelNotFoundError
from poolserve.types.outputs import PoolingOutput
from poolserve.types.tasks import PoolingTask


def service_state(request: Request) -> ServiceState:
    """The server state attached to the app."""
    state: ServiceState = request.app.state.poolserve
    return state


async def submit(request: Request, job: Job) -> Submitted:
    """An HTTP request's job through the pipeline (`submit_job`); a batch line's behind every
    interactive request (`BATCH_PRIORITY`)."""
    request.state.task = job.task.value  # for the access log, even when the job is refused
    if BATCH_LINE in request.scope.get("extensions", ()):
        job = dataclasses.replace(job, priority=max(job.priority, BATCH_PRIORITY))
    try:
        return await submit_job(service_state(request), job, HTTPCaller(request))
    except ModelNotFoundError:
        tenant = tenant_of(request)
        if restricts(tenant):  # its 404 lists every served name: none for a restricted key
            raise unseen(job.model, tenant) from None
        raise


async def score(request: Request, job: ScoreJob) -> Scored:
    """An HTTP request's job through the one pipeline, then each pair's score."""
    return await scores_of(job, await submit(request, job))


def routed_model(request: Request) -> str:
    """The served name of the model the request was routed to ("" before it was)."""
    name = request.scope.get("state", {}).get(MODEL_KEY)
    return name if isinstance(name, str) else ""


def routed_lora(request: Request) -> str:
    """The LoRA adapter the request runs through (NO_LORA: none, or not routed yet)."""
    name = request.scope.get("state", {}).get(LORA_KEY)
    return name if isinstance(name, str) else NO_LORA


class HTTPCaller:
    """An HTTP request: its span, its access log line, and the connection that may close."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.trace = trace_of(request)

    def routed(self, model_name: str, lora_name: str | None) -> None:
        """The model in the access log, the request metrics and on the request span; the LoRA
        adapter beside it only when the request runs through one. 403 when the request's API
        key may not use it (--api-keys-file's `models`)."""
        scope_state = self.request.scope.setdefault("state", {})
        scope_state[MODEL_KEY] = model_name
        if lora_name is None:
            self.trace.set({"poolserve.model": model_name})
        else:
            scope_state[LORA_KEY] = lora_name
            self.trace.set({"poolserve.model": model_name, LORA_SPAN_ATTRIBUTE: lora_name})
        tenant = scope_state.get(TENANT_KEY)
        if tenant is not None and tenant.spec.models is not None:
            state = service_state(self.request)
            tenant.check_model(served_names(state, model_name, lora_name))

    def tokenized(self, started: float, ended: float, num_inputs: int, num_tokens: int) -> None:
        """The tokenize span."""
        attributes = {"poolserve.inputs": num_inputs, "poolserve.prompt_tokens": num_tokens}
        self.trace.record(SpanRecord("tokenize", started, ended, attributes))

    def admitted(self, task: PoolingTask, num_tokens: int) -> None:
        """Prompt tokens in the access log, on the request span and charged to its API key."""
        scope_state = self.request.scope.setdefault("state", {})
        # a request may submit more than one job (TEI's /predict of texts and pairs): they add up
        total = scope_state.get(PROMPT_TOKENS_KEY, 0) + num_tokens
        scope_state[PROMPT_TOKENS_KEY] = total
        tenant = scope_state.get(TENANT_KEY)
        if tenant is not None:  # charged once known: --api-keys-file's tokens_per_minute
            tenant.charge(num_tokens)
        self.trace.set({"poolserve.prompt_tokens": total, "poolserve.task": task.value})

    def on_leave(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when the client closes the connection (the body has been read).

        Under this server the connection says so itself (`CLOSE_WATCH`, no task per request);
        elsewhere a task waits for the ASGI disconnect message.
        """
        watch = self.request.scope.get("extensions", {}).get(CLOSE_WATCH)
        if watch is not None:
            stop: Callable[[], None] = watch(callback)
            return stop
        waiter = asyncio.ensure_future(self._disconnect())
        waiter.add_done_callback(lambda done: None if done.cancelled() else callback())

        def unwatch() -> None:
            waiter.cancel()

        return unwatch

    async def _disconnect(self) -> None:
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                return


async def answer(
    request: Request,
    outputs: Sequence[PoolingOutput],
    work: Callable[[], bytes | Encoded],
    *,
    inline: bool = False,
) -> Response:
    """The reply encoded (its `encode` span), its bytes counted, timing headers.

    A caller whose document is about as large as its outputs (no echoed texts) may ask for it
    `inline`: up to INLINE_VALUES output values are then encoded on the loop, more in a thread.
    """
    started = time.monotonic()
    if inline and sum(o.data.size for o in outputs) <= INLINE_VALUES:
        made = work()
    else:
        made = await asyncio.to_thread(work)
    reply = made if isinstance(made, Encoded) else Encoded(made, JSON)
    trace = trace_of(request)
    if trace is not NO_TRACE:  # no span to build when tracing is off
        attributes = {"poolserve.output_bytes": len(reply.body)}
        trace.record(SpanRecord("encode", started, time.monotonic(), attributes))
    metrics = service_state(request).metrics
    metrics.add_output_bytes(routed_model(request), routed_lora(request), len(reply.body))
    headers = {**timing_headers(outputs), **reply.headers}
    return Response(reply.body, media_type=reply.media_type, headers=headers)

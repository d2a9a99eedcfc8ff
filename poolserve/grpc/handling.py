"""What every tei.v1 RPC shares: a call accounted around its work, unary and streamed; the
served model a call picks; TEI's truncation, prompt and Metadata rules in gRPC's fields."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeAlias, TypeVar

import grpc

from poolserve.frontend.jobs import Job, Truncate
from poolserve.frontend.pipeline import check_serving, gather, submit_job
from poolserve.frontend.state import ModelHandle, ServiceState
from poolserve.grpc import tei_pb2 as pb
from poolserve.grpc.calls import (
    CLIENT_CLOSED,
    MISSING_KEY,
    GrpcCall,
    GrpcError,
    bearer,
    check_key,
    grpc_error,
    metadata_of,
)
from poolserve.grpc.streams import in_order
from poolserve.http.compat.tei_common import Ran, truncation
from poolserve.http.tenants import KeyRing
from poolserve.http.visible import restricts, unseen
from poolserve.observability.logs import API_KEY_NAME_KEY
from poolserve.types.errors import AuthenticationError, ModelNotFoundError

Req = TypeVar("Req")
Resp = TypeVar("Resp", bound="Sized")
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class Sized(Protocol):
    """A protobuf message: its encoded size."""

    def ByteSize(self) -> int:
        """Bytes on the wire."""


class Calls:
    """Runs each RPC's work as one accounted call of the server state's pipeline."""

    def __init__(self, state: ServiceState, keys: KeyRing | None = None) -> None:
        self.state = state
        key = state.settings.api_key
        self.api_key = key.encode() if key else None
        self.keys = keys  # --api-keys-file: the front end's one table, shared with HTTP
        # chosen once: without a keys file a call pays nothing for it
        self._authorize = self._check_key if keys is None else self._check_tenant

    def _check_key(self, call: GrpcCall, metadata: dict[str, str]) -> None:
        check_key(self.api_key, metadata)

    def _check_tenant(self, call: GrpcCall, metadata: dict[str, str]) -> None:
        """A keys file's key: UNAUTHENTICATED unknown, PERMISSION_DENIED a method its `routes`
        leave out, RESOURCE_EXHAUSTED its limit spent; one request of the key either way."""
        assert self.keys is not None
        tenant = self.keys.find(bearer(metadata))
        if tenant is None:
            raise AuthenticationError(MISSING_KEY)
        call.tenant = tenant
        call.noted[API_KEY_NAME_KEY] = tenant.name
        # a call's route is its method path, the endpoint its metrics and access log name
        tenant.admit(call.method, time.monotonic())

    async def one(
        self, context: Context, method: str, work: Callable[[GrpcCall], Awaitable[Resp]]
    ) -> Resp:
        """The work's answer; its error as a GrpcError; either way counted once."""
        metadata = metadata_of(context)
        call = GrpcCall(self.state, method, metadata, context.peer())
        try:
            self._authorize(call, metadata)
            reply = await work(call)
        except asyncio.CancelledError:
            call.finish(CLIENT_CLOSED)
            raise
        except Exception as exc:
            if isinstance(exc, ModelNotFoundError) and restricts(call.tenant):
                # its message lists every served name: none for a key restricted to some
                exc = unseen(call.model_name, call.tenant)
            error = grpc_error(exc)
            call.finish(error.status)
            raise error from exc
        call.finish(200, reply.ByteSize())
        return reply

    async def unary(
        self, context: Context, method: str, work: Callable[[GrpcCall], Awaitable[Resp]]
    ) -> Resp:
        """A unary RPC: the answer, or the call aborted with the error's code and message."""
        try:
            return await self.one(context, method, work)
        except GrpcError as error:
            await context.abort(error.code, error.message, error.trailers)
            raise  # abort raises; this says so to the type checker

    async def stream(
        self,
        requests: AsyncIterable[Req],
        context: Context,
        method: str,
        work: Callable[[GrpcCall, Req], Awaitable[Resp]],
    ) -> AsyncIterator[Resp]:
        """A streaming RPC: each message answered in order; the first error ends the stream."""

        def answer(request: Req) -> Awaitable[Resp]:
            return self.one(context, method, lambda call: work(call, request))

        try:
            async for reply in in_order(requests, answer):
                yield reply
        except GrpcError as error:
            await context.abort(error.code, error.message, error.trailers)


def model_of(state: ServiceState, call: GrpcCall) -> ModelHandle:
    """The model the call's `model` metadata names (the default without it): 503/404 otherwise."""
    return check_serving(state, call.model_name)[1]


def truncate_of(truncate: bool, direction: int) -> Truncate:
    """TEI's gRPC truncation: the message's `truncate` (proto3: false unless sent), its side."""
    left = direction == pb.TRUNCATION_DIRECTION_LEFT
    return truncation(truncate, "left" if left else "right")


def prompt_of(model: ModelHandle, asked: str | None) -> tuple[str | None, str | None]:
    """TEI's prompt rule: the message's prompt_name, else --default-prompt-name, else none."""
    name = asked if asked is not None else model.settings.default_prompt_name
    return (name, None) if name is not None else (None, "")


async def run(state: ServiceState, call: GrpcCall, job: Job, chars: int) -> Ran:
    """One job through the pipeline, timed as TEI reports it."""
    started = time.monotonic()
    outputs = await gather(await submit_job(state, job, call))
    return Ran.of(outputs, time.monotonic() - started, chars)


def metadata(started: float, ran: Ran) -> pb.Metadata:
    """TEI's Metadata: per-input times averaged, in nanoseconds."""
    count = max(len(ran.outputs), 1)
    return pb.Metadata(
        compute_chars=ran.characters,
        compute_tokens=sum(o.num_prompt_tokens for o in ran.outputs),
        total_time_ns=_ns(time.monotonic() - started),
        tokenization_time_ns=_ns(ran.tokenization_s / count),
        queue_time_ns=_ns(sum(o.queue_time_s for o in ran.outputs) / count),
        inference_time_ns=_ns(sum(o.inference_time_s for o in ran.outputs) / count),
    )


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))

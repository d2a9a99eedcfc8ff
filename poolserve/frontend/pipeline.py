"""The one door to the engine: a job in, engine futures out, accounted the same for every caller.

Every inference route, native or compat, texts or pairs, calls `submit`, and the Python API
(`poolserve/offline/`) calls `submit_job` with the same jobs: serving checks, the parameters
merge, 429 before any work, tokenization off the loop (its span and metric), one all-or-nothing
submission, prompt tokens in the metric, and for an HTTP request the access log and the trace.
`gather` and `as_completed` wait for the outputs (a caller that leaves cancels its work);
`answer` in `encoding.py` sends an HTTP reply.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from poolserve.frontend.callers import IN_PROCESS, Caller
from poolserve.frontend.chunked import (
    Slicing,
    check_lengths,
    cut,
    embed_limit,
    slice_params,
    tokenizing_model,
)
from poolserve.frontend.client import EngineClient
from poolserve.frontend.jobs import Job
from poolserve.frontend.plans import PLANNERS, Batch
from poolserve.frontend.spans import CharSpans
from poolserve.frontend.state import ModelHandle, ServiceState
from poolserve.observability.metrics import UNROUTED
from poolserve.observability.tracing import RequestTrace
from poolserve.types.errors import (
    ClientDisconnectedError,
    DrainingError,
    ModelNotFoundError,
    NotReadyError,
    ShutdownError,
)
from poolserve.types.outputs import PoolingOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submitted:
    """A job's prompts, admitted and queued in the engine."""

    engine: EngineClient
    model: ModelHandle
    futures: tuple[asyncio.Future[PoolingOutput], ...]  # one per engine prompt
    num_prompt_tokens: int
    caller: Caller = IN_PROCESS
    # chunked processing: the slices (engine prompts) of each input; None: a prompt per input
    slicing: Slicing | None = None
    char_spans: CharSpans | None = None  # late chunking: each input's spans, in characters

    @property
    def trace(self) -> RequestTrace:
        """The caller's trace."""
        return self.caller.trace


def check_serving(state: ServiceState, model_name: str | None) -> tuple[EngineClient, ModelHandle]:
    """The named model's engine and handle (the default model's when none is named): 503 unless
    ready and not draining; 404 for a name no model is served as, listing the served names."""
    served = state.find(model_name)
    label = UNROUTED if served is None else served.handle.model_name  # an adapter's: its base
    if state.draining:
        state.metrics.on_reject("draining", label)
        raise DrainingError()
    if not state.ready or state.default is None:
        state.metrics.on_reject("not_ready", label)
        raise NotReadyError("the server is not ready yet")
    if served is None:
        names = [repr(name) for name in (*state.served, *(a.name for a in state.adapters))]
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        raise ModelNotFoundError(
            f"model {model_name!r} does not exist; this server serves {listed}", "model"
        )
    return served.engine, served.handle


async def submit_job(state: ServiceState, job: Job, caller: Caller = IN_PROCESS) -> Submitted:
    """Checks, then 429 before any work, then tokenization off the loop, then one submission."""
    engine, model = check_serving(state, job.model)
    caller.routed(model.model_name, model.lora_name)
    # an adapter's requests count under its base model, with the adapter's name beside it
    metrics = state.metrics.model(model.model_name).through(model.lora_name)
    limit = embed_limit(job, model, engine.max_model_len)  # vLLM's max_embed_len, chunking
    tokenizing = model if limit is None else tokenizing_model(limit, model, job.truncate)
    plan = PLANNERS[type(job)](job, engine, tokenizing, state)
    if model.lora is not None:
        plan = plan.through(model.lora.name)
    engine.check_params(plan.params)
    engine.precheck(plan.num_prompts)  # 429 before any tokenization work
    started = time.monotonic()
    batch = await plan.tokenize()
    num_tokens = sum(len(ids) for ids in batch.token_ids)
    ended = time.monotonic()
    metrics.tokenization.observe(ended - started)
    caller.tokenized(started, ended, len(batch.token_ids), num_tokens)
    slicing = None
    if batch.media is not None:  # a vision-language model's prompts with their images
        try:
            futures = await engine.submit_many(
                batch.token_ids, batch.params, job.priority, batch.token_type_ids, media=batch.media
            )
        finally:
            batch.released()
    elif limit is None:
        futures = await engine.submit_many(
            batch.token_ids, batch.params, job.priority, batch.token_type_ids, batch.pixels
        )
    else:
        check_lengths(limit, batch.token_ids)
        futures, slicing = await _submit_sliced(engine, batch, limit.slice_len, job.priority)
    metrics.prompt_tokens.inc(num_tokens)
    caller.admitted(job.task, num_tokens)
    return Submitted(engine, model, tuple(futures), num_tokens, caller, slicing, batch.char_spans)


async def _submit_sliced(
    engine: EngineClient, batch: Batch, size: int | None, priority: int
) -> tuple[list[asyncio.Future[PoolingOutput]], Slicing | None]:
    """Each input as slices of `size` tokens (None: whole), every slice an engine prompt; a
    group of slices refused cancels the groups admitted before it."""
    if size is None:
        futures = await engine.submit_many(
            batch.token_ids, batch.params, priority, batch.token_type_ids
        )
        return futures, None
    normalize = batch.params.normalize is not False  # the embed head's default: normalised
    prompts, types, slicing = cut(batch.token_ids, batch.token_type_ids, size, normalize)
    slots: list[asyncio.Future[PoolingOutput] | None] = [None] * len(prompts)
    admitted: list[asyncio.Future[PoolingOutput]] = []
    try:
        for params, indices in slice_params(slicing, batch.params):
            group_types = None if types is None else [types[i] for i in indices]
            group = [prompts[i] for i in indices]
            got = await engine.submit_many(group, params, priority, group_types)
            admitted.extend(got)
            for index, future in zip(indices, got, strict=True):
                slots[index] = future
    except BaseException:
        for future in admitted:
            engine.cancel_future(future)
        raise
    return [future for future in slots if future is not None], slicing


async def gather(run: Submitted) -> list[PoolingOutput]:
    """All outputs in input order; a caller that goes away cancels the rest of its work."""
    if not run.futures:
        return []
    finished: asyncio.Future[bool] = asyncio.get_running_loop().create_future()  # True: all in
    left = len(run.futures)

    def on_done(future: asyncio.Future[PoolingOutput]) -> None:
        nonlocal left
        left -= 1
        # the first failure ends the wait: its error is the answer, the rest is cancelled
        failed = future.cancelled() or future.exception() is not None
        if (failed or left == 0) and not finished.done():
            finished.set_result(True)

    def on_leave() -> None:
        if not finished.done():
            finished.set_result(False)

    for future in run.futures:
        future.add_done_callback(on_done)
    stop_watching = run.caller.on_leave(on_leave)
    try:
        if not await finished:
            raise ClientDisconnectedError("the client closed the connection")
        # every future is done unless one failed; then the first failure in input order raises
        outputs = [_output(f) for f in run.futures if f.done()]
        run.trace.add_outputs(outputs)
        return outputs if run.slicing is None else run.slicing.join(outputs)
    finally:
        stop_watching()
        for future in run.futures:
            future.remove_done_callback(on_done)
        _cancel_unfinished(run)


def _output(future: asyncio.Future[PoolingOutput]) -> PoolingOutput:
    """A done future's output; the engine cancels its futures only when it stops."""
    if future.cancelled():
        raise ShutdownError("the server stopped before this request finished")
    return future.result()


async def as_completed(run: Submitted) -> AsyncGenerator[tuple[int, PoolingOutput], None]:
    """(index, output) as each input finishes (sliced: its last slice); closing the iterator
    cancels the rest."""
    index_of = {f: i for i, f in enumerate(run.futures)}
    slicing = run.slicing
    slices_left = slicing.counts() if slicing is not None else []
    pending: set[asyncio.Future[PoolingOutput]] = set(run.futures)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=index_of.__getitem__):
                output = _output(future)
                run.trace.add_outputs((output,))
                if slicing is None:
                    yield index_of[future], output
                    continue
                item = slicing.input_of(index_of[future])
                slices_left[item] -= 1
                if not slices_left[item]:
                    slices = run.futures[slicing.prompts_of(item)]
                    yield item, slicing.pool([f.result() for f in slices])
    finally:
        _cancel_unfinished(run)


def _cancel_unfinished(run: Submitted) -> None:
    for future in run.futures:
        if not future.done():
            run.engine.cancel_future(future)

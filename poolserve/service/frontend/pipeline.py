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
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from fastapi import Request

from poolserve.core.client import EngineClient
from poolserve.pooling.params import PoolingParams, PoolingTask
from poolserve.pooling.scorers import PairMode, scorer_plan
from poolserve.scheduler.errors import DrainingError
from poolserve.scheduler.request import PoolingOutput
from poolserve.service.errors import (
    ClientDisconnectedError,
    ModelNotFoundError,
    NotReadyError,
    ShutdownError,
)
from poolserve.service.frontend.chat import render_conversations
from poolserve.service.frontend.chunked import (
    Slicing,
    check_lengths,
    cut,
    embed_limit,
    slice_params,
    tokenizing_model,
)
from poolserve.service.frontend.jobs import Job, Requested, ScoreJob, TextJob, merge
from poolserve.service.frontend.pairs import PairTruncation, PromptMode, check_pairs, tokenize_job
from poolserve.service.frontend.prompts import prepend, prompt_length
from poolserve.service.frontend.spans import CharSpans, LatePlan, check_late, late_prompts
from poolserve.service.frontend.texts import (
    RawInputs,
    check_batch_size,
    check_prompt,
    run_budgeted,
    split_input,
    tokenize,
    truncation_for,
)
from poolserve.service.observability.logs import PROMPT_TOKENS_KEY
from poolserve.service.observability.tracing import NO_TRACE, RequestTrace, SpanRecord, trace_of
from poolserve.service.state import ModelHandle, ServiceState

logger = logging.getLogger(__name__)


class Caller(Protocol):
    """Who a job runs for: how its work is accounted beyond the metrics, and when it leaves."""

    @property
    def trace(self) -> RequestTrace:
        """The caller's trace (the no-op one when nobody traces it)."""

    def tokenized(self, started: float, ended: float, num_inputs: int, num_tokens: int) -> None:
        """The job's tokenization ran from `started` to `ended` (time.monotonic())."""

    def admitted(self, task: PoolingTask, num_tokens: int) -> None:
        """The engine took the job's prompts."""

    async def left(self) -> None:
        """Returns when the caller has gone (never, for one that waits for its answer)."""


class InProcess:
    """A caller in this process (the Python API): nothing to log or trace, never leaves."""

    trace: RequestTrace = NO_TRACE

    def tokenized(self, started: float, ended: float, num_inputs: int, num_tokens: int) -> None:
        """Nothing beyond the metrics."""

    def admitted(self, task: PoolingTask, num_tokens: int) -> None:
        """Nothing beyond the metrics."""

    async def left(self) -> None:
        """It waits for its answer: cancelling the wait is how it leaves."""
        await asyncio.get_running_loop().create_future()


IN_PROCESS = InProcess()


class HTTPCaller:
    """An HTTP request: its span, its access log line, and the connection that may close."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.trace = trace_of(request)

    def tokenized(self, started: float, ended: float, num_inputs: int, num_tokens: int) -> None:
        """The tokenize span."""
        attributes = {"poolserve.inputs": num_inputs, "poolserve.prompt_tokens": num_tokens}
        self.trace.record(SpanRecord("tokenize", started, ended, attributes))

    def admitted(self, task: PoolingTask, num_tokens: int) -> None:
        """Prompt tokens in the access log and on the request span."""
        scope_state = self.request.scope.setdefault("state", {})
        # a request may submit more than one job (TEI's /predict of texts and pairs): they add up
        total = scope_state.get(PROMPT_TOKENS_KEY, 0) + num_tokens
        scope_state[PROMPT_TOKENS_KEY] = total
        self.trace.set({"poolserve.prompt_tokens": total, "poolserve.task": task.value})

    async def left(self) -> None:
        """Returns when the client closes the connection (the body has been read already)."""
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                return


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


@dataclass(frozen=True)
class Batch:
    """A job's prompts as token ids, with the parameters they run under."""

    params: PoolingParams
    token_ids: list[list[int]]
    token_type_ids: Sequence[Sequence[int] | None] | None = None  # None: no prompt has types
    char_spans: CharSpans | None = None  # late chunking: each prompt's spans, in characters


@dataclass(frozen=True)
class Plan:
    """A job checked before any work: its parameters, its prompt count, how to tokenize it."""

    params: PoolingParams
    num_prompts: int
    tokenize: Callable[[], Awaitable[Batch]]


def service_state(request: Request) -> ServiceState:
    """The server state attached to the app."""
    state: ServiceState = request.app.state.poolserve
    return state


def check_serving(state: ServiceState, model_name: str | None) -> tuple[EngineClient, ModelHandle]:
    """503 unless ready and not draining; 404 for another model's name."""
    if state.draining:
        state.metrics.on_reject("draining")
        raise DrainingError()
    if not state.ready or state.engine is None or state.model is None:
        state.metrics.on_reject("not_ready")
        raise NotReadyError("the server is not ready yet")
    if model_name is not None and model_name not in state.model.served_names:
        names = " or ".join(repr(name) for name in state.model.served_names)
        raise ModelNotFoundError(
            f"model {model_name!r} does not exist; this server serves {names}", "model"
        )
    return state.engine, state.model


async def submit(request: Request, job: Job) -> Submitted:
    """An HTTP request's job through the pipeline (`submit_job`)."""
    request.state.task = job.task.value  # for the access log, even when the job is refused
    return await submit_job(service_state(request), job, HTTPCaller(request))


async def submit_job(state: ServiceState, job: Job, caller: Caller = IN_PROCESS) -> Submitted:
    """Checks, then 429 before any work, then tokenization off the loop, then one submission."""
    engine, model = check_serving(state, job.model)
    limit = embed_limit(job, model, engine.max_model_len)  # vLLM's max_embed_len, chunking
    tokenizing = model if limit is None else tokenizing_model(limit, model, job.truncate)
    plan = PLANNERS[type(job)](job, engine, tokenizing, state)
    engine.check_params(plan.params)
    engine.precheck(plan.num_prompts)  # 429 before any tokenization work
    started = time.monotonic()
    batch = await plan.tokenize()
    num_tokens = sum(len(ids) for ids in batch.token_ids)
    ended = time.monotonic()
    state.metrics.tokenization.observe(ended - started)
    caller.tokenized(started, ended, len(batch.token_ids), num_tokens)
    slicing = None
    if limit is None:
        futures = await engine.submit_many(
            batch.token_ids, batch.params, job.priority, batch.token_type_ids
        )
    else:
        check_lengths(limit, batch.token_ids)
        futures, slicing = await _submit_sliced(engine, batch, limit.slice_len, job.priority)
    state.metrics.prompt_tokens.inc(num_tokens)
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


def _plan_texts(
    job: TextJob, engine: EngineClient, model: ModelHandle, state: ServiceState
) -> Plan:
    """One prompt per input (a sentence-transformers prompt prepended), or per conversation;
    with late chunking each input's spans ride in the parameters (spans.py)."""
    on_reject = state.metrics.on_reject
    chats = job.chats
    limit = state.settings.max_client_batch_size
    if chats is not None:
        check_batch_size(len(chats), limit, "messages")
    raw = None if chats is not None else split_input(job.inputs, limit)
    if job.late_chunking is not None:
        check_late(job, raw, model, engine.max_model_len, limit)
    prompt = None
    if raw is not None:
        prompt = model.prompts.resolve(job.prompt_name, job.prompt, texts=raw.texts is not None)
    if raw is not None and prompt is not None:
        check_prompt(prompt, len(raw), model)
        raw = RawInputs(prepend(prompt, raw.texts or ()), None)
    params = merge(job.task, job.requested, model.defaults)
    # vLLM's defaults: special tokens added to input, not on top of a chat template's
    specials = job.add_special_tokens if job.add_special_tokens is not None else chats is None
    if job.late_chunking is not None and raw is not None:
        late = LatePlan(job.late_chunking, raw.texts or (), len(prompt or ""), specials)
        return Plan(params, len(raw), lambda: _late_batch(late, params, engine, model, state))
    truncation = truncation_for(job.truncate, model)

    async def run() -> Batch:
        inputs = raw
        if chats is not None:  # vLLM's chat forms: their template adds the special tokens
            trusted = state.settings.trust_request_chat_template
            texts = await render_conversations(chats, model, trusted, on_reject)
            inputs = RawInputs(tuple(texts), None)
        assert inputs is not None
        pooled = params
        if prompt is not None:
            pooled = await _prompt_params(model, prompt, params, specials, on_reject)
        return Batch(pooled, await tokenize(inputs, model, truncation, on_reject, specials))

    return Plan(params, len(chats) if chats is not None else len(raw or ()), run)


async def _late_batch(
    plan: LatePlan,
    params: PoolingParams,
    engine: EngineClient,
    model: ModelHandle,
    state: ServiceState,
) -> Batch:
    """Each text whole, its spans as token ranges in the parameters (one entry per prompt)."""
    limit, on_reject = state.settings.max_client_batch_size, state.metrics.on_reject
    ids, spans, chars = await late_prompts(plan, model, engine.max_model_len, limit, on_reject)
    return Batch(replace(params, token_spans=spans), ids, char_spans=chars)


async def _prompt_params(
    model: ModelHandle,
    prompt: str,
    params: PoolingParams,
    add_special_tokens: bool,
    on_reject: Callable[[str], None],
) -> PoolingParams:
    """With include_prompt: false, an embedding pools past the prompt's tokens."""
    if model.prompts.include_prompt or params.task is not PoolingTask.EMBED:
        return params
    count = await run_budgeted(
        model,
        len(prompt),
        on_reject,
        prompt_length,
        model.tokenizer,
        prompt,
        add_special_tokens,
        inline=True,
    )
    return replace(params, prompt_tokens=count)


def _plan_pairs(
    job: ScoreJob, engine: EngineClient, model: ModelHandle, state: ServiceState
) -> Plan:
    """One prompt per pair (laid out as the model was trained), or one per text to compare."""
    check_pairs(job, state.settings.max_client_batch_size)
    task, joint = job.task, True
    if task is PoolingTask.SCORE:
        scorer = scorer_plan(engine.pooling_info)
        task, joint = scorer.task, scorer.mode is PairMode.JOINT
    if not joint and job.use_activation is not None:
        logger.debug("use_activation ignored: %s compares embeddings", model.served_name)
    requested = Requested(use_activation=job.use_activation if joint else None)
    params = merge(task, requested, model.defaults)
    truncation = truncation_for(job.truncate, model)
    cuts = PairTruncation(
        truncation.keep,
        truncation.side,
        job.max_tokens_per_doc,
        job.max_tokens_per_query,
        truncation.most(model),
    )
    mode = _joint_mode(model, engine.pooling_info.is_decoder) if joint else PromptMode.SEPARATE
    # decoders take no token type ids, whatever the tokenizer's pair template gives
    typed_model = model.card.num_token_types > 0

    async def run() -> Batch:
        prompts = await tokenize_job(job, model, mode, cuts, state.metrics.on_reject)
        types = [p.token_type_ids for p in prompts]
        typed = typed_model and any(t is not None for t in types)
        return Batch(params, [p.token_ids for p in prompts], types if typed else None)

    count = len(job.pairs) if joint else len(job.queries) + len(job.documents)
    return Plan(params, count, run)


def _joint_mode(model: ModelHandle, is_decoder: bool) -> PromptMode:
    """vLLM's layout of a pair (use_sep_token): the tokenizer's pair template, or, for an LLM
    read through LM-head rows, the two texts as one; a decoder tokenizer without a pair
    template joins the two texts too, as tokenizer(query, document) then does."""
    if not model.card.spec.pair_separator:
        return PromptMode.CONCATENATE
    if is_decoder and model.pair_template is None:
        return PromptMode.CONCATENATE
    return PromptMode.TEMPLATE


# job kind -> how it is checked and tokenized; everything else is the same for every job
PLANNERS: dict[type, Callable[..., Plan]] = {TextJob: _plan_texts, ScoreJob: _plan_pairs}


async def gather(run: Submitted) -> list[PoolingOutput]:
    """All outputs in input order; a caller that goes away cancels the rest of its work."""
    if not run.futures:
        return []
    finished = asyncio.get_running_loop().create_future()
    left = len(run.futures)

    def on_done(future: asyncio.Future[PoolingOutput]) -> None:
        nonlocal left
        left -= 1
        # the first failure ends the wait: its error is the answer, the rest is cancelled
        failed = future.cancelled() or future.exception() is not None
        if (failed or left == 0) and not finished.done():
            finished.set_result(None)

    for future in run.futures:
        future.add_done_callback(on_done)
    watcher = asyncio.ensure_future(run.caller.left())
    try:
        await asyncio.wait((finished, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not finished.done():
            raise ClientDisconnectedError("the client closed the connection")
        # every future is done unless one failed; then the first failure in input order raises
        outputs = [_output(f) for f in run.futures if f.done()]
        run.trace.add_outputs(outputs)
        return outputs if run.slicing is None else run.slicing.join(outputs)
    finally:
        watcher.cancel()
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

"""Runs one HTTP request's inputs through the engine: admission, tokenization, submit, await."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace

from fastapi import Request

from poolserve.pooling.params import PoolingParams, PoolingTask
from poolserve.scheduler.engine import Engine
from poolserve.scheduler.errors import DrainingError
from poolserve.scheduler.request import PoolingOutput
from poolserve.service.chat import render_messages
from poolserve.service.errors import (
    ClientDisconnectedError,
    ModelNotFoundError,
    NotReadyError,
    ShutdownError,
)
from poolserve.service.inputs import (
    RawInputs,
    check_prompt,
    run_budgeted,
    split_input,
    tokenize,
    truncation_for,
)
from poolserve.service.logs import PROMPT_TOKENS_KEY
from poolserve.service.prompts import prepend, prompt_length
from poolserve.service.schemas import InputBody, PromptFields
from poolserve.service.state import ModelHandle, ServiceState
from poolserve.service.tracing import NO_TRACE, RequestTrace, SpanRecord, trace_of


@dataclass(frozen=True)
class Submitted:
    """An HTTP request's inputs, admitted and queued in the engine."""

    engine: Engine
    model: ModelHandle
    futures: tuple[asyncio.Future[PoolingOutput], ...]
    num_prompt_tokens: int
    trace: RequestTrace = NO_TRACE


def service_state(request: Request) -> ServiceState:
    """The server state attached to the app."""
    state: ServiceState = request.app.state.poolserve
    return state


def check_serving(state: ServiceState, model_name: str | None) -> tuple[Engine, ModelHandle]:
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


async def submit(
    request: Request,
    body: InputBody,
    task: PoolingTask,
    params: PoolingParams,
    *,
    truncate: bool | None = None,
) -> Submitted:
    """Admission check, then tokenization off the loop, then all-or-nothing submission.

    `truncate` is a client's yes/no (TEI's): None follows --auto-truncate, False refuses long
    inputs even under it.
    """
    state = service_state(request)
    request.state.task = task.value
    engine, model = check_serving(state, body.model)
    chat = body.messages is not None
    raw = None if chat else split_input(body.input, state.settings.max_client_batch_size)
    prompt = None if raw is None else _prompt(raw, model, body)
    if raw is not None and prompt is not None:
        check_prompt(prompt, len(raw), model)
        raw = RawInputs(prepend(prompt, raw.texts or ()), None)
        params = await _prompt_params(model, prompt, params, state.metrics.on_reject)
    engine.check_params(params)
    engine.precheck(1 if raw is None else len(raw))  # 429 before any tokenization work
    truncation = truncation_for(
        body.truncate_prompt_tokens, body.truncation_side, model, truncate=truncate
    )
    started = time.monotonic()
    if raw is None:  # vLLM's chat form: one conversation, its template adds the specials
        trusted = state.settings.trust_request_chat_template
        text = await render_messages(body, model, trusted, state.metrics.on_reject)
        raw = RawInputs((text,), None)
    # vLLM's defaults: special tokens added to input, not on top of a chat template's
    add_special_tokens = (
        body.add_special_tokens if body.add_special_tokens is not None else not chat
    )
    prompts = await tokenize(raw, model, truncation, state.metrics.on_reject, add_special_tokens)
    num_tokens = sum(len(p) for p in prompts)
    tokenized(request, started, len(prompts), num_tokens)
    futures = engine.submit_many(prompts, params, body.priority)
    admitted(request, num_tokens)
    return Submitted(engine, model, tuple(futures), num_tokens, trace_of(request))


def tokenized(request: Request, started: float, num_inputs: int, num_tokens: int) -> None:
    """Account a request's tokenization (from time.monotonic() `started`): metric and span."""
    ended = time.monotonic()
    service_state(request).metrics.tokenization.observe(ended - started)
    attributes = {"poolserve.inputs": num_inputs, "poolserve.prompt_tokens": num_tokens}
    trace_of(request).record(SpanRecord("tokenize", started, ended, attributes))


def admitted(request: Request, num_tokens: int) -> None:
    """Account prompt tokens the engine took: the metric, the access log, the request span."""
    service_state(request).metrics.prompt_tokens.inc(num_tokens)
    request.scope.setdefault("state", {})[PROMPT_TOKENS_KEY] = num_tokens
    task = str(getattr(request.state, "task", "none"))
    trace_of(request).set({"poolserve.prompt_tokens": num_tokens, "poolserve.task": task})


async def encoded(request: Request, work: Callable[..., bytes], *args: object) -> bytes:
    """A response body encoded in a worker thread, as the request's `encode` span."""
    started = time.monotonic()
    body = await asyncio.to_thread(work, *args)
    attributes = {"poolserve.output_bytes": len(body)}
    trace_of(request).record(SpanRecord("encode", started, time.monotonic(), attributes))
    return body


def _prompt(raw: RawInputs, model: ModelHandle, body: InputBody) -> str | None:
    """The request's (or the default) sentence-transformers prompt for its texts."""
    name, text = (body.prompt_name, body.prompt) if isinstance(body, PromptFields) else (None, None)
    return model.prompts.resolve(name, text, texts=raw.texts is not None)


async def _prompt_params(
    model: ModelHandle, prompt: str, params: PoolingParams, on_reject: Callable[[str], None]
) -> PoolingParams:
    """With include_prompt: false, an embedding pools past the prompt's tokens."""
    if model.prompts.include_prompt or params.task is not PoolingTask.EMBED:
        return params
    count = await run_budgeted(
        model, len(prompt), on_reject, prompt_length, model.tokenizer, prompt
    )
    return replace(params, prompt_tokens=count)


async def gather(request: Request, run: Submitted) -> list[PoolingOutput]:
    """All outputs in input order; a client that goes away cancels the rest of its work."""
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
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((finished, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not finished.done():
            raise ClientDisconnectedError("the client closed the connection")
        # every future is done unless one failed; then the first failure in input order raises
        outputs = [_output(f) for f in run.futures if f.done()]
        trace_of(request).add_outputs(outputs)
        return outputs
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
    """(index, output) as each input finishes; closing the iterator cancels the rest."""
    index_of = {f: i for i, f in enumerate(run.futures)}
    pending: set[asyncio.Future[PoolingOutput]] = set(run.futures)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=index_of.__getitem__):
                output = _output(future)
                run.trace.add_outputs((output,))
                yield index_of[future], output
    finally:
        _cancel_unfinished(run)


def _cancel_unfinished(run: Submitted) -> None:
    for future in run.futures:
        if not future.done():
            run.engine.cancel_future(future)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def timing_headers(outputs: Sequence[PoolingOutput]) -> dict[str, str]:
    """x-queue-time and x-inference-time: the slowest input's, in seconds."""
    return {
        "x-queue-time": f"{max(o.queue_time_s for o in outputs):.6f}",
        "x-inference-time": f"{max(o.inference_time_s for o in outputs):.6f}",
    }

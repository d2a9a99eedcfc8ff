"""Validation of per-request pooling parameters against the model that will serve them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from typing import NoReturn

from poolserve.types.errors import InvalidPoolingParamsError, UnsupportedTaskError
from poolserve.types.model_info import PoolingModelInfo, get_supported_tasks
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PUBLIC_TASKS, TASKS, HeadKind, PoolingTask

# Optional request field -> the tasks that accept it (TASKS declares each task's fields), in
# the order of PoolingParams' fields: the order in which a request's fields are checked. The
# adapter picks the forward's weights, whatever the task: the engine checks it against the model.
FIELD_TASKS: dict[str, frozenset[PoolingTask]] = {
    f.name: frozenset(t for t, d in TASKS.items() if f.name in d.params)
    for f in fields(PoolingParams)
    if f.name not in ("task", "adapter")
}

# Parameters that also need a particular head (steps exist only for process reward models).
FIELD_HEADS: dict[str, frozenset[HeadKind]] = {
    "step_tag_id": frozenset({HeadKind.PROCESS_REWARD}),
    "returned_token_ids": frozenset({HeadKind.PROCESS_REWARD}),
}


def _check_dimensions(info: PoolingModelInfo, params: PoolingParams) -> None:
    """Matryoshka truncation must be declared by the model and within its output size."""
    dimensions = params.dimensions
    if dimensions is None:
        return
    size = info.embedding_size
    if dimensions <= 0:
        raise InvalidPoolingParamsError("dimensions", f"must be positive, got {dimensions}")
    if dimensions > size:
        raise InvalidPoolingParamsError(
            "dimensions", f"{dimensions} exceeds the model's embedding size {size}"
        )
    if not info.supports_matryoshka:
        raise InvalidPoolingParamsError(
            "dimensions", "this model does not support Matryoshka dimensions"
        )
    allowed = info.matryoshka_dimensions
    if allowed is not None and dimensions not in allowed:
        raise InvalidPoolingParamsError(
            "dimensions", f"{dimensions} is not one of the model's dimensions {sorted(allowed)}"
        )


def _check_step_tag_id(info: PoolingModelInfo, params: PoolingParams) -> None:
    """A step tag is a token id, hence non-negative."""
    step_tag_id = params.step_tag_id
    if step_tag_id is not None and step_tag_id < 0:
        raise InvalidPoolingParamsError("step_tag_id", f"must be >= 0, got {step_tag_id}")


def _check_returned_token_ids(info: PoolingModelInfo, params: PoolingParams) -> None:
    """Selected label columns must exist in the reward head."""
    ids = params.returned_token_ids
    if ids is None:
        return
    num_labels = info.num_labels if info.num_labels is not None else 0
    if not ids:
        raise InvalidPoolingParamsError("returned_token_ids", "must not be empty")
    bad = [i for i in ids if not 0 <= i < num_labels]
    if bad:
        raise InvalidPoolingParamsError(
            "returned_token_ids", f"{bad} out of range for {num_labels} labels"
        )


def _check_prompt_tokens(info: PoolingModelInfo, params: PoolingParams) -> None:
    """A count of tokens, hence non-negative."""
    if params.prompt_tokens is not None and params.prompt_tokens < 0:
        raise InvalidPoolingParamsError(
            "prompt_tokens", f"must be >= 0, got {params.prompt_tokens}"
        )


def _check_token_spans(info: PoolingModelInfo, params: PoolingParams) -> None:
    """Late chunking: every prompt has spans, each a non-empty range of token positions."""
    spans = params.token_spans or ()
    if params.prompt_tokens is not None:
        raise InvalidPoolingParamsError("token_spans", "cannot be combined with prompt_tokens")
    if not spans:
        raise InvalidPoolingParamsError("token_spans", "must hold one prompt's spans or more")
    for index, ranges in enumerate(spans):
        if not ranges:
            raise InvalidPoolingParamsError("token_spans", f"prompt {index} has no spans")
        bad = next(((s, e) for s, e in ranges if not 0 <= s < e), None)
        if bad is not None:
            raise InvalidPoolingParamsError(
                "token_spans",
                f"[{bad[0]}, {bad[1]}) of prompt {index} is not a range 0 <= start < end",
            )


FIELD_CHECKS: dict[str, Callable[[PoolingModelInfo, PoolingParams], None]] = {
    "prompt_tokens": _check_prompt_tokens,
    "token_spans": _check_token_spans,
    "dimensions": _check_dimensions,
    "step_tag_id": _check_step_tag_id,
    "returned_token_ids": _check_returned_token_ids,
}


def check_task(info: PoolingModelInfo, task: PoolingTask) -> None:
    """Raise `UnsupportedTaskError` naming the supported tasks when the model cannot run
    `task` (an internal task included: the server submits those itself)."""
    if task not in info.runnable_tasks:
        _unsupported(info, task)


def check_public(info: PoolingModelInfo, task: PoolingTask) -> None:
    """A task a client named: an internal one (the server submits it for a route of its own)
    is refused as a task the model lacks; any other is checked with the parameters."""
    if task not in PUBLIC_TASKS:
        _unsupported(info, task)


def _unsupported(info: PoolingModelInfo, task: PoolingTask) -> NoReturn:
    """UnsupportedTaskError naming the tasks the model offers."""
    supported = get_supported_tasks(info)
    raise UnsupportedTaskError(task.value, [t.value for t in supported])


def validate_params(info: PoolingModelInfo, params: PoolingParams) -> None:
    """Raise a typed error when the task or any parameter does not fit this model."""
    check_task(info, params.task)
    for name, tasks in FIELD_TASKS.items():
        value = getattr(params, name)
        if value is None:
            continue
        if params.task not in tasks:
            raise InvalidPoolingParamsError(name, f"does not apply to task {params.task.value!r}")
        heads = FIELD_HEADS.get(name)
        if heads is not None and info.head_kind not in heads:
            raise InvalidPoolingParamsError(name, "applies to process reward models only")
        check = FIELD_CHECKS.get(name)
        if check is not None:
            check(info, params)


def prompt_params(params: PoolingParams, lengths: Sequence[int]) -> list[PoolingParams]:
    """Each prompt's parameters: with late chunking, its own spans, checked to lie within it.

    One submission carries one set of parameters; `token_spans` holds an entry per prompt, and
    each prompt's request gets the parameters holding only its entry.
    """
    spans = params.token_spans
    if spans is None:
        return [params] * len(lengths)
    if len(spans) != len(lengths):
        raise InvalidPoolingParamsError(
            "token_spans", f"holds spans of {len(spans)} prompts for {len(lengths)} prompts"
        )
    for index, (ranges, length) in enumerate(zip(spans, lengths, strict=True)):
        if len(ranges) > length:  # each span needs a token: a bound on the pooling work
            raise InvalidPoolingParamsError(
                "token_spans", f"prompt {index} has {len(ranges)} spans for {length} tokens"
            )
        past = next(((s, e) for s, e in ranges if e > length), None)
        if past is not None:
            raise InvalidPoolingParamsError(
                "token_spans",
                f"[{past[0]}, {past[1]}) lies past the {length} tokens of prompt {index}",
            )
    return [replace(params, token_spans=(ranges,)) for ranges in spans]


def request_spans(params: PoolingParams) -> tuple[tuple[int, int], ...] | None:
    """The token spans of the one prompt these parameters pool (None: no late chunking)."""
    if params.token_spans is None:
        return None
    if len(params.token_spans) != 1:
        raise InvalidPoolingParamsError(
            "token_spans", f"one prompt's request holds {len(params.token_spans)} prompts' spans"
        )
    return params.token_spans[0]

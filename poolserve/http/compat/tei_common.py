"""What TEI's routes share: bodies, TEI's error shape, truncation and prompt rules, timing headers.

Shapes and rules read from TEI's router and core (`router/src/http/types.rs`, `server.rs`,
`router/src/lib.rs`, `core/src/tokenization.rs`, `core/src/infer.rs`), TEI 1.9.3.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from fastapi import Request
from starlette.responses import Response

from poolserve.frontend.encoding import JSON, Encoded, dumps
from poolserve.frontend.jobs import Job, Truncate
from poolserve.frontend.pipeline import check_serving, gather
from poolserve.frontend.state import ModelHandle
from poolserve.http.bodies import RequestBody
from poolserve.http.calls import answer, service_state, submit
from poolserve.http.errors import ERROR_FAMILY_KEY, TEI_FAMILY
from poolserve.http.routing import StrictJSONRoute
from poolserve.types.errors import InvalidRequestError
from poolserve.types.outputs import PoolingOutput

# TEI's enum takes its variant names and their lower-case aliases
Direction = Literal["left", "right", "Left", "Right"]


class TEIBody(RequestBody):
    """A TEI body: fields TEI does not define are ignored with a log line, as TEI ignores them.

    huggingface_hub's InferenceClient adds fields of its own (`parameters`, `encoding_format`).
    vLLM's and Voyage's names for TEI's own choices are refused rather than dropped.
    """

    foreign_fields: ClassVar[Mapping[str, str]] = {
        "truncate_prompt_tokens": "vLLM's and not honoured on TEI's routes: send truncate",
        "truncation_side": "vLLM's and not honoured on TEI's routes: send truncation_direction",
        "input_type": "Cohere's, Voyage's and NIM's and not honoured on TEI's routes: send "
        "prompt_name",
    }


def mark(request: Request) -> None:
    """Errors of this request answer in TEI's shape (`{"error", "error_type"}`, TEI's statuses)."""
    request.scope.setdefault("state", {})[ERROR_FAMILY_KEY] = TEI_FAMILY


class TEIRoute(StrictJSONRoute):
    """A route only TEI's clients call: its body and validation errors answer in TEI's shape."""

    error_family = TEI_FAMILY


def empty(field: str) -> InvalidRequestError:
    """TEI's one 400 (`Empty`): an empty batch, text or id list."""
    return InvalidRequestError(f"`{field}` cannot be empty", field, "empty")


def truncation(truncate: bool | None, direction: Direction) -> Truncate:
    """TEI's truncation: unset or `true` cuts at the model's limit, `false` refuses longer inputs.

    Since TEI 1.9 `--auto-truncate` defaults to true, so a request that leaves `truncate` unset
    is truncated; these routes do so whatever this server's --auto-truncate says (that flag keeps
    vLLM's meaning on the native routes).
    """
    side: Literal["left", "right"] = "left" if direction.lower() == "left" else "right"
    if truncate is False:
        return Truncate(None, side, False)
    return Truncate(-1, side, True)


def default_model(request: Request) -> ModelHandle:
    """The model TEI's routes serve: they name none, so the server's default model (503 unless
    ready)."""
    return check_serving(service_state(request), None)[1]


def prompt_for(request: Request, asked: str | None) -> tuple[str | None, str | None]:
    """A text job's (prompt_name, prompt) by TEI's rule: the request's prompt_name, else the
    server's --default-prompt-name (the default model's), else none at all.

    TEI reads no default from the model's `default_prompt_name`: the empty literal prompt keeps
    the pipeline from applying it.
    """
    name = asked if asked is not None else default_model(request).settings.default_prompt_name
    return (name, None) if name is not None else (None, "")


def characters(items: Sequence[str | Sequence[int]]) -> int:
    """TEI's x-compute-characters: characters of each text, one per token id."""
    return sum(len(item) for item in items)


@dataclass(frozen=True)
class Ran:
    """Outputs of a request's jobs, with what TEI's timing headers report about them."""

    outputs: tuple[PoolingOutput, ...] = ()
    tokenization_s: float = 0.0  # summed over inputs: TEI averages its per-input times
    characters: int = 0

    def __add__(self, other: Ran) -> Ran:
        return Ran(
            self.outputs + other.outputs,
            self.tokenization_s + other.tokenization_s,
            self.characters + other.characters,
        )

    @classmethod
    def of(cls, outputs: Sequence[PoolingOutput], took_s: float, chars: int) -> Ran:
        """A job that took `took_s` from its submission call to its last output."""
        # all of a job's prompts enter the engine at once, so the slowest one's queue plus
        # inference time is the job's time after submission: the rest went to the checks and
        # tokenization, TEI's tokenization time
        engine_s = max((o.queue_time_s + o.inference_time_s for o in outputs), default=0.0)
        return cls(tuple(outputs), max(0.0, took_s - engine_s) * len(outputs), chars)


async def run(request: Request, job: Job, chars: int) -> Ran:
    """One job through the pipeline; `chars`: its characters as TEI counts them."""
    started = time.monotonic()
    outputs = await gather(await submit(request, job))
    return Ran.of(outputs, time.monotonic() - started, chars)


def _ms(seconds: float) -> str:
    return str(int(seconds * 1000))  # TEI's Duration::as_millis: whole milliseconds


def timing_headers(request: Request, started: float, ran: Ran) -> dict[str, str]:
    """TEI's response headers: times in whole milliseconds, per-input times averaged."""
    count = max(len(ran.outputs), 1)
    total = _ms(time.monotonic() - started)
    model = service_state(request).model  # TEI's routes serve the default model
    return {
        # TEI writes "gpu+optimized" whatever it runs on; this says the device
        "x-compute-type": model.device if model is not None else "cpu",
        "x-compute-time": total,
        "x-compute-characters": str(ran.characters),
        "x-compute-tokens": str(sum(o.num_prompt_tokens for o in ran.outputs)),
        "x-total-time": total,
        "x-tokenization-time": _ms(ran.tokenization_s / count),
        "x-queue-time": _ms(sum(o.queue_time_s for o in ran.outputs) / count),
        "x-inference-time": _ms(sum(o.inference_time_s for o in ran.outputs) / count),
    }


async def reply(
    request: Request, started: float, ran: Ran, build: Callable[[], object]
) -> Response:
    """The document `build` makes, encoded off the loop, with TEI's headers (they replace the
    service's timing headers, which are in seconds)."""
    headers = timing_headers(request, started, ran)
    return await answer(request, ran.outputs, lambda: Encoded(dumps(build()), JSON, headers))


def best_first(scores: Sequence[float]) -> list[int]:
    """Indices by descending score; ties in reverse index order (TEI sorts, then reverses)."""
    return sorted(range(len(scores)), key=scores.__getitem__)[::-1]

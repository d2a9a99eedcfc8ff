"""What TEI's request bodies share: unknown fields ignored (as serde does), truncation fields.

Shapes read from TEI's router (`router/src/http/types.rs`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from poolserve.pooling.params import PoolingParams, PoolingTask
from poolserve.scheduler.request import PoolingOutput
from poolserve.service.encoding import dumps
from poolserve.service.runs import encoded, service_state, timing_headers
from poolserve.service.schemas import RequestBody

logger = logging.getLogger(__name__)

B = TypeVar("B", bound=BaseModel)
# TEI's enum takes its variant names and their lower-case aliases
Direction = Literal["left", "right", "Left", "Right"]


class TEIBody(RequestBody):
    """A TEI body: fields TEI does not define are ignored with a log line, as TEI ignores them.

    huggingface_hub's InferenceClient adds fields of its own (`parameters`, `encoding_format`).
    """


def truncation(truncate: bool | None, direction: Direction) -> dict[str, Any]:
    """The service's truncation fields: TEI's `truncate` cuts to the model's limit."""
    return {
        # without truncate a prompt above the model's limit is refused, as TEI does
        "truncate_prompt_tokens": -1 if truncate else None,
        "truncation_side": "left" if direction.lower() == "left" else "right",
    }


def embed_params(request: Request, task: PoolingTask, **given: Any) -> PoolingParams:
    """Pooling parameters: the request's values, else the server's --pooler-config defaults."""
    model = service_state(request).model
    defaults = model.defaults if model is not None else None
    merged = {
        k: v if v is not None or defaults is None else getattr(defaults, k, None)
        for k, v in given.items()
    }
    return PoolingParams(task=task, **merged)


def best_first(scores: Sequence[float]) -> list[int]:
    """Indices by descending score; ties in reverse index order (TEI sorts, then reverses)."""
    return sorted(range(len(scores)), key=scores.__getitem__)[::-1]


async def answer(request: Request, document: object, outputs: Sequence[PoolingOutput]) -> Response:
    """TEI's JSON (float32 numbers as written) with the timing headers; its bytes counted."""
    body = await encoded(request, dumps, document)
    service_state(request).metrics.output_bytes.inc(len(body))
    return Response(body, media_type="application/json", headers=timing_headers(outputs))


def validated(model: type[B], payload: dict[str, Any]) -> B:
    """A route's body read as `model` (one path, two shapes); problems answer 400 as usual."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False), body=payload) from None


def body_schema(*models: type[BaseModel]) -> dict[str, Any]:
    """An OpenAPI request body that is any one of the models."""
    schemas = [m.model_json_schema() for m in models]
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"anyOf": schemas}}},
        }
    }

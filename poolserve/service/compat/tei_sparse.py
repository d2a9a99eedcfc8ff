"""TEI's `POST /embed_sparse`: SPLADE weights as `[[{"index": id, "value": weight}, ...], ...]`."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from pydantic import StrictStr
from starlette.responses import Response

from poolserve.pooling.params import PoolingParams, PoolingTask
from poolserve.scheduler.request import PoolingOutput
from poolserve.service.compat.tei_common import TEIBody
from poolserve.service.encoding import StrictJSONRoute, dumps, sparse_parts
from poolserve.service.runs import encoded, gather, service_state, submit, timing_headers
from poolserve.service.schemas import EmbeddingRequest, Input

router = APIRouter(route_class=StrictJSONRoute)


class EmbedSparseRequest(TEIBody):
    """TEI's embed_sparse body (fields TEI does not define are ignored, as TEI ignores them)."""

    inputs: Input
    truncate: bool | None = None  # TEI's default: a prompt above the model's limit is an error
    truncation_direction: Literal["left", "right", "Left", "Right"] = "right"
    prompt_name: StrictStr | None = None


@router.post("/embed_sparse")
async def embed_sparse(body: EmbedSparseRequest, request: Request) -> Response:
    """The non-zero SPLADE weights of each input, ascending by vocabulary id."""
    own = EmbeddingRequest(
        input=body.inputs,
        prompt_name=body.prompt_name,
        truncate_prompt_tokens=-1 if body.truncate else None,
        truncation_side="left" if body.truncation_direction.lower() == "left" else "right",
    )
    task = PoolingTask.EMBED_SPARSE
    run = await submit(request, own, task, PoolingParams(task=task), truncate=body.truncate)
    outputs = await gather(request, run)
    answer = await encoded(request, _encode, outputs)
    service_state(request).metrics.output_bytes.inc(len(answer))
    return Response(answer, media_type="application/json", headers=timing_headers(outputs))


def _encode(outputs: list[PoolingOutput]) -> bytes:
    """TEI's response: one list of {index, value} per input (float32 weights as written)."""
    return dumps([_pairs(output) for output in outputs])


def _pairs(output: PoolingOutput) -> list[dict[str, object]]:
    ids, weights = sparse_parts(output.data)
    # numpy float32 scalars: orjson writes each weight's shortest float32 form, as TEI does
    return [{"index": i, "value": w} for i, w in zip(ids.tolist(), weights, strict=True)]

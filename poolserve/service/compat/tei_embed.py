"""TEI's `POST /embed`, `/embed_all` and `/similarity` through the service's own embed path."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictStr
from starlette.responses import Response

from poolserve.pooling.params import PoolingTask
from poolserve.scheduler.request import PoolingOutput
from poolserve.service.compat.tei_common import Direction, TEIBody, answer, embed_params, truncation
from poolserve.service.encoding import StrictJSONRoute
from poolserve.service.errors import InvalidRequestError
from poolserve.service.runs import gather, submit
from poolserve.service.schemas import EmbeddingRequest, Input

router = APIRouter(route_class=StrictJSONRoute)


class EmbedRequest(TEIBody):
    """TEI's `EmbedRequest`."""

    inputs: Input
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: StrictStr | None = None
    normalize: bool = True  # TEI's default
    dimensions: int | None = None


class EmbedAllRequest(TEIBody):
    """TEI's `EmbedAllRequest`: every token's hidden state."""

    inputs: Input
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: StrictStr | None = None


class SimilarityInput(BaseModel):
    """TEI's `SimilarityInput`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source_sentence: StrictStr
    sentences: list[StrictStr]


class SimilarityParameters(TEIBody):
    """TEI's `SimilarityParameters`."""

    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: StrictStr | None = None


class SimilarityRequest(TEIBody):
    """TEI's `SimilarityRequest` (what InferenceClient.sentence_similarity sends)."""

    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None


async def _run(
    request: Request,
    own: EmbeddingRequest,
    task: PoolingTask,
    truncate: bool | None,
    **params: object,
) -> list[PoolingOutput]:
    run = await submit(request, own, task, embed_params(request, task, **params), truncate=truncate)
    return await gather(request, run)


@router.post("/embed")
async def embed(body: EmbedRequest, request: Request) -> Response:
    """One pooled embedding per input, always a list of lists."""
    own = EmbeddingRequest(
        input=body.inputs,
        prompt_name=body.prompt_name,
        **truncation(body.truncate, body.truncation_direction),
    )
    outputs = await _run(
        request,
        own,
        PoolingTask.EMBED,
        body.truncate,
        dimensions=body.dimensions,
        normalize=body.normalize,
    )
    return await answer(request, [o.data for o in outputs], outputs)


@router.post("/embed_all")
async def embed_all(body: EmbedAllRequest, request: Request) -> Response:
    """Every token's final hidden state, not normalized: `[[[float]]]`."""
    own = EmbeddingRequest(
        input=body.inputs,
        prompt_name=body.prompt_name,
        **truncation(body.truncate, body.truncation_direction),
    )
    outputs = await _run(request, own, PoolingTask.TOKEN_EMBED, body.truncate, normalize=False)
    return await answer(request, [o.data for o in outputs], outputs)


@router.post("/similarity")
async def similarity(body: SimilarityRequest, request: Request) -> Response:
    """Cosine similarity of source_sentence to each of sentences."""
    if not body.inputs.sentences:
        raise InvalidRequestError("inputs.sentences must not be empty", "inputs.sentences")
    parameters = body.parameters or SimilarityParameters()
    own = EmbeddingRequest(
        input=[body.inputs.source_sentence, *body.inputs.sentences],
        prompt_name=parameters.prompt_name,
        **truncation(parameters.truncate, parameters.truncation_direction),
    )
    outputs = await _run(request, own, PoolingTask.EMBED, parameters.truncate, normalize=False)
    return await answer(request, _cosines(outputs), outputs)


def _cosines(outputs: list[PoolingOutput]) -> list[float]:
    """Cosine of the first embedding with each of the others, in float32 as TEI computes it."""
    rows = np.stack([o.data.astype(np.float32) for o in outputs])  # [n, dim]
    norms = np.linalg.norm(rows, axis=1)  # [n]
    norms[norms == 0] = 1.0  # a zero vector has cosine 0 with everything
    return [float(v) for v in (rows[1:] @ rows[0]) / (norms[1:] * norms[0])]

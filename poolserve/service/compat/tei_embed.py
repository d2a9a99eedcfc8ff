"""TEI's `POST /embed`, `/embed_all`, `/similarity` and `/embed_sparse` as embed jobs."""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictStr
from starlette.responses import Response

from poolserve.pooling.params import PoolingTask
from poolserve.scheduler.request import PoolingOutput
from poolserve.service.compat.tei_common import Direction, TEIBody, truncation
from poolserve.service.errors import InvalidRequestError
from poolserve.service.frontend.bodies import Input
from poolserve.service.frontend.encoding import StrictJSONRoute, answer, dumps, sparse_parts
from poolserve.service.frontend.jobs import Requested, TextJob
from poolserve.service.frontend.pipeline import gather, submit

router = APIRouter(route_class=StrictJSONRoute)


class TextOptions(TEIBody):
    """What TEI's text bodies share: truncation and the prompt."""

    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: StrictStr | None = None


class EmbedAllRequest(TextOptions):
    """TEI's `EmbedAllRequest`: every token's hidden state."""

    inputs: Input


class EmbedSparseRequest(EmbedAllRequest):
    """TEI's `EmbedSparseRequest`: the same fields as `EmbedAllRequest`."""


class EmbedRequest(EmbedAllRequest):
    """TEI's `EmbedRequest`."""

    normalize: bool = True  # TEI's default
    dimensions: int | None = None


class SimilarityInput(BaseModel):
    """TEI's `SimilarityInput`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source_sentence: StrictStr
    sentences: list[StrictStr]


class SimilarityParameters(TextOptions):
    """TEI's `SimilarityParameters`."""


class SimilarityRequest(TEIBody):
    """TEI's `SimilarityRequest` (what InferenceClient.sentence_similarity sends)."""

    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None


async def _run(
    request: Request,
    task: PoolingTask,
    inputs: object,
    options: TextOptions,
    requested: Requested | None = None,
) -> list[PoolingOutput]:
    """The texts as one job through the pipeline, with the body's truncation and prompt."""
    job = TextJob(
        task,
        inputs,
        requested=requested or Requested(),
        prompt_name=options.prompt_name,
        truncate=truncation(options.truncate, options.truncation_direction),
    )
    return await gather(request, await submit(request, job))


@router.post("/embed")
async def embed(body: EmbedRequest, request: Request) -> Response:
    """One pooled embedding per input, always a list of lists."""
    requested = Requested(dimensions=body.dimensions, normalize=body.normalize)
    outputs = await _run(request, PoolingTask.EMBED, body.inputs, body, requested)
    return await answer(request, outputs, lambda: dumps([o.data for o in outputs]))


@router.post("/embed_all")
async def embed_all(body: EmbedAllRequest, request: Request) -> Response:
    """Every token's final hidden state, not normalized: `[[[float]]]`."""
    requested = Requested(normalize=False)
    outputs = await _run(request, PoolingTask.TOKEN_EMBED, body.inputs, body, requested)
    return await answer(request, outputs, lambda: dumps([o.data for o in outputs]))


@router.post("/similarity")
async def similarity(body: SimilarityRequest, request: Request) -> Response:
    """Cosine similarity of source_sentence to each of sentences."""
    if not body.inputs.sentences:
        raise InvalidRequestError("inputs.sentences must not be empty", "inputs.sentences")
    parameters = body.parameters or SimilarityParameters()
    texts = [body.inputs.source_sentence, *body.inputs.sentences]
    requested = Requested(normalize=False)
    outputs = await _run(request, PoolingTask.EMBED, texts, parameters, requested)
    return await answer(request, outputs, lambda: dumps(_cosines(outputs)))


def _cosines(outputs: list[PoolingOutput]) -> list[float]:
    """Cosine of the first embedding with each of the others, in float32 as TEI computes it."""
    rows = np.stack([o.data.astype(np.float32) for o in outputs])  # [n, dim]
    norms = np.linalg.norm(rows, axis=1)  # [n]
    norms[norms == 0] = 1.0  # a zero vector has cosine 0 with everything
    return [float(v) for v in (rows[1:] @ rows[0]) / (norms[1:] * norms[0])]


@router.post("/embed_sparse")
async def embed_sparse(body: EmbedSparseRequest, request: Request) -> Response:
    """The non-zero SPLADE weights of each input, ascending by vocabulary id:
    `[[{"index": id, "value": weight}, ...], ...]`."""
    outputs = await _run(request, PoolingTask.EMBED_SPARSE, body.inputs, body)
    return await answer(request, outputs, lambda: dumps([_sparse(o) for o in outputs]))


def _sparse(output: PoolingOutput) -> list[dict[str, object]]:
    ids, weights = sparse_parts(output.data)
    # numpy float32 scalars: orjson writes each weight's shortest float32 form, as TEI does
    return [{"index": i, "value": w} for i, w in zip(ids.tolist(), weights, strict=True)]

"""TEI's `POST /embed`, `/embed_all`, `/similarity` and `/embed_sparse` as embed jobs."""

from __future__ import annotations

import asyncio
import time
from typing import cast

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr
from starlette.responses import Response

from poolserve.frontend.encoding import sparse_parts
from poolserve.frontend.jobs import Requested, TextJob
from poolserve.frontend.texts import check_batch_size
from poolserve.http.bodies import TokenIds
from poolserve.http.compat.tei_common import (
    Direction,
    Ran,
    TEIBody,
    TEIRoute,
    characters,
    default_model,
    empty,
    prompt_for,
    reply,
    run,
    truncation,
)
from poolserve.types.errors import InvalidRequestError
from poolserve.types.outputs import PoolingOutput
from poolserve.types.tasks import PoolingTask

router = APIRouter(route_class=TEIRoute)

# TEI's `Input`: one text, one token-id list, or a batch of them, texts and id lists mixed
TEIInput = StrictStr | TokenIds | list[StrictStr | TokenIds]
Item = str | list[int]


class TextOptions(TEIBody):
    """What TEI's text bodies share: truncation and the prompt."""

    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: StrictStr | None = None


class EmbedAllRequest(TextOptions):
    """TEI's `EmbedAllRequest`: every token's hidden state."""

    inputs: TEIInput


class EmbedSparseRequest(EmbedAllRequest):
    """TEI's `EmbedSparseRequest`: the same fields as `EmbedAllRequest`."""


class EmbedRequest(EmbedAllRequest):
    """TEI's `EmbedRequest`."""

    normalize: bool = True  # TEI's default
    dimensions: StrictInt | None = None  # serde reads a usize: no strings


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


def _items(inputs: object) -> list[Item]:
    """TEI's reading of `inputs` (a flat id list is one input); 400 `Empty` for empty ones."""
    batch = isinstance(inputs, list) and bool(inputs) and not isinstance(inputs[0], int)
    items = cast(list[Item], inputs if batch else [inputs])
    if any(len(item) == 0 for item in items):
        raise empty("inputs")
    return items


async def _decoded(request: Request, items: list[Item]) -> list[Item]:
    """Prompted id lists as text: TEI decodes them (special tokens skipped), then encodes the
    prompt and that text as one string (`core/src/tokenization.rs`)."""
    if all(isinstance(item, str) for item in items):
        return items
    backend = default_model(request).tokenizer.backend_tokenizer

    def decode_all() -> list[Item]:
        return [
            item if isinstance(item, str) else backend.decode(item, skip_special_tokens=True)
            for item in items
        ]

    return await asyncio.to_thread(decode_all)


async def _run(
    request: Request,
    task: PoolingTask,
    inputs: object,
    options: TextOptions,
    requested: Requested | None = None,
) -> tuple[list[PoolingOutput], Ran]:
    """The inputs through the pipeline: texts as one job, token-id lists as another (the front
    end takes one kind per job), each output back in its input's place."""
    sent = _items(inputs)
    check_batch_size(len(sent), default_model(request).settings.max_client_batch_size, "inputs")
    name, prompt = prompt_for(request, options.prompt_name)
    items = sent if name is None else await _decoded(request, sent)
    texts = [i for i, item in enumerate(items) if isinstance(item, str)]
    ids = [i for i, item in enumerate(items) if not isinstance(item, str)]
    cut = truncation(options.truncate, options.truncation_direction)
    by_index: dict[int, PoolingOutput] = {}
    total = Ran()
    # token ids take no prompt: a prompted id list was decoded to text above
    for indices, prompted in ((texts, True), (ids, False)):
        if not indices:
            continue
        job = TextJob(
            task,
            [items[i] for i in indices],
            requested=requested or Requested(),
            prompt_name=name if prompted else None,
            prompt=prompt if prompted else None,
            truncate=cut,
        )
        ran = await run(request, job, characters([sent[i] for i in indices]))
        by_index.update(zip(indices, ran.outputs, strict=True))
        total += ran
    return [by_index[i] for i in range(len(items))], total


@router.post("/embed")
async def embed(body: EmbedRequest, request: Request) -> Response:
    """One pooled embedding per input, always a list of lists."""
    started = time.monotonic()
    dimensions = body.dimensions
    if dimensions is not None and dimensions <= 0:
        raise InvalidRequestError("`dimensions` should be positive", "dimensions")
    # with `dimensions`, TEI cuts any model's full embedding, then normalizes the cut itself
    requested = Requested(normalize=body.normalize if dimensions is None else False)
    outputs, ran = await _run(request, PoolingTask.EMBED, body.inputs, body, requested)
    vectors = [o.data for o in outputs]
    if dimensions is not None:
        vectors = [matryoshka_cut(v, dimensions, body.normalize) for v in vectors]
    return await reply(request, started, ran, lambda: vectors)


def matryoshka_cut(data: np.ndarray, dimensions: int, normalize: bool) -> np.ndarray:
    """TEI's Matryoshka cut (`core/src/infer.rs`): the first `dimensions` values, L2-normalized
    when asked, the norm summed in float64 and applied as a float32 scale."""
    if dimensions > data.shape[-1]:
        raise InvalidRequestError(
            f"`dimensions` should be smaller than the maximum embedding dimension "
            f"({data.shape[-1]}), got {dimensions}",
            "dimensions",
        )
    kept = np.asarray(data[:dimensions], dtype=np.float32)
    norm = float(np.sqrt(np.square(kept, dtype=np.float64).sum()))
    if not normalize or norm == 0.0:  # a zero vector stays zero rather than NaN
        return kept
    return kept * np.float32(1.0 / norm)


@router.post("/embed_all")
async def embed_all(body: EmbedAllRequest, request: Request) -> Response:
    """Every token's final hidden state, not normalized: `[[[float]]]`."""
    started = time.monotonic()
    requested = Requested(normalize=False)
    outputs, ran = await _run(request, PoolingTask.TOKEN_EMBED, body.inputs, body, requested)
    return await reply(request, started, ran, lambda: [o.data for o in outputs])


@router.post("/similarity")
async def similarity(body: SimilarityRequest, request: Request) -> Response:
    """Cosine similarity of source_sentence to each of sentences."""
    started = time.monotonic()
    if not body.inputs.sentences:
        raise empty("inputs.sentences")
    parameters = body.parameters or SimilarityParameters()
    texts = [body.inputs.source_sentence, *body.inputs.sentences]
    requested = Requested(normalize=False)
    outputs, ran = await _run(request, PoolingTask.EMBED, texts, parameters, requested)
    return await reply(request, started, ran, lambda: _cosines(outputs))


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
    started = time.monotonic()
    outputs, ran = await _run(request, PoolingTask.EMBED_SPARSE, body.inputs, body)
    return await reply(request, started, ran, lambda: [_sparse(o) for o in outputs])


def _sparse(output: PoolingOutput) -> list[dict[str, object]]:
    ids, weights = sparse_parts(output.data)
    # numpy float32 scalars: orjson writes each weight's shortest float32 form, as TEI does
    return [{"index": i, "value": w} for i, w in zip(ids.tolist(), weights, strict=True)]

"""TEI's `POST /predict`: single texts and pairs, classified through the service's classify task."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import APIRouter, Request
from pydantic import StrictStr
from starlette.responses import Response

from poolserve.pooling.params import PoolingParams, PoolingTask
from poolserve.scheduler.request import PoolingOutput
from poolserve.service.compat.tei_common import Direction, TEIBody, answer, best_first, truncation
from poolserve.service.encoding import StrictJSONRoute
from poolserve.service.errors import InvalidRequestError
from poolserve.service.inputs import check_batch_size, truncation_for
from poolserve.service.pairs import PairTruncation, PromptMode, ScoreJob, tokenize_job
from poolserve.service.runs import Submitted, check_serving, gather, service_state, submit
from poolserve.service.schemas import ClassifyRequest

router = APIRouter(route_class=StrictJSONRoute)


class PredictRequest(TEIBody):
    """TEI's `PredictRequest`: a text, a pair [a, b], or a batch of [a] and [a, b] items."""

    inputs: StrictStr | list[StrictStr] | list[list[StrictStr]]
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    raw_scores: bool = False


@dataclass(frozen=True)
class Sequences:
    """The parsed inputs: each a (text,) or (text, text); single = answer without a batch list."""

    items: tuple[tuple[str, ...], ...]
    single: bool


def parse_inputs(inputs: str | list[str] | list[list[str]]) -> Sequences:
    """TEI's reading of `inputs`: a string, a pair, or a batch of singles and pairs."""
    if isinstance(inputs, str):
        return Sequences(((inputs,),), single=True)
    if not inputs:
        raise InvalidRequestError("inputs must not be empty", "inputs")
    if isinstance(inputs[0], str):
        if len(inputs) > 2:
            raise InvalidRequestError("inputs must be a text or a pair of two texts", "inputs")
        return Sequences((tuple(inputs),), single=True)
    bad = [i for i, item in enumerate(inputs) if len(item) not in (1, 2)]
    if bad:
        raise InvalidRequestError(f"inputs {bad[0]} must hold one text or a pair", "inputs")
    return Sequences(tuple(tuple(item) for item in inputs), single=False)


@router.post("/predict")
async def predict(body: PredictRequest, request: Request) -> Response:
    """Each input's labels with scores, best first: `[{"score", "label"}]` (a list per input)."""
    sequences = parse_inputs(body.inputs)
    limit = service_state(request).settings.max_client_batch_size
    check_batch_size(len(sequences.items), limit, "inputs")
    params = PoolingParams(task=PoolingTask.CLASSIFY, use_activation=not body.raw_scores)
    singles = [i for i, item in enumerate(sequences.items) if len(item) == 1]
    pairs = [i for i, item in enumerate(sequences.items) if len(item) == 2]
    outputs: dict[int, PoolingOutput] = {}
    if singles:
        own = ClassifyRequest(
            input=[sequences.items[i][0] for i in singles],
            **truncation(body.truncate, body.truncation_direction),
        )
        run = await submit(request, own, PoolingTask.CLASSIFY, params, truncate=body.truncate)
        outputs.update(zip(singles, await gather(request, run), strict=True))
    if pairs:
        paired = await _classify_pairs(request, body, [sequences.items[i] for i in pairs], params)
        outputs.update(zip(pairs, paired, strict=True))
    ordered = [outputs[i] for i in range(len(sequences.items))]
    labels = service_state(request).model.loaded.spec.labels  # type: ignore[union-attr]
    found = [_predictions(o, labels) for o in ordered]
    return await answer(request, found[0] if sequences.single else found, ordered)


def _predictions(output: PoolingOutput, labels: tuple[str, ...]) -> list[dict[str, object]]:
    """Every label with its score, best first."""
    scores = [float(s) for s in output.data.reshape(-1)]
    names = [labels[i] if i < len(labels) else f"LABEL_{i}" for i in range(len(scores))]
    return [{"score": scores[i], "label": names[i]} for i in best_first(scores)]


async def _classify_pairs(
    request: Request,
    body: PredictRequest,
    pairs: list[tuple[str, ...]],
    params: PoolingParams,
) -> list[PoolingOutput]:
    """Pairs laid out as the tokenizer lays out two texts (encoders), then classified."""
    state = service_state(request)
    engine, model = check_serving(state, None)
    cut = truncation(body.truncate, body.truncation_direction)
    job = ScoreJob(
        queries=tuple(p[0] for p in pairs),
        documents=tuple(p[1] for p in pairs),
        pairs=tuple((i, i) for i in range(len(pairs))),
        query_field="inputs",
        document_field="inputs",
        **cut,
    )
    engine.check_params(params)
    engine.precheck(len(pairs))  # 429 before any tokenization work
    keep = truncation_for(
        cut["truncate_prompt_tokens"], cut["truncation_side"], model, truncate=body.truncate
    )
    mode = PromptMode.CONCATENATE if engine.pooling_info.is_decoder else PromptMode.TEMPLATE
    started = time.perf_counter()
    prompts = await tokenize_job(
        job, model, mode, PairTruncation(keep.keep, keep.side, None), state.metrics.on_reject
    )
    state.metrics.tokenization.observe(time.perf_counter() - started)
    types = [p.token_type_ids for p in prompts]
    futures = engine.submit_many(
        [p.token_ids for p in prompts],
        params,
        0,
        types if any(t is not None for t in types) else None,
    )
    num_tokens = sum(len(p.token_ids) for p in prompts)
    state.metrics.prompt_tokens.inc(num_tokens)
    return await gather(request, Submitted(engine, model, tuple(futures), num_tokens))

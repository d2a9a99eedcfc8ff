"""TEI's `POST /predict`: single texts and pairs, classified through the service's classify task."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import APIRouter, Request
from pydantic import StrictStr
from starlette.responses import Response

from poolserve.frontend.jobs import Requested, ScoreJob, TextJob
from poolserve.frontend.texts import check_batch_size
from poolserve.http.compat.tei_common import (
    Direction,
    Ran,
    TEIBody,
    TEIRoute,
    best_first,
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
    """Each input's labels with scores, best first: `[{"score", "label"}]` (a list per input).

    Single texts are one classify job, pairs another (laid out as the tokenizer lays out two
    texts): both through the one pipeline, each answered in its input's place.
    """
    started = time.monotonic()
    sequences = parse_inputs(body.inputs)
    model = default_model(request)
    labels = model.card.labels
    check_batch_size(len(sequences.items), model.settings.max_client_batch_size, "inputs")
    if any(not "".join(item) for item in sequences.items):  # TEI's empty text or pair
        raise empty("inputs")
    cut = truncation(body.truncate, body.truncation_direction)
    use_activation = not body.raw_scores
    singles = [i for i, item in enumerate(sequences.items) if len(item) == 1]
    pairs = [i for i, item in enumerate(sequences.items) if len(item) == 2]
    outputs: dict[int, PoolingOutput] = {}
    ran = Ran()
    if singles:
        texts = [sequences.items[i][0] for i in singles]
        # TEI prepends its --default-prompt(-name) to single texts, never to pairs
        name, prompt = prompt_for(request, None)
        job = TextJob(
            PoolingTask.CLASSIFY,
            texts,
            requested=Requested(use_activation=use_activation),
            prompt_name=name,
            prompt=prompt,
            truncate=cut,
        )
        alone = await run(request, job, characters(texts))
        outputs.update(zip(singles, alone.outputs, strict=True))
        ran += alone
    if pairs:
        paired = ScoreJob(
            queries=tuple(sequences.items[i][0] for i in pairs),
            documents=tuple(sequences.items[i][1] for i in pairs),
            pairs=tuple((n, n) for n in range(len(pairs))),
            query_field="inputs",
            document_field="inputs",
            truncate=cut,
            use_activation=use_activation,
            task=PoolingTask.CLASSIFY,
        )
        chars = characters([text for i in pairs for text in sequences.items[i]])
        together = await run(request, paired, chars)
        outputs.update(zip(pairs, together.outputs, strict=True))
        ran += together
    found = [labels_best_first(outputs[i], labels) for i in range(len(sequences.items))]
    return await reply(request, started, ran, lambda: found[0] if sequences.single else found)


def labels_best_first(output: PoolingOutput, labels: tuple[str, ...]) -> list[dict[str, object]]:
    """Every label with its score, best first."""
    scores = [float(s) for s in output.data.reshape(-1)]
    names = [labels[i] if i < len(labels) else f"LABEL_{i}" for i in range(len(scores))]
    return [{"score": scores[i], "label": names[i]} for i in best_first(scores)]

"""A scoring job's answer: one score per pair, from the head or by comparing two outputs."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from poolserve.pooling.scorers import scorer_plan
from poolserve.scheduler.request import PoolingOutput
from poolserve.service.frontend.jobs import ScoreJob
from poolserve.service.frontend.pipeline import gather, submit


@dataclass(frozen=True)
class Scored:
    """A job's scores in pair order, with what the answer reports about the run."""

    scores: tuple[float, ...]
    outputs: tuple[PoolingOutput, ...]
    num_prompt_tokens: int
    model_name: str


async def score(request: Request, job: ScoreJob) -> Scored:
    """The job through the one pipeline, then each pair's score."""
    run = await submit(request, job)
    outputs = await gather(request, run)
    compare = scorer_plan(run.engine.pooling_info).compare
    if compare is None:  # the head scored each pair's prompt
        scores = tuple(float(o.data.reshape(-1)[0]) for o in outputs)
    else:
        queries, documents = outputs[: len(job.queries)], outputs[len(job.queries) :]
        scores = tuple(compare(queries[q].data, documents[d].data) for q, d in job.pairs)
    return Scored(scores, tuple(outputs), run.num_prompt_tokens, run.model.served_name)

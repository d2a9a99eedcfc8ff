"""A scoring job's answer: one score per pair, from the head or by comparing two outputs
(bge-m3's combined score with FlagEmbedding's weights_for_different_modes among them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from poolserve.frontend.jobs import ScoreJob
from poolserve.frontend.pipeline import Submitted, gather
from poolserve.types.outputs import PoolingOutput
from poolserve.types.scoring import job_scorer


@dataclass(frozen=True)
class Scored:
    """A job's scores in pair order, with what the answer reports about the run."""

    scores: tuple[float, ...]
    outputs: tuple[PoolingOutput, ...]
    num_prompt_tokens: int
    model_name: str


async def scores_of(job: ScoreJob, run: Submitted) -> Scored:
    """The submitted job's outputs, then each pair's score."""
    outputs = await gather(run)
    compare = job_scorer(run.engine.pooling_info, job.mode_weights).compare
    if compare is None:  # the head scored each pair's prompt
        scores = tuple(float(o.data.reshape(-1)[0]) for o in outputs)
    else:
        queries, documents = outputs[: len(job.queries)], outputs[len(job.queries) :]
        scores = tuple(compare(queries[q].data, documents[d].data) for q, d in job.pairs)
    return Scored(scores, tuple(outputs), run.num_prompt_tokens, run.model.served_name)


def best_first(scores: Sequence[float], top_n: int | None) -> list[int]:
    """Indices by score, best first, the `top_n` best (0: all); a stable sort keeps equal
    scores in their input order, as vLLM's does."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])[: top_n or None]

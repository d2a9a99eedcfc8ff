"""How a model scores a (query, document) pair: one joint prompt, or two outputs compared.

Torch-free: the front end compares two embeddings itself, and picks the plan from the card.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import numpy as np

from poolserve.types.errors import UnsupportedTaskError
from poolserve.types.model_info import PoolingModelInfo, get_supported_tasks
from poolserve.types.tasks import TASKS, HeadKind, PairScoring, PoolingTask

# Below this product of norms two embeddings have no direction to compare (torch's own eps).
COSINE_EPS = 1e-8


class PairMode(Enum):
    """How a pair reaches the model."""

    JOINT = "joint"  # one prompt holds both texts and the head scores it (cross-encoder, yes/no)
    SEPARATE = "separate"  # each text is its own prompt; the score compares their outputs


def cosine_score(first: np.ndarray, second: np.ndarray) -> float:
    """Cosine similarity of two embeddings `[D]`, in float64 so the score is exact in float32."""
    a = first.astype(np.float64)
    b = second.astype(np.float64)
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / max(norms, COSINE_EPS)


def maxsim_score(query: np.ndarray, document: np.ndarray) -> float:
    """ColBERT's MaxSim of query `[Q, D]` and document `[T, D]` token embeddings, in float64."""
    # each query token keeps its best match among the document's tokens; the matches add up
    similarities = query.astype(np.float64) @ document.astype(np.float64).T  # [Q, T]
    return float(similarities.max(axis=1).sum())


@dataclass(frozen=True)
class ScorerPlan:
    """How one kind of model scores pairs: the prompts' mode and the task each prompt runs."""

    mode: PairMode
    task: PoolingTask
    # Separate prompts: how the query's output and the document's become the pair's score.
    compare: Callable[[np.ndarray, np.ndarray], float] | None = None


# Head kind -> scorer. A one-label sequence classifier (cross-encoder, or a causal LM read through
# two LM-head rows) scores the joint prompt; a model without a head compares two embeddings; a
# ColBERT model compares every projected token of the query with every one of the document.
SCORER_PLANS: dict[HeadKind, ScorerPlan] = {
    HeadKind.SEQUENCE_CLASSIFIER: ScorerPlan(PairMode.JOINT, PoolingTask.SCORE),
    HeadKind.NONE: ScorerPlan(PairMode.SEPARATE, PoolingTask.EMBED, cosine_score),
    HeadKind.LATE_INTERACTION: ScorerPlan(PairMode.SEPARATE, PoolingTask.TOKEN_EMBED, maxsim_score),
    # bge-m3 scores by its dense vectors, as FlagEmbedding's compute_score "dense"
    HeadKind.BGE_M3: ScorerPlan(PairMode.SEPARATE, PoolingTask.EMBED, cosine_score),
}


# A task's pair scoring (types/tasks.py) -> its scorer, for --pooler-config's task: token_embed
# makes a plain encoder a late-interaction (MaxSim) scorer, as vLLM does.
PAIR_SCORERS: dict[PairScoring, ScorerPlan] = {
    PairScoring.COSINE: SCORER_PLANS[HeadKind.NONE],
    PairScoring.MAXSIM: SCORER_PLANS[HeadKind.LATE_INTERACTION],
    PairScoring.JOINT: SCORER_PLANS[HeadKind.SEQUENCE_CLASSIFIER],
}


def scorer_plan(info: PoolingModelInfo) -> ScorerPlan:
    """The model's scorer (by --pooler-config's task when set, else by its head kind);
    UnsupportedTaskError naming what it serves when it has none."""
    supported = get_supported_tasks(info)
    if info.pooler_task is not None:
        scoring = TASKS[info.pooler_task].pair_scoring
        plan = None if scoring is None else PAIR_SCORERS[scoring]
    else:
        plan = SCORER_PLANS.get(info.head_kind)
    if plan is None or plan.task not in supported:
        raise UnsupportedTaskError(PoolingTask.SCORE.value, [t.value for t in supported])
    return plan

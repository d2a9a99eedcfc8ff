"""How a model scores a (query, document) pair: one joint prompt, or two outputs compared.

Torch-free: the front end compares two embeddings itself, and picks the plan from the card.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import partial

import numpy as np

from poolserve.types.errors import InvalidRequestError, UnsupportedTaskError
from poolserve.types.model_info import PoolingModelInfo, get_supported_tasks
from poolserve.types.outputs import unpack_parts
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


def lexical_score(first: np.ndarray, second: np.ndarray) -> float:
    """FlagEmbedding's lexical matching score of two sparse outputs `[2, nnz]` (ids ascending):
    over the token ids both hold, the sum of the products of their weights, in float64."""
    _, i, j = np.intersect1d(first[0], second[0], assume_unique=True, return_indices=True)
    return float(first[1, i].astype(np.float64) @ second[1, j].astype(np.float64))


# FlagEmbedding's order of the modes in weights_for_different_modes and in its scores
M3_MODES = ("dense", "sparse", "colbert")
MODE_WEIGHTS_FIELD = "weights_for_different_modes"


def m3_scores(query: np.ndarray, document: np.ndarray) -> tuple[float, float, float]:
    """bge-m3's dense, sparse and ColBERT scores of two EMBED_M3 outputs, as FlagEmbedding's
    compute_score gives them: the dot product of the normalized dense vectors, the lexical
    matching score, and MaxSim over the query's ColBERT vectors divided by their count."""
    q_dense, q_lexical, q_colbert = unpack_parts(query)
    d_dense, d_lexical, d_colbert = unpack_parts(document)
    dense = float(q_dense[0].astype(np.float64) @ d_dense[0].astype(np.float64))
    # a query has at least its EOS after CLS; a lone token would divide nothing
    colbert = maxsim_score(q_colbert, d_colbert) / max(len(q_colbert), 1)
    return dense, lexical_score(q_lexical, d_lexical), colbert


def weighted_m3_score(
    query: np.ndarray, document: np.ndarray, weights: tuple[float, float, float]
) -> float:
    """FlagEmbedding's 'colbert+sparse+dense': the modes' scores weighted, over the weights' sum
    (each weight divided first, so large weights cannot overflow)."""
    total = sum(weights)
    return sum(w / total * s for w, s in zip(weights, m3_scores(query, document), strict=True))


def check_mode_weights(weights: Sequence[float]) -> tuple[float, float, float]:
    """FlagEmbedding's weights_for_different_modes: dense, sparse and ColBERT's, three
    non-negative finite numbers with a positive finite sum (else a 400 naming the field)."""
    good = len(weights) == len(M3_MODES) and all(math.isfinite(w) and w >= 0 for w in weights)
    if not good or not 0 < sum(weights) < math.inf:
        raise InvalidRequestError(
            f"{MODE_WEIGHTS_FIELD} must be 3 non-negative numbers (the weights of the dense, "
            "sparse and ColBERT scores) with a positive, finite sum",
            MODE_WEIGHTS_FIELD,
        )
    dense, sparse, colbert = weights
    return dense, sparse, colbert


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


# Head kind -> the task whose one output per text holds every mode weights_for_different_modes
# weighs (bge-m3: dense, lexical weights and ColBERT vectors of one forward).
WEIGHTED_MODE_TASKS: dict[HeadKind, PoolingTask] = {HeadKind.BGE_M3: PoolingTask.EMBED_M3}


def job_scorer(info: PoolingModelInfo, weights: Sequence[float] | None) -> ScorerPlan:
    """A scoring job's scorer: the model's own (`scorer_plan`), or with FlagEmbedding's
    weights_for_different_modes its combined score, on bge-m3 only (else a 400)."""
    if weights is None:
        return scorer_plan(info)
    checked = check_mode_weights(weights)
    task = WEIGHTED_MODE_TASKS.get(info.head_kind)
    if task is None:
        raise InvalidRequestError(
            f"{MODE_WEIGHTS_FIELD} weighs bge-m3's dense, sparse and ColBERT scores: this "
            "model has no sparse and ColBERT heads",
            MODE_WEIGHTS_FIELD,
        )
    return ScorerPlan(PairMode.SEPARATE, task, partial(weighted_m3_score, weights=checked))

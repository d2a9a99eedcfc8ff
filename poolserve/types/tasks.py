"""The task vocabulary: every pooling task declared once, with what it needs and what it gives.

Each `TaskDecl` says which heads serve the task, which optional request fields it takes, the
shape of its output and how the front ends offer it. Every other table of tasks in the project
(supported tasks, a model's tasks by its head, the fields each task accepts, token-level and
calibrated tasks, the default task order, Infinity's capabilities) is derived from `TASKS`;
tests/types/test_tasks.py fails when a list of task names is written anywhere else.
Torch-free: the front ends, the engine and the Python API all import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum


class PoolingTask(StrEnum):
    """What a request asks the model to produce; values are the wire names."""

    EMBED = "embed"
    CLASSIFY = "classify"
    TOKEN_EMBED = "token_embed"
    TOKEN_CLASSIFY = "token_classify"
    EMBED_TOKEN_CLASSIFY = "embed&token_classify"
    REWARD = "reward"
    SCORE = "score"  # one relevance score per (query, document) prompt
    # vocabulary ids and weights: SPLADE over the MLM head, or bge-m3's lexical weights
    EMBED_SPARSE = "embed_sparse"
    # bge-m3's three outputs of one text from one forward (its combined pair score); internal
    EMBED_M3 = "embed_m3"


class PoolingType(Enum):
    """How the hidden states of one request are reduced before the head."""

    CLS = "cls"
    LAST = "last"
    MEAN = "mean"
    ALL = "all"
    STEP = "step"
    SPARSE = "sparse"  # running max of MLM-head logits over non-special tokens (SPLADE)
    LEXICAL = "lexical"  # running max, per token id, of one weight per token (bge-m3)


class HeadKind(Enum):
    """Which head the checkpoint carries on top of its backbone."""

    NONE = "none"
    SEQUENCE_CLASSIFIER = "sequence_classifier"
    TOKEN_CLASSIFIER = "token_classifier"
    PROCESS_REWARD = "process_reward"
    TOKEN_REWARD = "token_reward"
    MASKED_LM = "masked_lm"  # *ForMaskedLM: transform + vocabulary decoder (sparse embeddings)
    LATE_INTERACTION = "late_interaction"  # ColBERT: a projection of every token (MaxSim)
    # bge-m3: three outputs of one pass, CLS (dense), a weight per token (sparse_linear.pt) and
    # a projection of every token after CLS (colbert_linear.pt)
    BGE_M3 = "bge_m3"


# Heads whose main output is sparse, as TEI serves a *ForMaskedLM under --pooling splade (its
# POST / and /info answer sparse); bge-m3 serves sparse too, but its main output is dense.
SPARSE_MAIN_HEADS = frozenset({HeadKind.MASKED_LM})

# Heads whose outputs are labels (a classifier's or a reward's logits): their width is num_labels.
LABELLED_HEADS = frozenset(
    {
        HeadKind.SEQUENCE_CLASSIFIER,
        HeadKind.TOKEN_CLASSIFIER,
        HeadKind.PROCESS_REWARD,
        HeadKind.TOKEN_REWARD,
    }
)


class Output(Enum):
    """The shape of one prompt's output."""

    VECTOR = "vector"  # [dim]: an embedding, a class distribution, a score
    PER_TOKEN = "per_token"  # [num_tokens, dim]: grows with the prompt
    STEPS = "steps"  # [num_step_tags, num_labels] or [num_tokens]: a reward per step or token
    SPARSE = "sparse"  # [2, nnz]: vocabulary ids and weights
    PARTS = "parts"  # several 2-D arrays of one prompt in one buffer (types/outputs.py)


class PairScoring(Enum):
    """How /score and /rerank score a pair when --pooler-config names the model's task."""

    COSINE = "cosine"  # the two sides' vectors compared
    MAXSIM = "maxsim"  # every token vector of the query with every one of the document (ColBERT)
    JOINT = "joint"  # the pair's one prompt scored by a one-label classifier (the score task)


@dataclass(frozen=True)
class TaskDecl:
    """One task: the heads that serve it, the request fields it takes, what it returns."""

    heads: frozenset[HeadKind]
    output: Output
    # optional PoolingParams fields a request of this task may set (any other is refused)
    params: frozenset[str] = frozenset()
    # heads that serve it only when they have one label (a reward or a score is one number)
    one_label_heads: frozenset[HeadKind] = frozenset()
    # heads that serve it only when --pooler-config names it (vLLM's pooling_task), as vLLM
    # serves a sequence classifier's head on every token only when started for token_classify
    named_heads: frozenset[HeadKind] = frozenset()
    # --pooler-config's logit_mean/logit_sigma calibrate its classifier logits (as vLLM's)
    calibrated: bool = False
    # the order in which /v1/pooling picks a request's task when it names none (None: never)
    default_rank: int | None = None
    # the capability Infinity's /models lists it under (None: not offered there)
    capability: str | None = None
    # as --pooler-config's task (vLLM's PoolerConfig.task), how pairs are scored (None: the
    # score routes are not served, as vLLM enables them for embed, token_embed and classify)
    pair_scoring: PairScoring | None = None
    # offered to clients (/v1/pooling, /info, --pooler-config); False: the server runs it for
    # a route of its own and no client names it (its output is not an answer's shape)
    public: bool = True


def _heads(*kinds: HeadKind) -> frozenset[HeadKind]:
    return frozenset(kinds)


def _fields(*names: str) -> frozenset[str]:
    return frozenset(names)


_EMBEDDERS = _heads(HeadKind.NONE, HeadKind.MASKED_LM, HeadKind.BGE_M3)

TASKS: dict[PoolingTask, TaskDecl] = {
    PoolingTask.EMBED: TaskDecl(
        _EMBEDDERS,
        Output.VECTOR,
        _fields("dimensions", "normalize", "prompt_tokens", "token_spans"),
        default_rank=0,
        capability="embed",
        pair_scoring=PairScoring.COSINE,
    ),
    PoolingTask.CLASSIFY: TaskDecl(
        _heads(HeadKind.SEQUENCE_CLASSIFIER),
        Output.VECTOR,
        _fields("use_activation"),
        calibrated=True,
        default_rank=1,
        capability="classify",
        pair_scoring=PairScoring.JOINT,  # served by a one-label classifier only (score's heads)
    ),
    PoolingTask.REWARD: TaskDecl(
        _heads(HeadKind.PROCESS_REWARD, HeadKind.TOKEN_REWARD),
        Output.STEPS,
        _fields("step_tag_id", "returned_token_ids"),
        one_label_heads=_heads(HeadKind.SEQUENCE_CLASSIFIER),
        default_rank=2,
    ),
    PoolingTask.TOKEN_CLASSIFY: TaskDecl(
        _heads(HeadKind.TOKEN_CLASSIFIER),
        Output.PER_TOKEN,
        _fields("use_activation"),
        named_heads=_heads(HeadKind.SEQUENCE_CLASSIFIER),
        calibrated=True,
        default_rank=3,
    ),
    # a ColBERT projection is trained per token, so a pooled vector would be meaningless (vLLM)
    PoolingTask.TOKEN_EMBED: TaskDecl(
        _EMBEDDERS | _heads(HeadKind.LATE_INTERACTION),
        Output.PER_TOKEN,
        _fields("normalize"),
        default_rank=4,
        pair_scoring=PairScoring.MAXSIM,
    ),
    PoolingTask.EMBED_TOKEN_CLASSIFY: TaskDecl(
        _heads(HeadKind.TOKEN_CLASSIFIER),
        Output.PER_TOKEN,
        _fields("dimensions", "normalize", "use_activation"),
        calibrated=True,
        default_rank=5,
    ),
    PoolingTask.SCORE: TaskDecl(
        frozenset(),
        Output.VECTOR,
        _fields("use_activation"),
        one_label_heads=_heads(HeadKind.SEQUENCE_CLASSIFIER),
        calibrated=True,
        capability="rerank",
    ),
    PoolingTask.EMBED_SPARSE: TaskDecl(_heads(HeadKind.MASKED_LM, HeadKind.BGE_M3), Output.SPARSE),
    # dense [1, D], lexical weights [2, nnz] and ColBERT vectors [T - 1, dim] of one forward,
    # for FlagEmbedding's compute_score (weights_for_different_modes on /score and /rerank)
    PoolingTask.EMBED_M3: TaskDecl(_heads(HeadKind.BGE_M3), Output.PARTS, public=False),
}

# What follows is derived from TASKS: edit the declarations above, never these.

SUPPORTED_TASKS: frozenset[PoolingTask] = frozenset(TASKS)
# What clients may name and a model's task list shows.
PUBLIC_TASKS = frozenset(t for t, d in TASKS.items() if d.public)
TOKEN_LEVEL_TASKS = frozenset(t for t, d in TASKS.items() if d.output is Output.PER_TOKEN)
CALIBRATED_TASKS = frozenset(t for t, d in TASKS.items() if d.calibrated)
# Heads whose logits --pooler-config's calibration applies to.
CLASSIFIER_HEADS = frozenset(k for d in TASKS.values() if d.calibrated for k in d.heads)
# Tasks whose head's activation is L2 normalisation: vLLM's use_activation means normalize there.
NORMALIZING_TASKS = frozenset(
    t for t, d in TASKS.items() if "normalize" in d.params and "use_activation" not in d.params
)
# The task /v1/pooling runs when a request names none: the first the model supports.
DEFAULT_TASK_ORDER = tuple(
    sorted(
        (t for t, d in TASKS.items() if d.default_rank is not None),
        key=lambda t: TASKS[t].default_rank or 0,
    )
)
CAPABILITIES: dict[PoolingTask, str] = {
    t: d.capability for t, d in TASKS.items() if d.capability is not None
}


def head_tasks(
    kind: HeadKind, num_labels: int | None, pooler_task: PoolingTask | None = None
) -> frozenset[PoolingTask]:
    """The tasks a model with this head (and this many labels) can serve, started with
    `pooler_task` as --pooler-config's task (None: no task named)."""
    one_label = num_labels == 1
    return frozenset(
        t
        for t, d in TASKS.items()
        if kind in d.heads
        or (one_label and kind in d.one_label_heads)
        or (t is pooler_task and kind in d.named_heads)
    )

"""Table task -> (method, head) per head kind; supported tasks; building a request pooler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from poolserve.pooling.heads import (
    ClassifierHead,
    EmbeddingHead,
    EmbedTokenClassifyHead,
    Head,
    ProcessRewardHead,
    TokenEmbeddingHead,
    TokenRewardHead,
)
from poolserve.pooling.lexical import (
    colbert_vectors_head,
    lexical_head,
    lexical_method,
    m3_method,
    parts_head,
)
from poolserve.pooling.methods import PoolingMethod, build_method
from poolserve.pooling.pooler import ChunkInput, RequestPooler, pool_step
from poolserve.pooling.scorers import CrossEncoderHead
from poolserve.pooling.sparse import sparse_head, sparse_method
from poolserve.pooling.stats import CloneStats
from poolserve.types.errors import PoolingConfigError
from poolserve.types.model_info import SEQ_SCORE, PoolingModelInfo, get_supported_tasks
from poolserve.types.params import NO_CALIBRATION, LogitCalibration, PoolingParams
from poolserve.types.tasks import CALIBRATED_TASKS, HeadKind, PoolingTask, PoolingType
from poolserve.types.validation import request_spans, validate_params

__all__ = [
    "TASK_PLANS",
    "ChunkInput",
    "RequestPooler",
    "TaskPlan",
    "build_pooler",
    "get_supported_tasks",
    "pool_step",
]


def _required(module: nn.Module | None, name: str) -> nn.Module:
    """The head module the plan needs; its absence is a model-description bug."""
    if module is None:
        raise PoolingConfigError(f"model info lacks {name}")
    return module


def _embed_head(info: PoolingModelInfo, params: PoolingParams) -> EmbeddingHead:
    normalize = True if params.normalize is None else params.normalize
    return EmbeddingHead(info.embed_projection, params.dimensions, normalize)


def _token_embed_head(info: PoolingModelInfo, params: PoolingParams) -> Head:
    return TokenEmbeddingHead(True if params.normalize is None else params.normalize)


def _late_interaction_head(info: PoolingModelInfo, params: PoolingParams) -> Head:
    normalize = True if params.normalize is None else params.normalize
    return TokenEmbeddingHead(normalize, _required(info.token_projection, "token_projection"))


def _classifier_head(info: PoolingModelInfo, params: PoolingParams) -> ClassifierHead:
    use_activation = True if params.use_activation is None else params.use_activation
    return ClassifierHead(_required(info.seq_classifier, "seq_classifier"), use_activation)


def _sequence_reward_head(info: PoolingModelInfo, params: PoolingParams) -> Head:
    # A sequence reward is the raw score of a one-label classifier.
    return ClassifierHead(_required(info.seq_classifier, "seq_classifier"), use_activation=False)


def _score_head(info: PoolingModelInfo, params: PoolingParams) -> Head:
    # use_activation false asks for the raw logit, as vLLM and TEI's raw_scores do
    activation = None if params.use_activation is False else info.score_activation
    return CrossEncoderHead(_required(info.seq_classifier, "seq_classifier"), activation)


def _token_classifier_head(info: PoolingModelInfo, params: PoolingParams) -> ClassifierHead:
    use_activation = True if params.use_activation is None else params.use_activation
    return ClassifierHead(_required(info.token_classifier, "token_classifier"), use_activation)


def _sequence_token_classifier_head(info: PoolingModelInfo, params: PoolingParams) -> Head:
    # vLLM's token_classify through a sequence classifier: its head on every token's state,
    # without the backbone's pooler layer where the checkpoint pools through one
    module = _required(info.seq_classifier, "seq_classifier")
    per_token = dict(module.named_children()).get(SEQ_SCORE, module)
    use_activation = True if params.use_activation is None else params.use_activation
    return ClassifierHead(per_token, use_activation)


def _embed_token_classify_head(info: PoolingModelInfo, params: PoolingParams) -> Head:
    embed = _embed_head(info, params)
    tokens = _token_classifier_head(info, params)
    return EmbedTokenClassifyHead(info.embed_pooling_type, embed, tokens)


def _process_reward_head(info: PoolingModelInfo, params: PoolingParams) -> Head:
    head = _required(info.process_reward_head, "process_reward_head")
    return ProcessRewardHead(head, params.returned_token_ids)


def _token_reward_head(info: PoolingModelInfo, params: PoolingParams) -> Head:
    return TokenRewardHead(_required(info.token_reward_head, "token_reward_head"))


def _all(info: PoolingModelInfo) -> PoolingType:
    return PoolingType.ALL


def _step(info: PoolingModelInfo) -> PoolingType:
    return PoolingType.STEP


def _embed_pooling(info: PoolingModelInfo) -> PoolingType:
    return info.embed_pooling_type


def _sequence_pooling(info: PoolingModelInfo) -> PoolingType:
    return info.sequence_pooling_type


def _sparse(info: PoolingModelInfo) -> PoolingType:
    return PoolingType.SPARSE


def _lexical(info: PoolingModelInfo) -> PoolingType:
    return PoolingType.LEXICAL


@dataclass(frozen=True)
class TaskPlan:
    """How one task runs on one kind of model: which method pools, which head finishes."""

    pooling_type: Callable[[PoolingModelInfo], PoolingType]
    build_head: Callable[[PoolingModelInfo, PoolingParams], Head]
    # A method that needs a model's module (SPARSE runs the MLM head) is built by the plan.
    build_method: Callable[..., PoolingMethod] | None = None


TASK_PLANS: dict[tuple[HeadKind, PoolingTask], TaskPlan] = {
    (HeadKind.NONE, PoolingTask.EMBED): TaskPlan(_embed_pooling, _embed_head),
    (HeadKind.NONE, PoolingTask.TOKEN_EMBED): TaskPlan(_all, _token_embed_head),
    (HeadKind.SEQUENCE_CLASSIFIER, PoolingTask.CLASSIFY): TaskPlan(
        _sequence_pooling, _classifier_head
    ),
    (HeadKind.SEQUENCE_CLASSIFIER, PoolingTask.REWARD): TaskPlan(
        _sequence_pooling, _sequence_reward_head
    ),
    (HeadKind.SEQUENCE_CLASSIFIER, PoolingTask.SCORE): TaskPlan(_sequence_pooling, _score_head),
    # only when --pooler-config names token_classify (types/tasks.py, named_heads)
    (HeadKind.SEQUENCE_CLASSIFIER, PoolingTask.TOKEN_CLASSIFY): TaskPlan(
        _all, _sequence_token_classifier_head
    ),
    (HeadKind.TOKEN_CLASSIFIER, PoolingTask.TOKEN_CLASSIFY): TaskPlan(_all, _token_classifier_head),
    (HeadKind.TOKEN_CLASSIFIER, PoolingTask.EMBED_TOKEN_CLASSIFY): TaskPlan(
        _all, _embed_token_classify_head
    ),
    (HeadKind.PROCESS_REWARD, PoolingTask.REWARD): TaskPlan(_step, _process_reward_head),
    (HeadKind.TOKEN_REWARD, PoolingTask.REWARD): TaskPlan(_all, _token_reward_head),
    (HeadKind.MASKED_LM, PoolingTask.EMBED): TaskPlan(_embed_pooling, _embed_head),
    (HeadKind.MASKED_LM, PoolingTask.TOKEN_EMBED): TaskPlan(_all, _token_embed_head),
    (HeadKind.MASKED_LM, PoolingTask.EMBED_SPARSE): TaskPlan(_sparse, sparse_head, sparse_method),
    (HeadKind.LATE_INTERACTION, PoolingTask.TOKEN_EMBED): TaskPlan(_all, _late_interaction_head),
    # bge-m3: dense CLS, its sparse_linear's weights per token id, its colbert_linear's vectors
    (HeadKind.BGE_M3, PoolingTask.EMBED): TaskPlan(_embed_pooling, _embed_head),
    (HeadKind.BGE_M3, PoolingTask.TOKEN_EMBED): TaskPlan(_all, colbert_vectors_head),
    (HeadKind.BGE_M3, PoolingTask.EMBED_SPARSE): TaskPlan(_lexical, lexical_head, lexical_method),
    # all three from one forward, for FlagEmbedding's combined score (internal: types/tasks.py)
    (HeadKind.BGE_M3, PoolingTask.EMBED_M3): TaskPlan(_all, parts_head, m3_method),
}


def build_pooler(
    info: PoolingModelInfo,
    params: PoolingParams,
    *,
    async_scheduling: bool,
    stats: CloneStats,
    calibration: LogitCalibration = NO_CALIBRATION,
) -> RequestPooler:
    """Validate `params` for this model and build the request's pooler (typed errors on misuse)."""
    validate_params(info, params)
    plan = TASK_PLANS[(info.head_kind, params.task)]
    head = plan.build_head(info, params)
    if params.task in CALIBRATED_TASKS and calibration != NO_CALIBRATION:
        head = head.calibrated(calibration)
    step_tag_id = params.step_tag_id if params.step_tag_id is not None else info.default_step_tag_id
    if plan.build_method is not None:
        method = plan.build_method(info, async_scheduling=async_scheduling, stats=stats)
        return RequestPooler(method, head, stats)
    # A head that computes returns new storage, so only a head that may pass its input through
    # needs the method to make a finished view own its storage under async scheduling.
    method = build_method(
        plan.pooling_type(info),
        async_scheduling=async_scheduling and head.may_alias_input,
        stats=stats,
        step_tag_id=step_tag_id,
        skip_tokens=params.prompt_tokens or 0,
        token_spans=request_spans(params),  # late chunking: one mean per span
    )
    return RequestPooler(method, head, stats)

"""What pooling needs to know about a model: its heads, sizes and sentence-transformers config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import TYPE_CHECKING, Any

from poolserve.types.errors import PoolingConfigError
from poolserve.types.tasks import (
    LABELLED_HEADS,
    PUBLIC_TASKS,
    SUPPORTED_TASKS,
    HeadKind,
    PoolingTask,
    PoolingType,
    head_tasks,
)

if TYPE_CHECKING:  # the engine's records hold modules; a front end's card holds none
    from torch import nn


class ScoreActivation(Enum):
    """What a cross-encoder applies to its one logit by default (sentence-transformers' choice)."""

    SIGMOID = "sigmoid"
    IDENTITY = "identity"
    TANH = "tanh"


# sentence-transformers pooling mode -> pooling type (modes we can reproduce exactly).
ST_POOLING_MODES: dict[str, PoolingType] = {
    "cls": PoolingType.CLS,
    "mean": PoolingType.MEAN,
    "lasttoken": PoolingType.LAST,
}


# The field holding each head kind's module (at most one is set; none: HeadKind.NONE).
HEAD_FIELDS: dict[HeadKind, str] = {
    HeadKind.SEQUENCE_CLASSIFIER: "seq_classifier",
    HeadKind.TOKEN_CLASSIFIER: "token_classifier",
    HeadKind.PROCESS_REWARD: "process_reward_head",
    HeadKind.TOKEN_REWARD: "token_reward_head",
    HeadKind.MASKED_LM: "mlm_head",
    HeadKind.LATE_INTERACTION: "token_projection",
    HeadKind.BGE_M3: "m3_heads",
}
# The modules bge-m3's `m3_heads` (a ModuleDict) holds: sparse_linear.pt `[..., hidden] ->
# [..., 1]` (a weight per token) and colbert_linear.pt `[..., hidden] -> [..., dim]`.
M3_SPARSE = "sparse"
M3_COLBERT = "colbert"
# A sequence classifier that pools through a layer of its backbone (BERT's pooler, ModernBERT's
# head) holds that layer as its module's child SEQ_POOLER and its classifier as SEQ_SCORE:
# token_classify through it runs SEQ_SCORE alone on every token, as vLLM does. Any other
# sequence classifier (a decoder's score, RoBERTa's head) runs whole on every token.
SEQ_POOLER = "pooler"
SEQ_SCORE = "score"


@dataclass(frozen=True, eq=False)
class PoolingModelInfo:
    """A model as pooling sees it; built once per loaded model by the engine's bridge.

    Head modules map hidden states `[..., hidden_size]` to outputs `[..., out]` and are shared by
    every request (pooling never mutates them). Give them in float32: heads compute in float32,
    and a half-precision module is run with float32 copies of its weights on every call.
    `embed_projection` is the sentence-transformers Dense chain as a plain tensor -> tensor module.
    """

    # Decoders (causal or bidirectional) pool their last token by default; encoders their first.
    is_decoder: bool
    hidden_size: int
    seq_classifier: nn.Module | None = None
    token_classifier: nn.Module | None = None
    process_reward_head: nn.Module | None = None
    token_reward_head: nn.Module | None = None
    num_labels: int | None = None
    labels: tuple[str, ...] = ()
    embed_projection: nn.Module | None = None
    embed_output_size: int | None = None
    st_pooling_mode: str | None = None
    supports_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    # Overrides the embed pooling type derived from st_pooling_mode / is_decoder.
    default_pooling_type: PoolingType | None = None
    # Overrides the sequence classifier's pooling when the checkpoint's config names one.
    classifier_pooling_type: PoolingType | None = None
    # Step tag a process reward model uses when a request names none (e.g. the id of "<extra_0>").
    default_step_tag_id: int | None = None
    # The one-label classifier's default activation when it scores pairs (its saved CrossEncoder
    # config); a request's use_activation false gives the raw logit instead.
    score_activation: ScoreActivation = ScoreActivation.SIGMOID
    # A *ForMaskedLM head `[..., hidden] -> [..., vocab]` (sparse embeddings), and the token ids
    # (the tokenizer's CLS, SEP, PAD...) whose positions sparse pooling skips.
    mlm_head: nn.Module | None = None
    sparse_excluded_ids: frozenset[int] = frozenset()
    # A ColBERT projection `[..., hidden] -> [..., dim]` applied to every token (late interaction).
    token_projection: nn.Module | None = None
    # bge-m3's heads beside its dense CLS output, by M3_SPARSE and M3_COLBERT; its sparse pooling
    # skips the sparse_excluded_ids (the tokenizer's CLS, EOS, PAD and UNK, as FlagEmbedding's).
    m3_heads: nn.ModuleDict | None = None
    # The head kind when the modules are not carried (a front end's card, torch-free); None:
    # derived from the module that is set.
    head: HeadKind | None = None
    # --pooler-config's task (vLLM's PoolerConfig.task): the default task and the scorer
    pooler_task: PoolingTask | None = None

    def __post_init__(self) -> None:
        carried = [name for name in HEAD_FIELDS.values() if getattr(self, name) is not None]
        if len(carried) > 1:
            raise PoolingConfigError("a model carries at most one task head")
        if self.hidden_size <= 0:
            raise PoolingConfigError(f"hidden_size must be positive, got {self.hidden_size}")
        if self.st_pooling_mode is not None and self.st_pooling_mode not in ST_POOLING_MODES:
            known = ", ".join(sorted(ST_POOLING_MODES))
            raise PoolingConfigError(
                f"sentence-transformers pooling mode {self.st_pooling_mode!r} is not supported "
                f"(known: {known})"
            )
        if self.head_kind in LABELLED_HEADS and (self.num_labels is None or self.num_labels <= 0):
            raise PoolingConfigError("a classifier or reward head needs a positive num_labels")

    @cached_property  # asked per request; the heads never change
    def head_kind(self) -> HeadKind:
        """The kind of task head this model carries."""
        if self.head is not None:
            return self.head
        kinds = (kind for kind, name in HEAD_FIELDS.items() if getattr(self, name) is not None)
        return next(kinds, HeadKind.NONE)

    def without_modules(self) -> PoolingModelInfo:
        """The same facts without a module: what a front end's card carries (no torch needed)."""
        modules: dict[str, Any] = dict.fromkeys((*HEAD_FIELDS.values(), "embed_projection"))
        return dataclasses.replace(self, head=self.head_kind, **modules)

    @cached_property  # asked per request
    def supported_tasks(self) -> frozenset[PoolingTask]:
        """Tasks this model serves to clients: the public tasks its heads allow."""
        return self.runnable_tasks & PUBLIC_TASKS

    @cached_property  # asked per request
    def runnable_tasks(self) -> frozenset[PoolingTask]:
        """Tasks its heads allow, the server's internal ones included (bge-m3's EMBED_M3)."""
        return head_tasks(self.head_kind, self.num_labels, self.pooler_task) & SUPPORTED_TASKS

    @property
    def embedding_size(self) -> int:
        """Length of the embed output before Matryoshka truncation."""
        return self.embed_output_size if self.embed_output_size is not None else self.hidden_size

    @property
    def embed_pooling_type(self) -> PoolingType:
        """Default pooling for embed: override, then sentence-transformers config, then LAST/CLS."""
        if self.default_pooling_type is not None:
            return self.default_pooling_type
        if self.st_pooling_mode is not None:
            return ST_POOLING_MODES[self.st_pooling_mode]
        return PoolingType.LAST if self.is_decoder else PoolingType.CLS

    @property
    def sequence_pooling_type(self) -> PoolingType:
        """Pooling the checkpoint's sequence classifier was trained on."""
        if self.classifier_pooling_type is not None:
            return self.classifier_pooling_type
        return PoolingType.LAST if self.is_decoder else PoolingType.CLS


def get_supported_tasks(info: PoolingModelInfo) -> frozenset[PoolingTask]:
    """Tasks this model serves to clients: the public tasks its heads allow."""
    return info.supported_tasks

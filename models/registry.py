"""Table architecture -> (backbone, head, weight prefixes); the supported list."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from models.spec import HeadKind


class Backbone(enum.Enum):
    """Which native forward runs the checkpoint."""

    DECODER = "decoder"
    ENCODER = "encoder"


@dataclass(frozen=True)
class ArchitectureEntry:
    """How to read one architecture's checkpoint."""

    backbone: Backbone
    head_kind: HeadKind
    backbone_prefixes: tuple[str, ...]  # tried in order; the first holding the embeddings wins
    head_prefix: str | None = None
    pooler_prefix: str | None = None  # BERT sequence classifiers pool CLS through dense + tanh


@dataclass(frozen=True)
class DecoderFamily:
    """Per-family switches of the one decoder implementation."""

    qk_norm: bool  # RMSNorm over each head's queries and keys before RoPE


DECODER_FAMILIES: dict[str, DecoderFamily] = {
    "llama": DecoderFamily(qk_norm=False),
    "mistral": DecoderFamily(qk_norm=False),
    "qwen2": DecoderFamily(qk_norm=False),
    "qwen3": DecoderFamily(qk_norm=True),
}
_DECODER_CLASS_PREFIXES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
}
_DECODER_SUFFIXES: dict[str, ArchitectureEntry] = {
    "ForCausalLM": ArchitectureEntry(Backbone.DECODER, HeadKind.NONE, ("model.",)),
    "Model": ArchitectureEntry(Backbone.DECODER, HeadKind.NONE, ("", "model.")),
    "ForSequenceClassification": ArchitectureEntry(
        Backbone.DECODER, HeadKind.SEQUENCE_CLASSIFIER, ("model.",), "score."
    ),
    "ForTokenClassification": ArchitectureEntry(
        Backbone.DECODER, HeadKind.TOKEN_CLASSIFIER, ("model.",), "score."
    ),
}
_EXTRA: dict[str, ArchitectureEntry] = {
    # Remote-code classes on the Hub; their backbone is plain Qwen2, the head is native here.
    "Qwen2ForProcessRewardModel": ArchitectureEntry(
        Backbone.DECODER, HeadKind.PROCESS_REWARD, ("model.",), "score."
    ),
    "Qwen2ForRewardModel": ArchitectureEntry(
        Backbone.DECODER, HeadKind.TOKEN_REWARD, ("model.",), "score."
    ),
    "BertModel": ArchitectureEntry(Backbone.ENCODER, HeadKind.NONE, ("", "bert.")),
    "BertForSequenceClassification": ArchitectureEntry(
        Backbone.ENCODER,
        HeadKind.SEQUENCE_CLASSIFIER,
        ("bert.",),
        "classifier.",
        pooler_prefix="bert.pooler.dense.",
    ),
    "BertForTokenClassification": ArchitectureEntry(
        Backbone.ENCODER, HeadKind.TOKEN_CLASSIFIER, ("bert.",), "classifier."
    ),
}

ARCHITECTURES: dict[str, ArchitectureEntry] = {
    **{
        class_prefix + suffix: entry
        for class_prefix in _DECODER_CLASS_PREFIXES.values()
        for suffix, entry in _DECODER_SUFFIXES.items()
    },
    **_EXTRA,
}


def supported_architectures() -> tuple[str, ...]:
    """Every architecture name load_model() accepts, sorted."""
    return tuple(sorted(ARCHITECTURES))

"""Table architecture -> (backbone, head, weight prefixes), family switches; the supported list."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from poolserve.types.tasks import HeadKind


class Backbone(enum.Enum):
    """Which native forward runs the checkpoint."""

    DECODER = "decoder"
    ENCODER = "encoder"


class Positions(enum.Enum):
    """How an encoder tells its tokens' positions apart."""

    ABSOLUTE = "absolute"  # learned table indexed by position
    OFFSET = "offset"  # learned table indexed past the padding id, fairseq style (RoBERTa, MPNet)
    ROTARY = "rotary"  # RoPE on queries and keys, no table


class Relative(enum.Enum):
    """Which position-dependent term an encoder adds to its attention scores."""

    NONE = "none"
    BUCKETS = "buckets"  # MPNet: learned bias per head and log-bucketed distance, shared by layers
    DISENTANGLED = "disentangled"  # DeBERTa-v2: content-to-position and position-to-content


class EncoderLayout(enum.Enum):
    """How a checkpoint names its encoder tensors (see models/encoder_weights.py)."""

    BERT = "bert"
    DISTILBERT = "distilbert"
    MPNET = "mpnet"
    DEBERTA = "deberta"
    MODERNBERT = "modernbert"
    NOMIC = "nomic"


@dataclass(frozen=True)
class HeadTransform:
    """Dense, activation and optional LayerNorm a classifier applies before its output Linear."""

    dense_prefix: str
    activation: str = "tanh"
    activation_key: str | None = None  # a config field naming the activation overrides it
    norm_prefix: str | None = None  # ModernBERT's LayerNorm after the activation
    eps_key: str = "layer_norm_eps"  # the config field holding that norm's eps
    eps: float | None = None  # a fixed eps instead (DistilBERT's MLM head: 1e-12)


@dataclass(frozen=True)
class ArchitectureEntry:
    """How to read one architecture's checkpoint."""

    backbone: Backbone
    head_kind: HeadKind
    backbone_prefixes: tuple[str, ...]  # tried in order; the first holding the embeddings wins
    head_prefix: str | None = None
    transform: HeadTransform | None = None  # applied to the pooled states before the head Linear


@dataclass(frozen=True)
class DecoderFamily:
    """Per-family switches of the one decoder implementation; `classes` are its architectures."""

    classes: tuple[str, ...]
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE
    norm_offset: bool = False  # RMSNorm scales by (1 + weight), in float32
    sandwich_norms: bool = False  # extra norms on the attention output and around the MLP
    embed_scale: bool = False  # embeddings x sqrt(hidden_size), rounded to the model dtype
    multipliers: bool = False  # Granite's embedding/residual/attention multipliers, logits_scaling
    query_pre_attn_scalar: bool = False  # attention scale = query_pre_attn_scalar ** -0.5
    attn_softcap: bool = False  # tanh soft-capping of attention logits (attn_logit_softcapping)
    final_softcap: bool = False  # tanh soft-capping of LM-head logits (final_logit_softcapping)
    rope_per_layer_type: bool = False  # rope_parameters per layer type (local and global theta)
    bidirectional_flag: bool = False  # honours use_bidirectional_attention
    activation_key: str = "hidden_act"  # the config field that names the MLP activation


@dataclass(frozen=True)
class EncoderFamily:
    """Per-family switches of the one encoder implementation; `classes` are its architectures."""

    classes: tuple[str, ...]
    layout: EncoderLayout
    prefix: str  # the backbone's weight prefix inside the head classes
    seq_transform: HeadTransform | None  # what the sequence classifier does to the CLS state
    seq_classifier: str = "classifier."  # the sequence classifier's output Linear
    token_transform: HeadTransform | None = None  # ModernBERT's per-token head before its Linear
    positions: Positions = Positions.ABSOLUTE
    padding_idx: int | None = None  # OFFSET counts from padding_idx + 1; None: pad_token_id
    position_flag: str | None = None  # a config field that turns absolute positions off (DeBERTa)
    relative: Relative = Relative.NONE
    pre_norm: bool = False  # LayerNorm before attention and MLP (ModernBERT), else after
    gated_mlp: bool = False  # act(gate) * up (ModernBERT GeGLU, NomicBERT SwiGLU)
    activation_key: str = "hidden_act"  # the config field that names the MLP activation
    eps_key: str | None = "layer_norm_eps"  # None: DistilBERT's fixed 1e-12


_ALL_HEADS = ("Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification")


def _classes(prefix: str, suffixes: tuple[str, ...] = _ALL_HEADS) -> tuple[str, ...]:
    """transformers class names of one family: prefix + each suffix."""
    return tuple(prefix + suffix for suffix in suffixes)


# One row per config model_type; the classes are those transformers defines for the family.
DECODER_FAMILIES: dict[str, DecoderFamily] = {
    "llama": DecoderFamily(_classes("Llama")),
    "mistral": DecoderFamily(_classes("Mistral")),
    "qwen2": DecoderFamily(_classes("Qwen2")),
    "qwen3": DecoderFamily(_classes("Qwen3"), qk_norm=True),
    "gemma": DecoderFamily(
        _classes("Gemma"), norm_offset=True, embed_scale=True, bidirectional_flag=True
    ),
    "gemma2": DecoderFamily(
        _classes("Gemma2"),
        norm_offset=True,
        sandwich_norms=True,
        embed_scale=True,
        query_pre_attn_scalar=True,
        attn_softcap=True,
        final_softcap=True,
        bidirectional_flag=True,
        activation_key="hidden_activation",
    ),
    # transformers' Gemma3 attention never applies attn_logit_softcapping, so neither do we.
    "gemma3_text": DecoderFamily(
        ("Gemma3TextModel", "Gemma3ForCausalLM", "Gemma3TextForSequenceClassification"),
        qk_norm=True,
        norm_offset=True,
        sandwich_norms=True,
        embed_scale=True,
        query_pre_attn_scalar=True,
        final_softcap=True,
        rope_per_layer_type=True,
        bidirectional_flag=True,
        activation_key="hidden_activation",
    ),
    "phi3": DecoderFamily(_classes("Phi3")),  # fused qkv_proj / gate_up_proj are read as is
    "granite": DecoderFamily(_classes("Granite", ("Model", "ForCausalLM")), multipliers=True),
}
_DECODER_SUFFIXES: dict[str, ArchitectureEntry] = {
    "ForCausalLM": ArchitectureEntry(Backbone.DECODER, HeadKind.NONE, ("model.",)),
    "ForSequenceClassification": ArchitectureEntry(
        Backbone.DECODER, HeadKind.SEQUENCE_CLASSIFIER, ("model.",), "score."
    ),
    "ForTokenClassification": ArchitectureEntry(
        Backbone.DECODER, HeadKind.TOKEN_CLASSIFIER, ("model.",), "score."
    ),
    "Model": ArchitectureEntry(Backbone.DECODER, HeadKind.NONE, ("", "model.")),
}
_EXTRA: dict[str, ArchitectureEntry] = {
    # Stanford ColBERT's class: a BERT backbone under `bert.`, its projection `linear` beside it.
    "HF_ColBERT": ArchitectureEntry(Backbone.ENCODER, HeadKind.LATE_INTERACTION, ("bert.", "")),
    # Remote-code classes on the Hub; their backbone is plain Qwen2, the head is native here.
    "Qwen2ForProcessRewardModel": ArchitectureEntry(
        Backbone.DECODER, HeadKind.PROCESS_REWARD, ("model.",), "score."
    ),
    "Qwen2ForRewardModel": ArchitectureEntry(
        Backbone.DECODER, HeadKind.TOKEN_REWARD, ("model.",), "score."
    ),
}


_ENCODER_HEADS = ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification")
_BERT_POOLER = HeadTransform("bert.pooler.dense.")
_ROBERTA_HEAD = HeadTransform("classifier.dense.")  # dense + tanh, then classifier.out_proj
_ROBERTA = EncoderFamily(
    _classes("Roberta", _ENCODER_HEADS),
    EncoderLayout.BERT,
    "roberta.",
    _ROBERTA_HEAD,
    seq_classifier="classifier.out_proj.",
    positions=Positions.OFFSET,
)
_MODERNBERT_HEAD = HeadTransform(
    "head.dense.",
    activation_key="classifier_activation",
    norm_prefix="head.norm.",
    eps_key="norm_eps",
)

# One row per config model_type. *ForMaskedLM checkpoints carry their MLM head (sparse
# embeddings) on the base model; models/masked_lm.py holds each family's MLM head layout.
ENCODER_FAMILIES: dict[str, EncoderFamily] = {
    "bert": EncoderFamily(
        _classes("Bert", _ENCODER_HEADS), EncoderLayout.BERT, "bert.", _BERT_POOLER
    ),
    "distilbert": EncoderFamily(
        _classes("DistilBert", _ENCODER_HEADS),
        EncoderLayout.DISTILBERT,
        "distilbert.",
        HeadTransform("pre_classifier.", activation="relu"),
        activation_key="activation",
        eps_key=None,
    ),
    "roberta": _ROBERTA,
    "xlm-roberta": replace(_ROBERTA, classes=_classes("XLMRoberta", _ENCODER_HEADS)),
    "camembert": replace(_ROBERTA, classes=_classes("Camembert", _ENCODER_HEADS)),
    # MPNet hard-codes padding id 1 for its positions, whatever pad_token_id says.
    "mpnet": EncoderFamily(
        _classes("MPNet", _ENCODER_HEADS),
        EncoderLayout.MPNET,
        "mpnet.",
        _ROBERTA_HEAD,
        seq_classifier="classifier.out_proj.",
        positions=Positions.OFFSET,
        padding_idx=1,
        relative=Relative.BUCKETS,
    ),
    "modernbert": EncoderFamily(
        _classes("ModernBert", _ENCODER_HEADS),
        EncoderLayout.MODERNBERT,
        "model.",
        _MODERNBERT_HEAD,
        token_transform=_MODERNBERT_HEAD,
        positions=Positions.ROTARY,
        pre_norm=True,
        gated_mlp=True,
        activation_key="hidden_activation",
        eps_key="norm_eps",
    ),
    "nomic_bert": EncoderFamily(
        _classes("NomicBert", _ENCODER_HEADS),
        EncoderLayout.NOMIC,
        "nomic_bert.",
        HeadTransform("nomic_bert.pooler.dense."),
        positions=Positions.ROTARY,
        gated_mlp=True,
    ),
    "deberta-v2": EncoderFamily(
        _classes("DebertaV2", _ENCODER_HEADS),
        EncoderLayout.DEBERTA,
        "deberta.",
        HeadTransform("pooler.dense.", activation_key="pooler_hidden_act"),
        position_flag="position_biased_input",
        relative=Relative.DISENTANGLED,
    ),
}


def _encoder_entry(family: EncoderFamily, class_name: str) -> ArchitectureEntry:
    """The entry of an encoder class: the base class carries no head, the others one."""
    backbone = (family.prefix,)
    if class_name.endswith("ForSequenceClassification"):
        return ArchitectureEntry(
            Backbone.ENCODER,
            HeadKind.SEQUENCE_CLASSIFIER,
            backbone,
            family.seq_classifier,
            family.seq_transform,
        )
    if class_name.endswith("ForTokenClassification"):
        return ArchitectureEntry(
            Backbone.ENCODER,
            HeadKind.TOKEN_CLASSIFIER,
            backbone,
            "classifier.",
            family.token_transform,
        )
    if class_name.endswith("ForMaskedLM"):
        # a backbone saved alone (sentence-transformers) holds its tensors without the prefix
        return ArchitectureEntry(Backbone.ENCODER, HeadKind.MASKED_LM, (*backbone, ""))
    return ArchitectureEntry(Backbone.ENCODER, HeadKind.NONE, ("", *backbone))


def _decoder_entry(class_name: str) -> ArchitectureEntry:
    """The entry of a decoder class, by the transformers suffix its name ends with."""
    return next(e for s, e in _DECODER_SUFFIXES.items() if class_name.endswith(s))


ARCHITECTURES: dict[str, ArchitectureEntry] = {
    **{
        class_name: _decoder_entry(class_name)
        for family in DECODER_FAMILIES.values()
        for class_name in family.classes
    },
    **{
        class_name: _encoder_entry(family, class_name)
        for family in ENCODER_FAMILIES.values()
        for class_name in family.classes
    },
    **_EXTRA,
}


def supported_architectures() -> tuple[str, ...]:
    """Every architecture name load_model() accepts, sorted."""
    return tuple(sorted(ARCHITECTURES))

"""The records a family module fills: switch rows, head transforms, tensor names, MLM heads."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from poolserve.types.tasks import HeadKind


class Backbone(enum.Enum):
    """Which native forward runs the checkpoint."""

    DECODER = "decoder"
    ENCODER = "encoder"
    # a decoder with a vision tower whose rows stand in for image placeholders (Qwen-VL)
    VISION_DECODER = "vision_decoder"

    @property
    def is_decoder(self) -> bool:
        """Whether the backbone is a decoder (its heads read the last token by default)."""
        return self in (Backbone.DECODER, Backbone.VISION_DECODER)


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
    """How a checkpoint names its encoder tensors (each family module holds its names)."""

    BERT = "bert"
    DISTILBERT = "distilbert"
    MPNET = "mpnet"
    DEBERTA = "deberta"
    MODERNBERT = "modernbert"
    NOMIC = "nomic"
    GTE = "gte"
    JINA_V3 = "jina_v3"


class PerToken(enum.Enum):
    """How vLLM runs a sequence classifier on every token (its token_classify through a
    *ForSequenceClassification); an entry without one refuses that at start."""

    # the classifier after the backbone's pooler layer, never the pooler: vLLM's BERT, GTE and
    # ModernBERT pool through that layer and hand their classifier alone to token_classify
    CLASSIFIER = "classifier"
    # the whole head: a decoder's score, RoBERTa's classification head (dense, tanh, out_proj)
    HEAD = "head"


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
    # config.classifier_pooling values -> the sequence classifier's pooling ("cls", "mean", or
    # "late": the classifier on every token, its logits averaged); empty: an encoder reads the
    # field as it is, a decoder pools its last token
    classifier_pooling: tuple[tuple[str, str], ...] = ()
    # a sequence classifier's head on every token, as vLLM runs it (None: not served)
    per_token: PerToken | None = None


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
    bidirectional: bool = False  # always attends both ways, whatever the config says (EuroBERT)
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
    # its sequence classifier on every token, where vLLM serves the family (None: refused)
    per_token: PerToken | None = None


@dataclass(frozen=True)
class LayerNames:
    """Tensor names inside one encoder layer (without `.weight` / `.bias`)."""

    prefix: str  # "{i}" stands for the layer index
    qkv: tuple[str, ...]  # one fused projection, or query, key, value
    o: str
    attn_norm: str  # post-LN: after attention; pre-LN: before it (absent on ModernBERT's first)
    up: tuple[str, ...]  # plain: (up,); gated: one fused (activated half first) or (gate, up)
    down: str
    mlp_norm: str
    gate_second: bool = False  # one fused gated projection stored (up, gate): GTE


@dataclass(frozen=True)
class EmbeddingNames:
    """Encoder tensor names outside the layers; optional ones may be absent from a checkpoint."""

    word: str = "embeddings.word_embeddings"
    position: str = "embeddings.position_embeddings"
    token_type: str = "embeddings.token_type_embeddings"  # optional
    projection: str = "embeddings.embed_proj"  # optional (DeBERTa's embedding_size != hidden)
    norm: str = "embeddings.LayerNorm"
    final_norm: str | None = None


# One encoder layout's tensor names: outside the layers, inside each layer.
EncoderNames = tuple[EmbeddingNames, LayerNames]


@dataclass(frozen=True)
class MaskedLMHead:
    """One MLM head layout: a transform (dense, activation, LayerNorm), then the decoder."""

    transform: HeadTransform | None  # None: the decoder reads the final states (EuroBERT)
    decoder_prefix: str  # the decoder Linear; its own weight is read only when the config unties it
    embeddings: str  # the word embedding tensor `[vocab, hidden]` a tied decoder reuses
    bias: str | None = None  # the head's own bias (BERT's cls.predictions.bias), before decoder's


# The transformers class suffixes of a decoder family and of an encoder family.
DECODER_HEADS = ("Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification")
ENCODER_HEADS = ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification")


def encoder_entry(family: EncoderFamily, class_name: str) -> ArchitectureEntry:
    """The entry of an encoder class: the base class carries no head, the others one."""
    backbone = (family.prefix,)
    if class_name.endswith("ForSequenceClassification"):
        return ArchitectureEntry(
            Backbone.ENCODER,
            HeadKind.SEQUENCE_CLASSIFIER,
            backbone,
            family.seq_classifier,
            family.seq_transform,
            per_token=family.per_token,
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


def family_classes(prefix: str, suffixes: tuple[str, ...] = DECODER_HEADS) -> tuple[str, ...]:
    """transformers class names of one family: prefix + each suffix."""
    return tuple(prefix + suffix for suffix in suffixes)


@dataclass(frozen=True)
class MlpKeys:
    """A block's MLP: down(act(up(x))), or gated down(act(gate(x)) * up(x))."""

    up: str
    down: str
    gate: str | None = None


@dataclass(frozen=True)
class MergerKeys:
    """A patch merger's norm and its two Linears (GELU between)."""

    norm: str
    fc1: str
    fc2: str


@dataclass(frozen=True)
class VisionFamily:
    """How one Qwen-VL family's vision tower is laid out and runs (models/qwen_vision.py;
    transformers' modeling_<family>.py)."""

    width: str  # the config field of the blocks' width (Qwen2-VL's embed_dim)
    norm: str  # NORMS key of the blocks' and mergers' norms
    mlp: MlpKeys
    merger: MergerKeys
    patch_bias: bool
    windows: bool  # Qwen2.5-VL: window attention except at fullatt_block_indexes
    learned_positions: bool  # Qwen3-VL: pos_embed resized to each grid, added to the patches
    deepstack: bool  # Qwen3-VL: mergers of the states after deepstack_visual_indexes


@dataclass(frozen=True)
class PatchTower:
    """A vision tower whose every patch becomes one token of the decoder through a Linear
    projector (PaliGemma's SigLIP tower and multi_modal_projector; models/paligemma.py): where
    a checkpoint keeps each part (the first prefix holding it wins), and the image processor's
    class defaults where its config is silent."""

    text_prefixes: tuple[str, ...]
    tower_prefixes: tuple[str, ...]
    projector_prefixes: tuple[str, ...]
    processor_defaults: tuple[tuple[str, object], ...]  # (field, value) pairs


@dataclass(frozen=True)
class VisionLanguageFamily:
    """One family: its decoder's switch row and its vision tower's (a Qwen-VL tower, or a tower
    of fixed-size images whose patches are the decoder's image tokens)."""

    decoder: DecoderFamily
    tower: VisionFamily | PatchTower
    # M-RoPE positions for a prompt's images (transformers' get_rope_index); False: every token
    # at its index on all three rows, as ColQwen2ForRetrieval runs its model (inputs_embeds
    # without image_grid_thw), and as a one-row decoder reads its positions
    mrope: bool = True
    # the position of a prompt's first token (PaliGemma counts from 1)
    first_position: int = 0
    # attends both ways over the whole prompt, whatever its text config says (ColPali's
    # processor gives every token the one token type PaliGemma's mask makes a block of)
    bidirectional: bool = False


@dataclass(frozen=True)
class RetrievalPrompts:
    """How a retrieval processor (ColQwen2Processor, ColPaliProcessor) writes its prompts,
    where processor_config.json is silent: a text as `query_opening` (its `query_prefix`) +
    text + the pad token x augmentation + query_end, an image as `document_form` around the
    visual prompt (`document`), its one placeholder expanded."""

    query_prefix: str
    augmentation: int  # query augmentation tokens (the tokenizer's pad token) after the text
    query_end: str
    document: str
    # around the saved strings: {bos} the tokenizer's BOS token, {prefix} the query prefix,
    # {image} the image placeholder, {prompt} the visual prompt
    query_opening: str = "{prefix}"
    document_form: str = "{prompt}"
    # the processor turns the tokenizer's own BOS and EOS off (its forms write the BOS)
    no_tokenizer_specials: bool = False


@dataclass(frozen=True)
class WrappedVisionLanguage:
    """A class holding a vision-language model under a config field: the families it takes,
    by that config's model_type, and its processor's prompts."""

    config_field: str
    families: dict[str, VisionLanguageFamily]
    prompts: RetrievalPrompts

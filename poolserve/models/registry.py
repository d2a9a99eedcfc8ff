"""The tables assembled from the family modules (models/families/): architecture -> (backbone,
head, weight prefixes, head transform), the switch rows per model_type, each encoder layout's
tensor names, each family's MLM heads; the supported list."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import PretrainedConfig

from poolserve.models.dual_encoder import ARCHITECTURES as DUAL_ARCHITECTURES
from poolserve.models.families import (
    bert,
    colbert,
    deberta,
    distilbert,
    eurobert,
    gemma,
    granite,
    gte,
    jina_v3,
    llama,
    modernbert,
    mpnet,
    nomic,
    paligemma,
    phi3,
    qwen,
    qwen_vl,
    roberta,
)
from poolserve.models.families.records import (
    ArchitectureEntry,
    Backbone,
    DecoderFamily,
    EncoderFamily,
    EncoderLayout,
    EncoderNames,
    MaskedLMHead,
    PerToken,
    WrappedVisionLanguage,
    encoder_entry,
)
from poolserve.types.tasks import HeadKind

# One row per config model_type; the classes are those transformers defines for the family.
DECODER_FAMILIES: dict[str, DecoderFamily] = {
    **llama.FAMILIES,
    **qwen.FAMILIES,
    **gemma.FAMILIES,
    **phi3.FAMILIES,
    **granite.FAMILIES,
    **eurobert.FAMILIES,
    **qwen_vl.FAMILIES,
}
# One row per config model_type. *ForMaskedLM checkpoints carry their MLM head (sparse
# embeddings) on the base model; MASKED_LM_LAYOUTS holds each family's MLM head layouts.
ENCODER_FAMILIES: dict[str, EncoderFamily] = {
    **bert.FAMILIES,
    **distilbert.FAMILIES,
    **roberta.FAMILIES,
    **mpnet.FAMILIES,
    **modernbert.FAMILIES,
    **nomic.FAMILIES,
    **deberta.FAMILIES,
    **gte.FAMILIES,
    **jina_v3.FAMILIES,
}
# How each encoder layout names its tensors (outside the layers, inside each layer).
ENCODER_LAYOUTS: dict[EncoderLayout, EncoderNames] = {
    **bert.LAYOUTS,
    **distilbert.LAYOUTS,
    **mpnet.LAYOUTS,
    **deberta.LAYOUTS,
    **modernbert.LAYOUTS,
    **nomic.LAYOUTS,
    **gte.LAYOUTS,
    **jina_v3.LAYOUTS,
}
# model_type -> the MLM head layouts a checkpoint may use, tried in order: the first whose dense
# weight the checkpoint holds wins (transformers picks DeBERTa's by config.legacy instead). Every
# encoder family has one; a decoder family (EuroBERT) only where transformers has *ForMaskedLM.
MASKED_LM_LAYOUTS: dict[str, tuple[MaskedLMHead, ...]] = {
    **bert.MASKED_LM,
    **distilbert.MASKED_LM,
    **roberta.MASKED_LM,
    **mpnet.MASKED_LM,
    **modernbert.MASKED_LM,
    **nomic.MASKED_LM,
    **deberta.MASKED_LM,
    **gte.MASKED_LM,
    **jina_v3.MASKED_LM,
    **eurobert.MASKED_LM,
}
# Classes outside the families' transformers classes (Hub remote code, ColBERT), and decoder
# heads the suffix table does not describe (EuroBERT's).
_EXTRA: dict[str, ArchitectureEntry] = {
    **colbert.ARCHITECTURES,
    **qwen.ARCHITECTURES,
    **gte.ARCHITECTURES,
    **jina_v3.ARCHITECTURES,
    **eurobert.ARCHITECTURES,
    **qwen_vl.ARCHITECTURES,
    **paligemma.ARCHITECTURES,
}
# Classes holding a vision-language model under a config field (the retrievers): the families
# they take and their processors' prompts.
WRAPPED: dict[str, WrappedVisionLanguage] = {**qwen_vl.WRAPPED, **paligemma.WRAPPED}
# config.json model_types (or, where the model_type is a native one, architectures) written for
# Hub remote code -> the reader that builds a native config.
REMOTE_CONFIGS: dict[str, Callable[[dict[str, Any]], PretrainedConfig]] = {
    **gte.CONFIGS,
    **jina_v3.CONFIGS,
}

_DECODER_SUFFIXES: dict[str, ArchitectureEntry] = {
    "ForCausalLM": ArchitectureEntry(Backbone.DECODER, HeadKind.NONE, ("model.",)),
    # vLLM's as_seq_cls_model runs the score Linear on every token for token_classify
    "ForSequenceClassification": ArchitectureEntry(
        Backbone.DECODER,
        HeadKind.SEQUENCE_CLASSIFIER,
        ("model.",),
        "score.",
        per_token=PerToken.HEAD,
    ),
    "ForTokenClassification": ArchitectureEntry(
        Backbone.DECODER, HeadKind.TOKEN_CLASSIFIER, ("model.",), "score."
    ),
    "Model": ArchitectureEntry(Backbone.DECODER, HeadKind.NONE, ("", "model.")),
}


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
        class_name: encoder_entry(family, class_name)
        for family in ENCODER_FAMILIES.values()
        for class_name in family.classes
    },
    **_EXTRA,
}


def supported_architectures() -> tuple[str, ...]:
    """Every architecture name load_model() accepts, sorted (dual encoders included)."""
    return tuple(sorted({*ARCHITECTURES, *DUAL_ARCHITECTURES}))

"""DeBERTa-v2/v3: disentangled c2p/p2c scores, optional absolute positions, two MLM layouts."""

from __future__ import annotations

from transformers import PretrainedConfig

from poolserve.models.families.bert import BERT_MLP, bert_predictions
from poolserve.models.families.records import (
    ENCODER_HEADS,
    EmbeddingNames,
    EncoderFamily,
    EncoderLayout,
    EncoderNames,
    HeadTransform,
    LayerNames,
    MaskedLMHead,
    Relative,
    family_classes,
)

FAMILIES: dict[str, EncoderFamily] = {
    "deberta-v2": EncoderFamily(
        family_classes("DebertaV2", ENCODER_HEADS),
        EncoderLayout.DEBERTA,
        "deberta.",
        HeadTransform("pooler.dense.", activation_key="pooler_hidden_act"),
        position_flag="position_biased_input",
        relative=Relative.DISENTANGLED,
    ),
}

LAYOUTS: dict[EncoderLayout, EncoderNames] = {
    EncoderLayout.DEBERTA: (
        EmbeddingNames(),
        LayerNames(
            "encoder.layer.{i}.",
            tuple(f"attention.self.{n}_proj" for n in ("query", "key", "value")),
            "attention.output.dense",
            "attention.output.LayerNorm",
            *BERT_MLP,
        ),
    ),
}

# DeBERTa-v2/v3 checkpoints without `legacy` layout keep the head under lm_predictions and always
# decode with the word embeddings (there is no decoder Linear to untie).
_LM_PREDICTIONS = MaskedLMHead(
    HeadTransform(
        "lm_predictions.lm_head.dense.",
        activation_key="hidden_act",
        norm_prefix="lm_predictions.lm_head.LayerNorm.",
    ),
    "lm_predictions.lm_head.decoder.",
    "deberta.embeddings.word_embeddings.weight",
    "lm_predictions.lm_head.bias",
)
MASKED_LM: dict[str, tuple[MaskedLMHead, ...]] = {
    "deberta-v2": (bert_predictions("deberta."), _LM_PREDICTIONS),
}

_SCORE_TERMS = ("c2p", "p2c")


def deberta_score_terms(config: PretrainedConfig) -> tuple[str, ...]:
    """DeBERTa's position terms in the attention scores (c2p, p2c), as pos_att_type lists them."""
    listed = getattr(config, "pos_att_type", None) or ()
    return tuple(term for term in _SCORE_TERMS if term in listed)

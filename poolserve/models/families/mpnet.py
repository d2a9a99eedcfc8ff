"""MPNet: offset positions from a fixed padding id, bucketed relative bias, RoBERTa's heads."""

from __future__ import annotations

from poolserve.models.families.bert import BERT_MLP
from poolserve.models.families.records import (
    ENCODER_HEADS,
    EmbeddingNames,
    EncoderFamily,
    EncoderLayout,
    EncoderNames,
    LayerNames,
    MaskedLMHead,
    Positions,
    Relative,
    family_classes,
)
from poolserve.models.families.roberta import ROBERTA_HEAD, roberta_lm_head

FAMILIES: dict[str, EncoderFamily] = {
    # MPNet hard-codes padding id 1 for its positions, whatever pad_token_id says.
    "mpnet": EncoderFamily(
        family_classes("MPNet", ENCODER_HEADS),
        EncoderLayout.MPNET,
        "mpnet.",
        ROBERTA_HEAD,
        seq_classifier="classifier.out_proj.",
        positions=Positions.OFFSET,
        padding_idx=1,
        relative=Relative.BUCKETS,
    ),
}

LAYOUTS: dict[EncoderLayout, EncoderNames] = {
    EncoderLayout.MPNET: (
        EmbeddingNames(),
        LayerNames(
            "encoder.layer.{i}.",
            tuple(f"attention.attn.{n}" for n in ("q", "k", "v")),
            "attention.attn.o",
            "attention.LayerNorm",
            *BERT_MLP,
        ),
    ),
}

MASKED_LM: dict[str, tuple[MaskedLMHead, ...]] = {
    "mpnet": (roberta_lm_head("mpnet."),),
}

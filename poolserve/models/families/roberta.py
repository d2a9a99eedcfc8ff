"""RoBERTa, XLM-RoBERTa and CamemBERT: BERT's tensors, offset positions, dense + tanh head."""

from __future__ import annotations

from dataclasses import replace

from poolserve.models.families.records import (
    ENCODER_HEADS,
    EncoderFamily,
    EncoderLayout,
    HeadTransform,
    MaskedLMHead,
    PerToken,
    Positions,
    family_classes,
)

# dense + tanh, then classifier.out_proj (MPNet's classifier too)
ROBERTA_HEAD = HeadTransform("classifier.dense.")
_ROBERTA = EncoderFamily(
    family_classes("Roberta", ENCODER_HEADS),
    EncoderLayout.BERT,
    "roberta.",
    ROBERTA_HEAD,
    seq_classifier="classifier.out_proj.",
    positions=Positions.OFFSET,
    per_token=PerToken.HEAD,  # vLLM hands RobertaClassificationHead whole to token_classify
)
FAMILIES: dict[str, EncoderFamily] = {
    "roberta": _ROBERTA,
    "xlm-roberta": replace(_ROBERTA, classes=family_classes("XLMRoberta", ENCODER_HEADS)),
    "camembert": replace(_ROBERTA, classes=family_classes("Camembert", ENCODER_HEADS)),
}


def roberta_lm_head(backbone: str) -> MaskedLMHead:
    """RoBERTa's and MPNet's layout: lm_head.dense, exact GELU (whatever hidden_act says)."""
    transform = HeadTransform(
        "lm_head.dense.", activation="gelu", norm_prefix="lm_head.layer_norm."
    )
    word_embeddings = f"{backbone}embeddings.word_embeddings.weight"
    return MaskedLMHead(transform, "lm_head.decoder.", word_embeddings, "lm_head.bias")


_LM_HEAD = (roberta_lm_head("roberta."),)
MASKED_LM: dict[str, tuple[MaskedLMHead, ...]] = {
    "roberta": _LM_HEAD,
    "xlm-roberta": _LM_HEAD,
    "camembert": _LM_HEAD,
}

# BAAI's bge-m3 ships its sparse and ColBERT heads beside an XLM-R base model of this family
# (poolserve/models/bge_m3.py).
BGE_M3_BACKBONES = frozenset({"xlm-roberta"})

"""BERT: post-LN encoder, pooler dense + tanh before its classifier; its tensor and MLM names.

The BERT tensor layout also serves RoBERTa's family; its MLP names and MLM head layout recur in
MPNet, DeBERTa and NomicBERT checkpoints.
"""

from __future__ import annotations

from poolserve.models.families.records import (
    ENCODER_HEADS,
    EmbeddingNames,
    EncoderFamily,
    EncoderLayout,
    EncoderNames,
    HeadTransform,
    LayerNames,
    MaskedLMHead,
    PerToken,
    family_classes,
)

FAMILIES: dict[str, EncoderFamily] = {
    "bert": EncoderFamily(
        family_classes("Bert", ENCODER_HEADS),
        EncoderLayout.BERT,
        "bert.",
        HeadTransform("bert.pooler.dense."),
        per_token=PerToken.CLASSIFIER,  # vLLM: the pooler is the classify task's pooling
    ),
}

# up, down and the norm after the MLP
BERT_MLP = (("intermediate.dense",), "output.dense", "output.LayerNorm")
LAYOUTS: dict[EncoderLayout, EncoderNames] = {
    EncoderLayout.BERT: (
        EmbeddingNames(),
        LayerNames(
            "encoder.layer.{i}.",
            tuple(f"attention.self.{n}" for n in ("query", "key", "value")),
            "attention.output.dense",
            "attention.output.LayerNorm",
            *BERT_MLP,
        ),
    ),
}


def bert_predictions(
    backbone: str, head: str = "cls.predictions.", norm: str = "LayerNorm"
) -> MaskedLMHead:
    """BERT's layout: transform.dense, hidden_act, transform.<norm>, decoder, separate bias."""
    transform = HeadTransform(
        f"{head}transform.dense.",
        activation_key="hidden_act",
        norm_prefix=f"{head}transform.{norm}.",
    )
    word_embeddings = f"{backbone}embeddings.word_embeddings.weight"
    return MaskedLMHead(transform, f"{head}decoder.", word_embeddings, f"{head}bias")


MASKED_LM: dict[str, tuple[MaskedLMHead, ...]] = {
    "bert": (bert_predictions("bert."),),
}

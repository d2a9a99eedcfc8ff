"""DistilBERT: its own tensor names, a fixed LayerNorm eps, ReLU pre-classifier, vocab head."""

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
    family_classes,
)

# DistilBERT's LayerNorms are built with a fixed eps, whatever its config says.
LAYER_NORM_EPS = 1e-12

FAMILIES: dict[str, EncoderFamily] = {
    "distilbert": EncoderFamily(
        family_classes("DistilBert", ENCODER_HEADS),
        EncoderLayout.DISTILBERT,
        "distilbert.",
        HeadTransform("pre_classifier.", activation="relu"),
        activation_key="activation",
        eps_key=None,
    ),
}

LAYOUTS: dict[EncoderLayout, EncoderNames] = {
    EncoderLayout.DISTILBERT: (
        EmbeddingNames(),
        LayerNames(
            "transformer.layer.{i}.",
            tuple(f"attention.{n}_lin" for n in ("q", "k", "v")),
            "attention.out_lin",
            "sa_layer_norm",
            ("ffn.lin1",),
            "ffn.lin2",
            "output_layer_norm",
        ),
    ),
}

MASKED_LM: dict[str, tuple[MaskedLMHead, ...]] = {
    "distilbert": (
        MaskedLMHead(
            HeadTransform(
                "vocab_transform.",
                activation_key="activation",
                norm_prefix="vocab_layer_norm.",
                eps=LAYER_NORM_EPS,
            ),
            "vocab_projector.",
            "distilbert.embeddings.word_embeddings.weight",
        ),
    ),
}

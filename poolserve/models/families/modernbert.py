"""ModernBERT: pre-LN, GeGLU, rotary with local/global layers, dense + act + norm heads."""

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
    Positions,
    family_classes,
)

# The head every ModernBERT classifier (sequence and token) and its MLM head apply first.
_HEAD = HeadTransform(
    "head.dense.",
    activation_key="classifier_activation",
    norm_prefix="head.norm.",
    eps_key="norm_eps",
)

FAMILIES: dict[str, EncoderFamily] = {
    "modernbert": EncoderFamily(
        family_classes("ModernBert", ENCODER_HEADS),
        EncoderLayout.MODERNBERT,
        "model.",
        _HEAD,
        token_transform=_HEAD,
        per_token=PerToken.CLASSIFIER,  # vLLM: the head is ModernBertPooler's, not per token
        positions=Positions.ROTARY,
        pre_norm=True,
        gated_mlp=True,
        activation_key="hidden_activation",
        eps_key="norm_eps",
    ),
}

LAYOUTS: dict[EncoderLayout, EncoderNames] = {
    # Wi holds GeGLU's activated half first: act(input) * gate.
    EncoderLayout.MODERNBERT: (
        EmbeddingNames(
            word="embeddings.tok_embeddings", norm="embeddings.norm", final_norm="final_norm"
        ),
        LayerNames(
            "layers.{i}.", ("attn.Wqkv",), "attn.Wo", "attn_norm", ("mlp.Wi",), "mlp.Wo", "mlp_norm"
        ),
    ),
}

MASKED_LM: dict[str, tuple[MaskedLMHead, ...]] = {
    "modernbert": (MaskedLMHead(_HEAD, "decoder.", "model.embeddings.tok_embeddings.weight"),),
}

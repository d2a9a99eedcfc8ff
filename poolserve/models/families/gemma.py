"""Gemma 1, 2 and 3 (text): (1 + weight) norms, scaled embeddings, soft-caps, bidirectional flag."""

from __future__ import annotations

from poolserve.models.families.records import DecoderFamily, family_classes

# Gemma 1's row (PaliGemma's decoder: families/paligemma.py)
GEMMA = DecoderFamily(
    family_classes("Gemma"), norm_offset=True, embed_scale=True, bidirectional_flag=True
)
FAMILIES: dict[str, DecoderFamily] = {
    "gemma": GEMMA,
    "gemma2": DecoderFamily(
        family_classes("Gemma2"),
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
}

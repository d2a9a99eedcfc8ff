"""Granite: embedding, residual and attention multipliers and the LM head's logits_scaling."""

from __future__ import annotations

from poolserve.models.families.records import DecoderFamily, family_classes

FAMILIES: dict[str, DecoderFamily] = {
    "granite": DecoderFamily(family_classes("Granite", ("Model", "ForCausalLM")), multipliers=True),
}

"""Phi-3: fused qkv_proj / gate_up_proj are read as is; partial rotary comes from its config."""

from __future__ import annotations

from poolserve.models.families.records import DecoderFamily, family_classes

FAMILIES: dict[str, DecoderFamily] = {
    "phi3": DecoderFamily(family_classes("Phi3")),
}

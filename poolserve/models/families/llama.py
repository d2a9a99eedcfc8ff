"""Llama and Mistral: the plain rows of the one decoder (no switch on)."""

from __future__ import annotations

from poolserve.models.families.records import DecoderFamily, family_classes

FAMILIES: dict[str, DecoderFamily] = {
    "llama": DecoderFamily(family_classes("Llama")),
    "mistral": DecoderFamily(family_classes("Mistral")),
}

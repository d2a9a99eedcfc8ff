"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a Qwen2 or Qwen3 decoder fed by a vision tower
(models/vision_language.py), one row per config model_type; their decoders' rows by the text
config's model_type."""

from __future__ import annotations

from dataclasses import dataclass

from poolserve.models.families.records import DecoderFamily


@dataclass(frozen=True)
class VisionLanguageFamily:
    """One family: its classes, its decoder's switch row and its vision tower's."""

    classes: tuple[str, ...]
    decoder: DecoderFamily
    vision: str  # qwen_vision.VISION_FAMILIES key


# The classes whose checkpoints hold both the tower and the decoder. *ForSequenceClassification
# is no transformers class: vLLM's name (through --hf-overrides) for the LLM reranker read
# through its LM head's rows (classifier_from_token), Qwen3-VL-Reranker's.
EMBEDDERS = ("ForConditionalGeneration", "Model")
RERANKERS = ("ForSequenceClassification",)


def _classes(prefix: str) -> tuple[str, ...]:
    """The family's class names."""
    return tuple(prefix + suffix for suffix in (*EMBEDDERS, *RERANKERS))


# The decoders, by the text config's model_type (no class of their own).
TEXT_FAMILIES: dict[str, DecoderFamily] = {
    "qwen2_vl_text": DecoderFamily(()),
    "qwen2_5_vl_text": DecoderFamily(()),
    "qwen3_vl_text": DecoderFamily((), qk_norm=True),
}
FAMILIES: dict[str, VisionLanguageFamily] = {
    "qwen2_vl": VisionLanguageFamily(
        _classes("Qwen2VL"), TEXT_FAMILIES["qwen2_vl_text"], "qwen2_vl"
    ),
    "qwen2_5_vl": VisionLanguageFamily(
        _classes("Qwen2_5_VL"), TEXT_FAMILIES["qwen2_5_vl_text"], "qwen2_5_vl"
    ),
    "qwen3_vl": VisionLanguageFamily(
        _classes("Qwen3VL"), TEXT_FAMILIES["qwen3_vl_text"], "qwen3_vl"
    ),
}
ARCHITECTURES: dict[str, VisionLanguageFamily] = {
    name: family for family in FAMILIES.values() for name in family.classes
}

"""Qwen2 and Qwen3 (per-head q/k RMSNorm), and the Hub's Qwen2 reward classes."""

from __future__ import annotations

from poolserve.models.families.records import (
    ArchitectureEntry,
    Backbone,
    DecoderFamily,
    family_classes,
)
from poolserve.types.tasks import HeadKind

FAMILIES: dict[str, DecoderFamily] = {
    "qwen2": DecoderFamily(family_classes("Qwen2")),
    "qwen3": DecoderFamily(family_classes("Qwen3"), qk_norm=True),
}
# Remote-code classes on the Hub; their backbone is plain Qwen2, the head is native here.
ARCHITECTURES: dict[str, ArchitectureEntry] = {
    "Qwen2ForProcessRewardModel": ArchitectureEntry(
        Backbone.DECODER, HeadKind.PROCESS_REWARD, ("model.",), "score."
    ),
    "Qwen2ForRewardModel": ArchitectureEntry(
        Backbone.DECODER, HeadKind.TOKEN_REWARD, ("model.",), "score."
    ),
}

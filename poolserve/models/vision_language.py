"""Vision-language embedders (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the packed decoder with a vision
tower whose merged patches stand in the token stream in place of their placeholders.

The decoder is the shared one (decoder.py) with M-RoPE (rope.py) and, for Qwen3-VL, deepstack
rows added after its first layers; the vision tower is qwen_vision.py. A request's images run
through the tower once, when the first of its chunks holding image tokens runs, and their rows
are kept for its later chunks (engine/vision_rows.py). Each family's facts are one row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from poolserve.models.attention import AttentionBackend
from poolserve.models.decoder import DecoderModel
from poolserve.models.families.qwen_vl import VisionLanguageFamily
from poolserve.models.qwen_vision import QwenVision, VisionOutput
from poolserve.models.weights import strip_prefix
from poolserve.types.errors import ModelLoadError
from poolserve.types.vision import InlineImages, read_grid_processing

# Where checkpoints keep each part: transformers 5 saves `model.language_model.` and
# `model.visual.`; Qwen2-VL's Hub checkpoints `model.` and `visual.`. The first that holds the
# part wins.
TEXT_PREFIXES = ("model.language_model.", "language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.")


def _part(state: dict[str, torch.Tensor], prefixes: tuple[str, ...], marker: str) -> str:
    """The first prefix under which `marker` is stored."""
    for prefix in prefixes:
        if f"{prefix}{marker}" in state:
            return prefix
    raise ModelLoadError(f"no {marker} under any of the prefixes {list(prefixes)}")


class VisionLanguageModel(DecoderModel):
    """The decoder over packed tokens, with the vision tower its image tokens come from."""

    position_rows = 3

    def __init__(
        self,
        config: PretrainedConfig,
        state: dict[str, torch.Tensor],
        family: VisionLanguageFamily,
        backend: AttentionBackend,
        placement: tuple[torch.device, torch.dtype],
    ) -> None:
        text_state = strip_prefix(state, _part(state, TEXT_PREFIXES, "embed_tokens.weight"))
        super().__init__(config.text_config, text_state, family.decoder, backend, placement)
        vision_prefix = _part(state, VISION_PREFIXES, "patch_embed.proj.weight")
        self.visual = QwenVision(
            family.tower, config.vision_config, strip_prefix(state, vision_prefix), placement
        )

    def embed_images(
        self, patches: torch.Tensor, grids: tuple[tuple[int, int, int], ...]
    ) -> VisionOutput:
        """Every image's merged tokens (and deepstack rows), images in order."""
        return self.visual(patches, grids)


def inline_images(
    path: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
) -> InlineImages:
    """What the front ends need to place images in a prompt: the checkpoint's image processor
    (preprocessor_config.json), its placeholder token, and an image's text (the vision start,
    placeholder and vision end tokens) for a score template's image documents."""
    file = path / "preprocessor_config.json"
    if not file.is_file():
        raise ModelLoadError(f"{path} has no preprocessor_config.json: its images cannot be read")
    processing = read_grid_processing(json.loads(file.read_text()))
    merge = int(config.vision_config.spatial_merge_size)
    patch = int(config.vision_config.patch_size)
    if (processing.merge_size, processing.patch_size) != (merge, patch):
        raise ModelLoadError(
            f"preprocessor_config.json's patch {processing.patch_size} and merge "
            f"{processing.merge_size} differ from the vision tower's {patch} and {merge}"
        )
    ids = {
        name: int(getattr(config, name))
        for name in ("vision_start_token_id", "image_token_id", "vision_end_token_id")
    }
    tokens: dict[str, str] = {}
    for name, token_id in ids.items():
        token = tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(token, str):
            raise ModelLoadError(f"the tokenizer has no token {token_id} ({name})")
        tokens[name] = token
    return InlineImages(
        processing,
        tokens["image_token_id"],
        ids["image_token_id"],
        ids["vision_start_token_id"],
        placeholder="".join(tokens.values()),  # start, placeholder, end: vLLM's image text
    )


def text_config(config: PretrainedConfig) -> Any:
    """The decoder's config, which holds the sizes every other layer reads."""
    return config.text_config

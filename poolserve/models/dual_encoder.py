"""Dual encoders (CLIP, SigLIP, SigLIP 2): a text tower and an image tower that embed into one
space.

The text tower runs as any backbone over the packed token stream (its hidden states after the
final LayerNorm; the pooled token's projection is the embed head's, as a sentence-transformers
Dense). The image tower runs in the same step over that step's images, batched (every image of a
CLIP or SigLIP checkpoint has the same size; SigLIP 2's naflex images each their own grid of
patches, padded and masked: naflex.py), and gives each image's embedding directly: its pooled
state and projection, as `get_image_features` returns it. Each family's facts are one
`DualFamily` row.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from poolserve.models.attention import AttentionBackend, AttentionMetadata
from poolserve.models.kv_cache import PagedKVCache
from poolserve.models.naflex import NaflexEmbeddings
from poolserve.models.packed import PackedModel
from poolserve.models.towers import (
    Affine,
    MapHead,
    TowerLayer,
    affine,
    dense_attention,
    tower_geometry,
)
from poolserve.types.errors import ModelLoadError
from poolserve.types.images import ImageInputs, ImageProcessing, read_naflex, read_processing


@dataclass(frozen=True)
class DualFamily:
    """How one family lays out and runs its two towers (transformers' modeling_<family>.py)."""

    classes: tuple[str, ...]
    causal_text: bool  # CLIP's text tower attends causally; SigLIP's both ways
    text_head: str  # the pooled text state's Linear (the embed head's projection)
    text_head_bias: bool
    image_head: str | None  # the pooled image state's Linear; None: the tower's own head (MAP)
    class_token: bool  # a learned CLS prepended to the patches (CLIP), read as the pooled state
    pre_norm: bool  # a LayerNorm before the first layer (CLIP's pre_layrnorm)
    patch_bias: bool
    square_sizes: bool  # a bare number as the processor's size means (n, n)
    # texts padded to max_position_embeddings with the pad token, as the family was trained
    # and its processor is documented to be called (SigLIP: padding="max_length")
    pad_texts: bool
    # images of any aspect as grids of flattened patches, positions resized to each (SigLIP 2)
    naflex: bool = False


FAMILIES: dict[str, DualFamily] = {
    "clip": DualFamily(
        classes=("CLIPModel",),
        causal_text=True,
        text_head="text_projection.",
        text_head_bias=False,
        image_head="visual_projection.",
        class_token=True,
        pre_norm=True,
        patch_bias=False,
        square_sizes=False,
        pad_texts=False,
    ),
    "siglip": DualFamily(
        classes=("SiglipModel",),
        causal_text=False,
        text_head="text_model.head.",
        text_head_bias=True,
        image_head=None,
        class_token=False,
        pre_norm=False,
        patch_bias=True,
        square_sizes=True,
        pad_texts=True,
    ),
    # SigLIP's towers; the image tower's patches a Linear over naflex grids
    "siglip2": DualFamily(
        classes=("Siglip2Model",),
        causal_text=False,
        text_head="text_model.head.",
        text_head_bias=True,
        image_head=None,
        class_token=False,
        pre_norm=False,
        patch_bias=True,
        square_sizes=True,
        pad_texts=True,
        naflex=True,
    ),
}
ARCHITECTURES = {name: family for family in FAMILIES.values() for name in family.classes}
DUAL_NAMES = "CLIP, SigLIP, SigLIP 2"  # the families, as messages name them


class VisionTower(torch.nn.Module):
    """Patches, positions, layers, the pooled state and its projection: an image's embedding."""

    def __init__(
        self,
        family: DualFamily,
        config: Any,
        state: dict[str, torch.Tensor],
        projection: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.family, self.geometry = family, tower_geometry(config)
        self.patch_size = int(config.patch_size)
        p = "vision_model."
        patch_bias = state.get(f"{p}embeddings.patch_embedding.bias")
        self.patches: Affine = (
            state[f"{p}embeddings.patch_embedding.weight"],
            patch_bias if family.patch_bias else None,
        )
        self.naflex = NaflexEmbeddings(state, f"{p}embeddings.") if family.naflex else None
        self.positions = state[f"{p}embeddings.position_embedding.weight"]
        self.class_embedding = (
            state[f"{p}embeddings.class_embedding"] if family.class_token else None
        )
        self.pre_norm = affine(state, f"{p}pre_layrnorm.") if family.pre_norm else None
        self.layers = torch.nn.ModuleList(
            TowerLayer(state, f"{p}encoder.layers.{i}.", self.geometry)
            for i in range(config.num_hidden_layers)
        )
        self.post_norm = affine(state, f"{p}post_layernorm.")
        self.projection = projection
        self.map_head = None if family.class_token else MapHead(state, f"{p}head.", self.geometry)
        self.num_tokens = int(self.positions.shape[0])

    @torch.inference_mode()
    def forward(
        self, pixels: torch.Tensor, grids: tuple[tuple[int, int], ...] = ()
    ) -> torch.Tensor:  # [B, 3, H, W] (naflex: [B, N, patch_width]) -> [B, out]
        """Each image's embedding, as the family's get_image_features."""
        if self.naflex is not None:
            return self._naflex(pixels, grids)
        g = self.geometry
        weight, bias = self.patches
        grid = F.conv2d(pixels.to(weight.dtype), weight, bias, stride=self.patch_size)
        x = grid.flatten(2).transpose(1, 2)  # [B, num_patches, hidden]
        if self.class_embedding is not None:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
        if x.shape[1] != self.num_tokens:
            raise ValueError(f"an image of {x.shape[1]} tokens; the tower takes {self.num_tokens}")
        x = x + self.positions
        if self.pre_norm is not None:
            x = F.layer_norm(x, (g.hidden,), *self.pre_norm, g.eps)
        for layer in self.layers:
            x = layer(x, dense_attention)
        if self.map_head is not None:
            return self.map_head(F.layer_norm(x, (g.hidden,), *self.post_norm, g.eps))
        pooled = F.layer_norm(x[:, 0], (g.hidden,), *self.post_norm, g.eps)
        return pooled if self.projection is None else F.linear(pooled, self.projection)

    def _naflex(self, pixels: torch.Tensor, grids: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """SigLIP 2: padded patch grids, every attention masked to each image's own patches."""
        assert self.naflex is not None and self.map_head is not None
        g = self.geometry
        x, mask = self.naflex(pixels, grids)  # [B, N, hidden], [B, N]
        keys = mask[:, None, None, :]  # [B, 1, 1, N]: every head and query sees real patches

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return dense_attention(q, k, v, keys)

        for layer in self.layers:
            x = layer(x, attend)
        return self.map_head(F.layer_norm(x, (g.hidden,), *self.post_norm, g.eps), keys)


class DualEncoderModel(PackedModel):
    """The text tower over the packed stream; `embed_images` runs the image tower."""

    def __init__(
        self,
        family: DualFamily,
        config: PretrainedConfig,
        state: dict[str, torch.Tensor],
        backend: AttentionBackend,
        images: ImageInputs,
    ) -> None:
        super().__init__()
        text = config.text_config
        self.family, self.backend, self.images = family, backend, images
        self.geometry = tower_geometry(text)
        self.vocab_size = text.vocab_size
        p = "text_model."
        self.words = state[f"{p}embeddings.token_embedding.weight"]
        self.positions = state[f"{p}embeddings.position_embedding.weight"]
        self.layers = torch.nn.ModuleList(
            TowerLayer(state, f"{p}encoder.layers.{i}.", self.geometry)
            for i in range(text.num_hidden_layers)
        )
        self.final_norm = affine(state, f"{p}final_layer_norm.")
        projection = state.get(f"{family.image_head}weight") if family.image_head else None
        self.vision = VisionTower(family, config.vision_config, state, projection)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn: AttentionMetadata,
        kv_cache: PagedKVCache | None,
        out: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The text tower's states after its final LayerNorm (whole prompts, never chunked)."""
        self.check_inputs(input_ids)
        if attn.has_context:
            raise ValueError("a dual encoder's text tower runs whole prompts")
        g = self.geometry
        x = self.words[input_ids] + self.positions[positions]  # [num_tokens, hidden]
        meta = dataclasses.replace(attn, causal=self.family.causal_text)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.backend.attend(
                q,
                k,
                v,
                layer=0,
                meta=meta,
                kv_cache=None,
                sliding_window=None,
                scale=1 / math.sqrt(g.head_dim),
            )

        for layer in self.layers:
            x = layer(x, attend)
        x = F.layer_norm(x, (g.hidden,), *self.final_norm, g.eps)
        return self.deliver(x, out)

    def embed_images(
        self, pixels: torch.Tensor, grids: tuple[tuple[int, int], ...] = ()
    ) -> torch.Tensor:  # [B, 3, H, W] (naflex: [B, N, patch_width]) -> [B, out]
        """Each image's embedding (the image tower's pooled state through its projection)."""
        return self.vision(pixels, grids)


def image_inputs(path: Path, family: DualFamily, config: PretrainedConfig) -> ImageInputs:
    """The checkpoint's image processor and the tokens one image costs in a step."""
    processor = path / "preprocessor_config.json"
    if not processor.is_file():
        raise ModelLoadError(f"{family.classes[0]}: preprocessor_config.json is missing")
    try:
        raw = json.loads(processor.read_text())
        if family.naflex:
            return _naflex_inputs(read_naflex(raw), config)
        steps = read_processing(raw, square=family.square_sizes)
    except ValueError as exc:
        raise ModelLoadError(f"preprocessor_config.json: {exc}") from exc
    vision = config.vision_config
    size = vision.image_size
    if steps.output_size != (size, size):
        raise ModelLoadError(
            f"the image processor gives {steps.output_size} pixels; the tower takes {size}x{size}"
        )
    patches = (size // vision.patch_size) ** 2
    width = config.projection_dim if family.image_head else vision.hidden_size
    return ImageInputs(steps, patches + int(family.class_token), int(width), vision.num_channels)


def _naflex_inputs(steps: ImageProcessing, config: PretrainedConfig) -> ImageInputs:
    """SigLIP 2: an image costs its tower's padded sequence, max_num_patches tokens."""
    vision = config.vision_config
    naflex = steps.naflex
    assert naflex is not None
    if naflex.patch_size != vision.patch_size:
        raise ModelLoadError(
            f"the image processor cuts {naflex.patch_size}-pixel patches; the tower takes "
            f"{vision.patch_size}"
        )
    if vision.num_channels != 3:  # images are loaded as RGB
        raise ModelLoadError(f"an image tower of {vision.num_channels} channels is not supported")
    if not getattr(vision, "vision_use_head", True):
        raise ModelLoadError("a SigLIP 2 image tower without its pooling head is not supported")
    return ImageInputs(steps, naflex.max_num_patches, int(vision.hidden_size), vision.num_channels)


def text_head(
    family: DualFamily, state: dict[str, torch.Tensor], device: torch.device
) -> torch.nn.Linear:
    """The pooled text state's Linear (float32, as every head), the embed head's projection."""
    weight = state[f"{family.text_head}weight"]
    bias = state.get(f"{family.text_head}bias") if family.text_head_bias else None
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        head.weight.copy_(weight)
        if bias is not None:
            head.bias.copy_(bias)
    return head.to(device=device, dtype=torch.float32).requires_grad_(False)

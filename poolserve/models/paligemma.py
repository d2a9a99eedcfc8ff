"""PaliGemma inside ColPali: the packed Gemma decoder with a SigLIP vision tower whose every patch,
through the Linear projector, stands in the token stream in place of one image placeholder.

As transformers' PaliGemmaModel runs it: the tower's last hidden state (after its post
LayerNorm, no pooling head) through `multi_modal_projector`, unscaled, replaces the
placeholders' embeddings after the token embeddings' sqrt(hidden) scale; positions count from
1; ColPali's prompts attend both ways over the whole prompt (the family's row), so a prompt
runs whole. Every image has the processor's one size, so the tower runs a step's images as
one batch of equal sequences. The image processor is SigLIP's (`SiglipImageProcessorPil`),
read into the grid record the front ends cut patches by (types/vision.py): one frame, none
merged, a patch per token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from poolserve.models.adapters import AdapterSegments
from poolserve.models.attention import AttentionBackend, AttentionMetadata
from poolserve.models.decoder import DecoderModel, VisionRows
from poolserve.models.families.records import PatchTower, VisionLanguageFamily
from poolserve.models.kv_cache import PagedKVCache
from poolserve.models.qwen_vision import VisionOutput
from poolserve.models.registry import DECODER_FAMILIES
from poolserve.models.towers import Affine, TowerLayer, affine, dense_attention, tower_geometry
from poolserve.models.vision_language import image_processor, part, retrieval_forms
from poolserve.models.weights import strip_prefix
from poolserve.types.errors import ModelLoadError, UnsupportedArchitectureError
from poolserve.types.images import read_processing
from poolserve.types.vision import InlineImages, fixed_processing


def _tower(family: VisionLanguageFamily) -> PatchTower:
    tower = family.tower
    assert isinstance(tower, PatchTower)
    return tower


class PatchEncoder(torch.nn.Module):
    """SigLIP's vision transformer over equal-size images, every patch's state projected to the
    decoder's width: [num_images * num_patches, patch_width] -> [..., text hidden]."""

    def __init__(self, config: Any, state: dict[str, torch.Tensor], projector: Affine) -> None:
        super().__init__()
        self.geometry = tower_geometry(config)
        weight = state["embeddings.patch_embedding.weight"]  # [hidden, channels, patch, patch]
        # the convolution as a Linear over each patch's values (channel, row, column)
        self.patch_embed: Affine = (
            weight.reshape(weight.shape[0], -1),
            state["embeddings.patch_embedding.bias"],
        )
        self.positions = state["embeddings.position_embedding.weight"]  # [num_patches, hidden]
        self.num_patches = int(self.positions.shape[0])
        self.layers = torch.nn.ModuleList(
            TowerLayer(state, f"encoder.layers.{i}.", self.geometry)
            for i in range(config.num_hidden_layers)
        )
        self.post_norm = affine(state, "post_layernorm.")
        self.projector = projector
        self.register_buffer("projector_matrix", projector[0], persistent=False)

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        g = self.geometry
        weight, bias = self.patch_embed
        x = patches.to(weight.dtype).reshape(-1, self.num_patches, weight.shape[1])
        x = F.linear(x, weight, bias) + self.positions  # [num_images, num_patches, hidden]
        for layer in self.layers:
            x = layer(x, dense_attention)
        x = F.layer_norm(x, (g.hidden,), *self.post_norm, g.eps)
        return F.linear(x, *self.projector).reshape(-1, self.projector[0].shape[0])


class PaliGemmaModel(DecoderModel):
    """The Gemma decoder over packed tokens, with the SigLIP tower its image tokens come from."""

    # the engine gives a prompt with images three position rows (sequential here: the family's
    # `mrope` is off), as every vision-language model; Gemma reads the first
    position_rows = 3

    def __init__(
        self,
        config: PretrainedConfig,
        state: dict[str, torch.Tensor],
        family: VisionLanguageFamily,
        backend: AttentionBackend,
        placement: tuple[torch.device, torch.dtype],
    ) -> None:
        tower = _tower(family)
        text = config.text_config
        if DECODER_FAMILIES.get(str(text.model_type)) is not family.decoder:
            raise UnsupportedArchitectureError(
                f"a {config.model_type} model of a {text.model_type} decoder",
                (f"a {config.model_type} model of its first decoder family",),
            )
        if getattr(config.vision_config, "vision_use_head", False):
            raise ModelLoadError("a vision tower with a pooling head is not a patch tower")
        text_state = strip_prefix(state, part(state, tower.text_prefixes, "embed_tokens.weight"))
        super().__init__(text, text_state, family.decoder, backend, placement)
        self.first_position = family.first_position
        device, dtype = placement
        vision = strip_prefix(
            state, part(state, tower.tower_prefixes, "embeddings.patch_embedding.weight")
        )
        projector = strip_prefix(state, part(state, tower.projector_prefixes, "weight"))
        placed = {name: t.to(device=device, dtype=dtype) for name, t in vision.items()}
        linear = (projector["weight"], projector["bias"])
        self.visual = PatchEncoder(
            config.vision_config,
            placed,
            (linear[0].to(device=device, dtype=dtype), linear[1].to(device=device, dtype=dtype)),
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [3, num_tokens] int64, the index on every row
        attn: AttentionMetadata,
        kv_cache: PagedKVCache | None,
        out: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        adapters: AdapterSegments | None = None,
        vision: VisionRows | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The decoder at PaliGemma's positions (counted from `first_position`)."""
        return super().forward(
            input_ids,
            positions[0] + self.first_position,
            attn,
            kv_cache,
            out,
            token_type_ids,
            adapters,
            vision,
        )

    def embed_images(
        self, patches: torch.Tensor, grids: tuple[tuple[int, int, int], ...]
    ) -> VisionOutput:
        """Every image's projected patches, images in order (no deepstack rows)."""
        count = sum(t * h * w for t, h, w in grids)
        if count != len(grids) * self.visual.num_patches:
            raise ValueError(
                f"images of {count} patches; the tower takes {self.visual.num_patches}"
            )
        return VisionOutput(self.visual(patches), ())


def paligemma_inline(
    path: Path,
    architecture: str,
    family: VisionLanguageFamily,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
) -> InlineImages:
    """What the front ends need to place an image in a prompt: SigLIP's processor (its class
    defaults where the checkpoint is silent) as one size of unmerged patches, the `<image>`
    placeholder (which opens an image document), the retriever's prompt forms."""
    defaults = dict(_tower(family).processor_defaults)
    raw = {**defaults, **image_processor(path)}
    vision = config.vision_config
    try:
        steps = read_processing(raw, square=True)
    except ValueError as exc:
        raise ModelLoadError(f"the image processor: {exc}") from exc
    size = int(vision.image_size)
    if steps.resize_to != (size, size) or steps.crop_to is not None:
        raise ModelLoadError(
            f"the image processor gives {steps.resize_to} pixels; the tower takes {size}x{size}"
        )
    processing = fixed_processing(steps, int(vision.patch_size))
    patches = (size // int(vision.patch_size)) ** 2
    length = raw.get("image_seq_length")
    if length is not None and int(length) != patches:
        raise ModelLoadError(
            f"the processor's image_seq_length {length} differs from the tower's {patches} patches"
        )
    image_id = int(config.image_token_id)
    token = tokenizer.convert_ids_to_tokens(image_id)
    if not isinstance(token, str):
        raise ModelLoadError(f"the tokenizer has no token {image_id} (image_token_id)")
    return InlineImages(
        processing,
        token,
        image_id,
        None,  # the image's placeholders open its prompt
        placeholder=token,
        mrope=family.mrope,
        retrieval=retrieval_forms(path, architecture, tokenizer, token, token),
    )

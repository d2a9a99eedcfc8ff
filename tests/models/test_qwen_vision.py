"""The Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers against transformers' on tiny random
models: images of different grids (and a two-frame grid) in one call equal the reference's
merged tokens (Qwen3-VL: and its deepstack features), Qwen2.5-VL with windows that cut the images
and one full-attention block; each image alone equals the batch; bfloat16 stays close; the
projections are counted by the engine's thread sizing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers

from poolserve.engine.cpu_threads import matmul_flops_per_token
from poolserve.models.families.qwen_vl import VISION_LANGUAGE
from poolserve.models.qwen_vision import QwenVision

CPU = torch.device("cpu")
FLOAT32 = (CPU, torch.float32)
# (t, h, w) in patches: wide, tall, one merged token, two frames
GRIDS = [(1, 4, 6), (1, 8, 4), (1, 2, 2), (2, 4, 4)]
TEXT = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
}


@dataclass(frozen=True)
class Case:
    """One family's tiny model: its class, config and vision config."""

    model: type[transformers.PreTrainedModel]
    config: Callable[..., Any]
    vision: dict[str, Any]


CASES = {
    "qwen2_vl": Case(
        transformers.Qwen2VLForConditionalGeneration,
        transformers.Qwen2VLConfig,
        {"depth": 2, "embed_dim": 32, "hidden_size": 48, "num_heads": 2, "patch_size": 14},
    ),
    # windows of 2x2 merged tokens (56 // 2 // 14) cut the 4x6 and 8x4 grids; block 1 attends
    # over whole frames
    "qwen2_5_vl": Case(
        transformers.Qwen2_5_VLForConditionalGeneration,
        transformers.Qwen2_5_VLConfig,
        {
            "depth": 3,
            "hidden_size": 32,
            "intermediate_size": 48,
            "out_hidden_size": 48,
            "num_heads": 2,
            "patch_size": 14,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
    ),
    # a 4x4 position table, resized up and down to the grids
    "qwen3_vl": Case(
        transformers.Qwen3VLForConditionalGeneration,
        transformers.Qwen3VLConfig,
        {
            "depth": 3,
            "hidden_size": 32,
            "intermediate_size": 48,
            "out_hidden_size": 48,
            "num_heads": 4,
            "patch_size": 16,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0, 1],
        },
    ),
}


@dataclass(frozen=True)
class Reference:
    """A family's transformers model (its vision tower: model.model.visual) and its config."""

    model: Any  # the whole *ForConditionalGeneration
    config: Any

    @property
    def visual(self) -> Any:
        """Its vision tower."""
        return self.model.model.visual


@pytest.fixture(scope="module", params=sorted(CASES))
def reference(request: pytest.FixtureRequest) -> Reference:
    case = CASES[request.param]
    torch.manual_seed(0)
    config = case.config(text_config=TEXT, vision_config=case.vision)
    model = case.model._from_config(config, attn_implementation="sdpa").eval()
    # every weight, bias and norm off its initial value, so that each is exercised
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    assert config.model_type == request.param
    return Reference(model, config)


def _patches(grids: list[tuple[int, int, int]], vision: Any) -> torch.Tensor:
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return torch.randn(sum(t * h * w for t, h, w in grids), width)  # [N, patch_width]


def _tower(reference: Reference, placement: tuple[torch.device, torch.dtype]) -> QwenVision:
    state = reference.visual.state_dict()
    family = VISION_LANGUAGE[type(reference.model).__name__]
    return QwenVision(family.tower, reference.config.vision_config, state, placement)


def test_equals_transformers(reference: Reference) -> None:
    torch.manual_seed(1)
    patches = _patches(GRIDS, reference.config.vision_config)
    with torch.no_grad():
        want = reference.visual(patches, grid_thw=torch.tensor(GRIDS), return_dict=True)
    got = _tower(reference, FLOAT32)(patches, GRIDS)
    torch.testing.assert_close(got.embeds, want.pooler_output, rtol=1e-4, atol=1e-5)
    wanted_deepstack = getattr(want, "deepstack_features", None) or []
    assert len(got.deepstack) == len(wanted_deepstack)
    for mine, theirs in zip(got.deepstack, wanted_deepstack, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    merge = reference.config.vision_config.spatial_merge_size
    assert got.embeds.shape[0] == sum(t * h * w for t, h, w in GRIDS) // merge**2


def test_each_image_alone_equals_the_batch(reference: Reference) -> None:
    torch.manual_seed(2)
    tower = _tower(reference, FLOAT32)
    patches = _patches(GRIDS, reference.config.vision_config)
    together = tower(patches, GRIDS)
    merge_units = reference.config.vision_config.spatial_merge_size**2
    start, token = 0, 0
    for grid in GRIDS:
        size = grid[0] * grid[1] * grid[2]
        alone = tower(patches[start : start + size], [grid])
        tokens = slice(token, token + size // merge_units)
        torch.testing.assert_close(alone.embeds, together.embeds[tokens], rtol=1e-6, atol=1e-6)
        for one, batched in zip(alone.deepstack, together.deepstack, strict=True):
            torch.testing.assert_close(one, batched[tokens], rtol=1e-6, atol=1e-6)
        start, token = start + size, token + size // merge_units


def test_bfloat16_stays_close(reference: Reference) -> None:
    torch.manual_seed(3)
    patches = _patches(GRIDS, reference.config.vision_config)
    want = _tower(reference, FLOAT32)(patches, GRIDS)
    got = _tower(reference, (CPU, torch.bfloat16))(patches, GRIDS)
    assert got.embeds.dtype == torch.bfloat16
    pairs = zip((got.embeds, *got.deepstack), (want.embeds, *want.deepstack), strict=True)
    for mine, exact in pairs:
        cosine = torch.nn.functional.cosine_similarity(mine.float(), exact, dim=-1)
        assert float(cosine.min()) > 0.99


def test_projections_are_counted(reference: Reference) -> None:
    # every Linear and the patch Conv3d; the position table is a lookup
    parameters = reference.visual.named_parameters()
    matrices = [p for name, p in parameters if p.dim() >= 2 and not name.startswith("pos_embed")]
    tower = _tower(reference, FLOAT32)
    assert matmul_flops_per_token(tower) == 2 * sum(p.numel() for p in matrices)


def test_refusals(reference: Reference) -> None:
    vision = reference.config.vision_config
    with pytest.raises(ValueError):
        _tower(reference, FLOAT32)(_patches([(1, 2, 2)], vision), [(1, 2, 4)])
    with pytest.raises(ValueError):  # not in merge x merge blocks
        _tower(reference, FLOAT32)(_patches([(1, 3, 2)], vision), [(1, 3, 2)])

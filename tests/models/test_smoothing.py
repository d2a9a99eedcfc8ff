"""int8 smoothing (poolserve/models/smoothing.py): the ranges measured at load against
transformers' own activations, what smoothing does to a projection with wide channels, and which
projections a loaded model smooths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from poolserve.models import load_model
from poolserve.models.quantization import Int8Linear
from poolserve.models.smoothing import calibration_ids, measure_input_ranges, smoothing
from tests.tiny_models import build_hf_model, save_tiny_model

CPU = torch.device("cpu")
FIDELITY_ONLY = {"allow_slower_precision": True}  # tiny layers: int8 slower than float32

# name -> causal, and each of our slots' transformers module, whose input it must record
HF_INPUTS = {
    "bert": (
        False,
        {
            "layers.0.qkv_weight": "encoder.layer.0.attention.self.query",
            "layers.0.up_weight": "encoder.layer.0.intermediate.dense",
            "layers.1.qkv_weight": "encoder.layer.1.attention.self.query",
            "layers.1.up_weight": "encoder.layer.1.intermediate.dense",
        },
    ),
    "llama": (
        True,
        {
            "layers.0.qkv_weight": "layers.0.self_attn.q_proj",
            "layers.0.gate_up_weight": "layers.0.mlp.gate_proj",
            "layers.1.qkv_weight": "layers.1.self_attn.q_proj",
            "layers.1.gate_up_weight": "layers.1.mlp.gate_proj",
        },
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: save_tiny_model(name, tmp_path_factory.mktemp(name)) for name in HF_INPUTS}


def _hf_input_ranges(name: str, modules: dict[str, str]) -> dict[str, torch.Tensor]:
    """max |input| per channel of each named transformers module over the calibration ids."""
    base = build_hf_model(name).base_model
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        base.get_submodule(path).register_forward_pre_hook(
            lambda _m, args, slot=slot: seen.__setitem__(slot, args[0].abs().amax((0, 1)))
        )
        for slot, path in modules.items()
    ]
    ids = calibration_ids(base.config.vocab_size)  # [sequences, tokens]
    with torch.no_grad():
        base(input_ids=ids, attention_mask=torch.ones_like(ids))
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("name", sorted(HF_INPUTS))
def test_ranges_are_transformers_own_activations(name: str, checkpoints: dict[str, Path]) -> None:
    causal, modules = HF_INPUTS[name]
    loaded = load_model(str(checkpoints[name]), device=CPU)
    before = {k: v for k, v in loaded.model.named_buffers()}
    measured = measure_input_ranges(loaded.model, causal)
    want = _hf_input_ranges(name, modules)
    assert set(want) <= set(measured)
    for slot, expected in want.items():
        got, weight = measured[slot]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        assert weight is before[slot]
    # the recorders are gone: the same buffers, in the same slots
    after = dict(loaded.model.named_buffers())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)


def test_smoothing_keeps_the_product_and_narrows_wide_channels() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(64, 96, generator=generator)
    x[:, [5, 40, 77]] *= 60.0  # a norm's few wide channels
    weight = torch.randn(128, 96, generator=generator) * 0.05
    bias = torch.randn(128, generator=generator)
    s = smoothing(x.abs().amax(0), weight)
    exact = F.linear(x, weight, bias)
    # in float the smoothing is an identity: x / s times W * s
    torch.testing.assert_close(F.linear(x / s, weight * s, bias), exact, rtol=1e-5, atol=1e-4)

    def error(linear: Int8Linear) -> float:
        return float((linear(x, bias) - exact).norm() / exact.norm())

    plain, smoothed = error(Int8Linear(weight)), error(Int8Linear(weight, smooth=s))
    assert smoothed < plain / 3, (smoothed, plain)


def test_int8_smooths_what_a_norm_feeds(checkpoints: dict[str, Path]) -> None:
    # float32: every projection in int8, the norm-fed ones (qkv, gate/up) smoothed
    loaded = load_model(str(checkpoints["llama"]), device=CPU, quantization="int8", **FIDELITY_ONLY)
    layer = loaded.model.layers[0]
    for slot, smoothed in (("qkv", True), ("o", False), ("gate_up", True), ("down", False)):
        linear = getattr(layer, f"{slot}_weight")
        assert isinstance(linear, Int8Linear), slot
        assert (linear.inverse_smoothing is not None) is smoothed, slot
    # bfloat16 compute: no smoothing, and qkv keeps the compute dtype
    loaded = load_model(
        str(checkpoints["llama"]),
        device=CPU,
        dtype=torch.bfloat16,
        quantization="int8",
        **FIDELITY_ONLY,
    )
    layer = loaded.model.layers[0]
    assert not isinstance(layer.qkv_weight, Int8Linear)
    for slot in ("o", "gate_up", "down"):
        linear = getattr(layer, f"{slot}_weight")
        assert isinstance(linear, Int8Linear) and linear.inverse_smoothing is None, slot

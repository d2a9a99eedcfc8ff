"""The CPU precision measured at load: exact int8 GEMMs, the choice, the refusal, the CLI's line.

Speed itself is benchmarked (docs/benchmarks.md), never asserted: the choice is tested with
injected timings, and the kernels for what they compute.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from poolserve.models import cpu_kernels, load_model
from poolserve.models.cpu_class import CpuClass, cpu_class
from poolserve.models.cpu_kernels import check_speed, choose, choose_kernels
from poolserve.models.float_kernels import (
    CLOSE,
    ONEDNN,
    TORCH,
    FloatKernel,
    PackedLinear,
    is_close,
)
from poolserve.models.int8_kernels import INT8_LEVELS, REDUCED_LEVELS, Int8Kernel, is_exact, kernels
from poolserve.models.layers import ACTIVATIONS, linear, linear_act
from poolserve.models.quantization import INT_MM, Int8Linear
from poolserve.types.errors import SlowerPrecisionError
from tests.models.driver import make_prompts, run_whole

CPU = torch.device("cpu")
CLASS = CpuClass("Test CPU", "AVX2", (), ())
# An AVX-512 CPU computing as one with AVX2 only: torch's, oneDNN's, fbgemm's and MKL's kernels
# capped (docs/models.md, Precision).
AVX2_ONLY = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
# The scheme's fidelity to float32 on one random projection, per activation grid.
COSINE = {INT8_LEVELS: 0.9995, REDUCED_LEVELS: 0.998}


@pytest.fixture(autouse=True)
def fresh_measurements(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test measures anew, and leaves no measurement of its injected timings behind;
    the tiny models' layers are timed like a real model's."""
    monkeypatch.setattr(cpu_kernels, "MIN_KERNEL_FLOPS", 0)
    cpu_kernels._measure.cache_clear()
    yield
    cpu_kernels._measure.cache_clear()


def _scheme(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, kernel: Int8Kernel
) -> torch.Tensor:
    """Int8Linear's arithmetic in float64: per-token activations, per-channel weights; the
    7-bit kernels' activations span each token's [min, max] (asymmetric), the others' are
    symmetric."""
    w_scale = weight.abs().amax(1) / INT8_LEVELS  # [out] (float32, as Int8Linear rounds it)
    qw = torch.round(weight / w_scale[:, None]).double()  # [out, in]
    levels = kernel.levels
    if not kernel.asymmetric:
        x_scale = x.abs().amax(-1, keepdim=True) / levels  # [tokens, 1]
        qx = torch.round(x / x_scale).double()  # [tokens, in]
        return (qx @ qw.t()) * x_scale.double() * w_scale.double() + bias.double()
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)  # [tokens, 1] each
    x_scale = (high - low) / (2 * levels + 1)
    offset = low / x_scale + (levels + 1)
    # the kernel's float32 rounding of x / x_scale - offset, mirrored
    qx = torch.addcmul(-offset, x, x_scale.reciprocal()).round()  # [tokens, in]
    assert int(qx.min()) >= -levels - 1 and int(qx.max()) <= levels
    shifted = qx.double() + offset.double()
    return (shifted @ qw.t()) * x_scale.double() * w_scale.double() + bias.double()


def _exact_kernels() -> list[Int8Kernel]:
    return [kernel for kernel in kernels() if is_exact(kernel)]


@pytest.mark.parametrize("kernel", _exact_kernels(), ids=lambda k: k.name)
def test_each_exact_kernel_computes_the_scheme_and_stays_close(kernel: Int8Kernel) -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 200, generator=generator) * 0.05
    bias = torch.randn(96, generator=generator)
    x = torch.randn(37, 200, generator=generator)
    got = Int8Linear(weight, kernel)(x, bias)
    want = _scheme(x, weight, bias, kernel)
    # the same integer sums; only float32's rounding of the scaling differs
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    exact = F.linear(x, weight, bias)
    assert F.cosine_similarity(got, exact).min() >= COSINE[kernel.levels]
    assert Int8Linear(weight, kernel)(torch.zeros(0, 200), bias).shape == (0, 96)


@pytest.mark.parametrize("kernel", _exact_kernels(), ids=lambda k: k.name)
def test_each_exact_kernel_is_batch_invariant(kernel: Int8Kernel) -> None:
    # per-token scales: a row's output is the same alone, in a chunk of 7, or in the whole batch
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(64, 128, generator=generator)
    x = torch.randn(173, 128, generator=generator) * torch.rand(173, 1, generator=generator) * 9
    linear = Int8Linear(weight, kernel)
    whole = linear(x, None)
    for size in (1, 7):
        pieces = torch.cat([linear(x[i : i + size], None) for i in range(0, len(x), size)])
        torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-5 * float(whole.abs().max()))


def test_full_range_kernels_agree_with_each_other() -> None:
    # one scheme whichever GEMM runs: the choice changes speed, never outputs
    generator = torch.Generator().manual_seed(4)
    weight, x = torch.randn(64, 128, generator=generator), torch.randn(20, 128, generator=generator)
    full = [k for k in _exact_kernels() if k.levels == INT8_LEVELS]
    outputs = [Int8Linear(weight, k)(x, None) for k in full]
    for kernel, out in zip(full[1:], outputs[1:], strict=True):
        torch.testing.assert_close(out, outputs[0], rtol=1e-6, atol=1e-6, msg=kernel.name)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_a_projections_activation_is_the_same_function_in_place(name: str) -> None:
    # linear_act overwrites an Int8Linear's or torch's GEMM output (IN_PLACE); the caller's
    # input and weight are untouched
    generator = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    x = torch.randn(21, 64, generator=generator)
    act = ACTIVATIONS[name]
    for projection in (Int8Linear(weight), weight):
        before, weight_before = x.clone(), weight.clone()
        got = linear_act(x, projection, bias, act)
        assert torch.equal(got, act(linear(x, projection, bias)))
        assert torch.equal(x, before) and torch.equal(weight, weight_before)


def test_a_saturating_gemm_fails_the_check_and_is_never_chosen(
    monkeypatch: pytest.MonkeyPatch, loaded_layers: torch.nn.Module
) -> None:
    def saturating(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """What a GEMM adding int8 products in int16 pairs returns at the extremes."""
        return (a.int() @ b.int()).clamp(-(2**15), 2**15 - 1)

    monkeypatch.setattr(torch, "_int_mm", saturating)
    assert not is_exact(INT_MM)
    chosen = choose_kernels(loaded_layers, torch.float32, "int8", allow_slower=True).int8_kernel
    assert chosen is not None and chosen != INT_MM


@pytest.fixture
def loaded_layers(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Callable[[str], Path]
) -> torch.nn.Module:
    """A tiny model's packed layers with plain float weights (choose_kernels reads those)."""
    # every float kernel as fast as torch's: torch's is kept, its weights stay plain tensors
    monkeypatch.setattr(cpu_kernels, "_time_linears", lambda w, i, d, k: 1.0)
    return load_model(str(tiny_model_dir("qwen3")), device=CPU).model


def test_the_fastest_of_the_most_faithful_tier_faster_than_float32_runs() -> None:
    full = {"int_mm": 9.0, "fbgemm": 4.0, "onednn": 6.0}
    reduced = {"fbgemm 7-bit": 1.0}
    choice = choose("--quantization int8", [full, reduced], 8.0, 64, CLASS)
    assert choice.kernel == "fbgemm" and choice.speedup == 2.0
    assert [name for name, _ in choice.timings] == ["fbgemm", "fbgemm 7-bit", "onednn", "int_mm"]
    # no full-range kernel beats float32 here: the 7-bit one does
    choice = choose("--quantization int8", [{"int_mm": 90.0}, reduced], 8.0, 64, CLASS)
    assert choice.kernel == "fbgemm 7-bit"
    # none beats float32: the most faithful tier's fastest, which the speed check then refuses
    # (or runs under --allow-slower-precision without losing the full range)
    tiers = [{"int_mm": 90.0, "x86": 20.0}, {"x86 7-bit": 12.0}]
    choice = choose("--quantization int8", tiers, 8.0, 64, CLASS)
    assert choice.kernel == "x86" and choice.speedup == pytest.approx(8 / 20)
    choice = choose("--quantization int8", [{}, {"x86 7-bit": 12.0}], 8.0, 64, CLASS)
    assert choice.kernel == "x86 7-bit"  # the only exact kernel
    with pytest.raises(SlowerPrecisionError, match="none of its kernels is exact"):
        choose("--quantization int8", [{}, {}], 8.0, 64, CLASS)


def test_int8_must_reach_its_floor_and_the_tier_that_does_runs() -> None:
    assert cpu_kernels.MIN_SPEEDUP["--quantization int8"] == 1.5
    # the full range at 1.33x does not pay for int8; the 7-bit tier at 2x does
    tiers = [{"x86": 6.0}, {"x86 7-bit": 4.0}]
    choice = choose("--quantization int8", tiers, 8.0, 64, CLASS)
    assert choice.kernel == "x86 7-bit" and choice.speedup == 2.0
    check_speed(choice, allow_slower=False, advice="")  # runs
    # none reaches 1.5x: the first tier faster than float32 is the one refused (or allowed)
    tiers = [{"qnnpack": 30.0}, {"fbgemm 7-bit": 7.0, "x86 7-bit": 6.9}]
    choice = choose("--quantization int8", tiers, 8.0, 64, CLASS)
    assert choice.kernel == "x86 7-bit" and 1.0 < choice.speedup < 1.5
    with pytest.raises(SlowerPrecisionError) as caught:
        check_speed(choice, allow_slower=False, advice="run without --quantization")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("--quantization int8 would run at 1.16x float32's speed")
    assert "below the 1.50x it must reach" in message and "--allow-slower-precision" in message
    # a half dtype's floor is float32's own speed: 1.16x runs
    half = choose("--dtype bfloat16", [{"bfloat16": 6.9}], 8.0, 64, CLASS)
    check_speed(half, allow_slower=False, advice="")


def test_a_slower_precision_is_refused_in_one_line_or_run_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    choice = choose("--dtype bfloat16", [{"bfloat16": 0.0325}], 0.0065, 256, CLASS)
    with pytest.raises(SlowerPrecisionError) as caught:
        check_speed(choice, allow_slower=False, advice="use --dtype float32 (or auto)")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("--dtype bfloat16 would run at 0.20x float32's speed")
    for part in (str(CLASS), "32.50 ms", "6.50 ms", "256 tokens", "--allow-slower-precision"):
        assert part in message
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        check_speed(choice, allow_slower=True, advice="")
    assert "0.20x" in caplog.text and "running it anyway" in caplog.text
    faster = choose("--dtype bfloat16", [{"bfloat16": 0.002}], 0.0065, 256, CLASS)
    check_speed(faster, allow_slower=False, advice="")  # 3.25x: runs


def test_load_model_measures_and_refuses_with_injected_timings(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Callable[[str], Path]
) -> None:
    # bfloat16 five times slower than float32, as on CPUs without native units
    seconds = {torch.bfloat16: 5.0, torch.float32: 1.0}
    monkeypatch.setattr(cpu_kernels, "_time_linears", lambda w, i, dtype, k: seconds[dtype])
    directory = str(tiny_model_dir("bert"))
    with pytest.raises(SlowerPrecisionError, match=r"--dtype bfloat16 would run at 0\.20x"):
        load_model(directory, device=CPU, dtype=torch.bfloat16)
    loaded = load_model(directory, device=CPU, dtype=torch.bfloat16, allow_slower_precision=True)
    assert loaded.spec.dtype == torch.bfloat16
    # int8: every kernel slower than float32 is refused; one faster runs, as Int8Linear
    monkeypatch.setattr(cpu_kernels, "_time_int8", lambda w, i, d, kernel: 2.0)
    with pytest.raises(SlowerPrecisionError, match=r"--quantization int8 would run at 0\.50x"):
        load_model(directory, device=CPU, quantization="int8")
    fastest = _exact_kernels()[-1]
    for gain, runs in ((1.25, False), (2.0, True)):  # int8 must reach 1.5x float32
        monkeypatch.setattr(
            cpu_kernels,
            "_time_int8",
            lambda w, i, d, kernel, s=1 / gain: s if kernel == fastest else 2.0,
        )
        cpu_kernels._measure.cache_clear()  # new timings: a new measurement
        if not runs:
            with pytest.raises(SlowerPrecisionError, match=r"at 1\.25x .* below the 1\.50x"):
                load_model(directory, device=CPU, quantization="int8")
            continue
        loaded = load_model(directory, device=CPU, quantization="int8")
        assert loaded.model.layers[0].o_weight.kernel == fastest


def test_a_float_kernel_replaces_torchs_only_when_clearly_faster(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Callable[[str], Path]
) -> None:
    directory = str(tiny_model_dir("bert"))
    for onednn_s, packed in ((0.97, False), (0.90, True)):
        seconds = {TORCH: 1.0, ONEDNN: onednn_s}
        monkeypatch.setattr(cpu_kernels, "_time_linears", lambda w, i, d, k, s=seconds: s[k])
        cpu_kernels._measure.cache_clear()
        layer = load_model(directory, device=CPU).model.layers[0]
        assert isinstance(layer.up_weight, PackedLinear) is packed, onednn_s
        assert isinstance(layer.qkv_weight, PackedLinear) is packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_linear_matches_f_linear(dtype: torch.dtype) -> None:
    if not is_close(ONEDNN, dtype):
        pytest.skip(f"oneDNN's packed {dtype} linear does not run on this CPU")
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(200, 96, generator=generator).to(dtype)
    bias = torch.randn(200, generator=generator).to(dtype)
    for rows in (0, 1, 33, 300):  # a step's token count varies; the packing is for any
        x = torch.randn(rows, 96, generator=generator).to(dtype)
        want = F.linear(x, weight, bias).float()
        got = PackedLinear(weight)(x, bias).float()
        assert got.shape == want.shape
        if rows:
            assert (got - want).abs().max() <= CLOSE[dtype] * want.abs().max()


@pytest.mark.parametrize("name", ["qwen3", "bert"])  # bert: GELU fused into the up projection
def test_a_model_on_packed_weights_equals_the_plain_one(
    name: str, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Callable[[str], Path]
) -> None:
    if not is_close(ONEDNN, torch.float32):
        pytest.skip("oneDNN's packed linear does not run on this CPU")
    directory = str(tiny_model_dir(name))
    prompts = make_prompts((1, 9, 40), seed=3)
    for kernel in (TORCH, ONEDNN):  # each chosen by injected timings
        seconds = {TORCH: 1.0, ONEDNN: 1.0 if kernel == TORCH else 0.5}
        monkeypatch.setattr(cpu_kernels, "_time_linears", lambda w, i, d, k, s=seconds: s[k])
        cpu_kernels._measure.cache_clear()
        loaded = load_model(directory, device=CPU)
        assert isinstance(loaded.model.layers[0].o_weight, PackedLinear) is (kernel == ONEDNN)
        got = run_whole(loaded, prompts, CPU)
        if kernel == TORCH:
            want = got
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * float(theirs.abs().max()))


def test_one_process_measures_a_shape_once(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Callable[[str], Path]
) -> None:
    # two loads of one checkpoint run the same kernels (the same outputs to the bit)
    timed: list[str] = []

    def record(w: object, i: object, d: object, kernel: FloatKernel) -> float:
        timed.append(kernel.name)
        return 1.0

    monkeypatch.setattr(cpu_kernels, "_time_linears", record)
    directory = str(tiny_model_dir("bert"))
    first = run_whole(load_model(directory, device=CPU), [[5, 6, 7]], CPU)
    count = len(timed)
    second = run_whole(load_model(directory, device=CPU), [[5, 6, 7]], CPU)
    assert count > 0 and len(timed) == count
    assert torch.equal(first[0], second[0])


def test_a_small_layer_keeps_torchs_float_gemm_untimed(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Callable[[str], Path]
) -> None:
    monkeypatch.setattr(cpu_kernels, "MIN_KERNEL_FLOPS", 1e9)
    timed: list[str] = []

    def record(w: object, i: object, d: object, kernel: FloatKernel) -> float:
        timed.append(kernel.name)
        return 1.0

    monkeypatch.setattr(cpu_kernels, "_time_linears", record)
    layer = load_model(str(tiny_model_dir("bert")), device=CPU).model.layers[0]
    assert timed == ["torch"] and isinstance(layer.up_weight, torch.Tensor)


def test_the_cpu_class_names_torchs_isa_and_the_units() -> None:
    here = cpu_class()
    assert here.isa == torch.backends.cpu.get_cpu_capability()
    assert str(here).startswith(here.isa)
    capped = CpuClass("X", "AVX2", (("oneDNN", "AVX2"), ("fbgemm", "AVX2")), ())
    assert str(capped) == "AVX2 (X, oneDNN capped at AVX2, fbgemm capped at AVX2)"
    assert str(CpuClass("Y", "AVX512", (), ("VNNI", "BF16"))) == "AVX512 + VNNI + BF16 (Y)"


_EXACT_UNDER_CAPS = """
from poolserve.models.cpu_class import cpu_class
from poolserve.models.int8_kernels import is_exact, kernels
print(cpu_class())
print(" ".join(k.name.replace(" ", "_") for k in kernels() if is_exact(k)))
"""


@pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines, reason="no fbgemm (not x86)"
)
def test_capped_at_avx2_the_full_range_gemms_saturate_as_on_an_avx2_cpu() -> None:
    # on a CPU with VNNI the caps bring back the int16 pairs of an AVX2-only one: fbgemm's,
    # x86's and oneDNN's full-range GEMMs fail the check (on such a CPU itself, too)
    env = {**os.environ, **AVX2_ONLY}
    done = subprocess.run(
        [sys.executable, "-c", _EXACT_UNDER_CAPS], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    named, exact = done.stdout.strip().splitlines()
    assert named.startswith("AVX2 (") and "VNNI" not in named and "AMX" not in named
    assert named.endswith("oneDNN capped at AVX2, fbgemm capped at AVX2, MKL capped at AVX2)")
    exact_names = exact.split()
    assert not {"fbgemm", "x86", "onednn", "onednn-qlinear"} & set(exact_names), exact_names
    assert {"fbgemm_7-bit", "x86_7-bit"} <= set(exact_names), exact_names


def _embed(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`poolserve embed` of one text with MiniLM, torch's kernels capped at AVX2 (default
    flags: --dtype bfloat16)."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "text": "a query"}\n')
    out = tmp_path / f"out{len(flags)}.parquet"
    env = {**os.environ, **AVX2_ONLY}
    command = [sys.executable, "-m", "poolserve", "embed", str(source), "-o", str(out)]
    precision = [] if "--quantization" in flags else ["--dtype", "bfloat16"]
    command += ["--device", "cpu", *precision, *flags]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)


def test_the_cli_refuses_emulated_bfloat16_in_one_line(tmp_path: Path) -> None:
    # capped at AVX2, torch and oneDNN emulate bfloat16: MiniLM's projections run ~0.2x float32
    refused = _embed(tmp_path)
    assert refused.returncode != 0
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert "--dtype bfloat16 would run at" in lines[0] and "AVX2" in lines[0]
    assert "--allow-slower-precision" in lines[0]
    allowed = _embed(tmp_path, "--allow-slower-precision")
    assert allowed.returncode == 0, allowed.stderr


@pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines, reason="no fbgemm (not x86)"
)
def test_the_cli_never_runs_int8_below_its_floor(tmp_path: Path) -> None:
    # capped at AVX2 only the 7-bit GEMMs are exact, at 1.1-1.2x float32 on the CPUs measured:
    # refused in one line; should this CPU's capped kernels reach 1.5x, its log says so
    done = _embed(tmp_path, "--quantization", "int8")
    said = [line for line in done.stderr.splitlines() if " INFO " not in line]
    if done.returncode != 0:
        assert len(said) == 1 and "Traceback" not in done.stderr, done.stderr
        assert "--quantization int8 would run at" in said[0] and "AVX2" in said[0]
        assert "below the 1.50x it must reach" in said[0]
        return
    ran = next(line for line in done.stderr.splitlines() if "--quantization int8 runs" in line)
    assert float(ran.split("x float32", 1)[0].rsplit(" ", 1)[-1]) >= 1.5, ran


def test_serve_refuses_in_one_line_and_stops_its_front_end_at_once() -> None:
    # the engine core says why in one line; the supervisor stops the front end at once (it
    # served nothing) instead of draining it for --shutdown-timeout, and exits 1
    env = {**os.environ, **AVX2_ONLY}
    command = [sys.executable, "-m", "poolserve", "serve", "--device", "cpu", "--port", "0"]
    command += ["--dtype", "bfloat16", "--shutdown-timeout", "120"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if " INFO " not in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    said = "poolserve serve: error: model 'sentence-transformers/all-MiniLM-L6-v2': --dtype "
    assert errors[0].startswith(said + "bfloat16 would run at"), errors[0]

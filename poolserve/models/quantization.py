"""Precision support: native half types on the CPU, and int8 or fp8 weights for the projections.

`--quantization int8` stores the layers' output, MLP up (or gate/up) and down projection weights
as int8 with one float32 scale per output channel, and quantizes their inputs per token at run
time (symmetric, the scheme of torchao's Int8DynamicActivationInt8WeightConfig); qkv stays in the
compute dtype (QUANTIZED_WEIGHTS says why). On the CPU the matmul is torch's int8 GEMM
(`torch._int_mm`, the kernel torchao calls too) with the scaling around it written here; on CUDA,
int8 and fp8 (per-row scales, Ada and Hopper) are torchao's tensor subclasses, which `F.linear`
dispatches. Embeddings, norms, attention and heads keep the compute dtype. Fidelity and speed:
docs/models.md, Precision.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from poolserve.models.errors import UnsupportedQuantizationError

logger = logging.getLogger(__name__)

# The projections each scheme quantizes, by the buffer names the decoder and encoder layers give
# them. int8 keeps qkv in the compute dtype: its input is a norm's output, whose few outlier
# channels leave the other channels of a per-token int8 scale a handful of levels (measured on
# MiniLM: qkv alone in int8 brings the worst text's cosine to float32 down to 0.990, the other
# three together to 0.994). fp8 keeps a per-element exponent and takes every projection, as vLLM.
PROJECTION_WEIGHTS = ("qkv_weight", "o_weight", "gate_up_weight", "up_weight", "down_weight")
QUANTIZED_WEIGHTS: dict[str, tuple[str, ...]] = {
    "int8": PROJECTION_WEIGHTS[1:],
    "fp8": PROJECTION_WEIGHTS,
}
# CPU flags (torch.cpu.get_capabilities() keys and /proc/cpuinfo names) of native units per
# dtype; without one, torch emulates the type and runs slower than float32.
NATIVE_CPU_FLAGS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16"),  # x86 AVX-512/AMX, Arm BF16
    torch.float16: ("avx512_fp16", "amx_fp16"),
}
# int8 dot-product units: VNNI (x86), AMX, Arm's dot product.
INT8_CPU_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "asimddp")
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper have fp8 tensor cores
INT8_MAX = 127
INSTALL_HINT = "install torchao (pip install 'poolserve[quantization]')"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's features: torch's own capability query, plus /proc/cpuinfo's flags."""
    query = getattr(torch.cpu, "get_capabilities", dict)  # absent from older torch releases
    flags = {name for name, value in query().items() if value is True}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: torch's query alone
        return frozenset(flags)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    return frozenset(flags)


def cpu_lacks_native(dtype: torch.dtype) -> str | None:
    """Why the CPU would emulate a half dtype (slower than float32), or None when native."""
    wanted = NATIVE_CPU_FLAGS.get(dtype)
    if wanted is None or not cpu_flags().isdisjoint(wanted):
        return None
    name = str(dtype).removeprefix("torch.")
    return f"this CPU has no native {name} units ({' or '.join(wanted)})"


def check_quantization(name: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Raises UnsupportedQuantizationError for a scheme the device or dtype cannot run."""
    if name is None:
        return
    check = _CHECKS.get(name)
    if check is None:
        known = ", ".join(sorted(_CHECKS))
        raise UnsupportedQuantizationError(name, str(device), f"the schemes are {known}")
    reason = check(device, dtype)
    if reason is not None:
        raise UnsupportedQuantizationError(name, str(device), reason)


def _check_int8(device: torch.device, dtype: torch.dtype) -> str | None:
    """int8 runs on the CPU where its GEMM is exact, and on CUDA through torchao."""
    if device.type == "cuda":
        return _torchao_missing()
    if device.type != "cpu":
        return "int8 runs on cpu and cuda"
    if not _int8_gemm_is_exact():
        # without dot-product units the GEMM adds int16 pairs, which saturate
        return f"its int8 GEMM saturates (no int8 dot-product units: {', '.join(INT8_CPU_FLAGS)})"
    if cpu_flags().isdisjoint(INT8_CPU_FLAGS):
        logger.warning("int8 on a CPU without %s: expect little or no speed-up", INT8_CPU_FLAGS)
    return None


def _check_fp8(device: torch.device, dtype: torch.dtype) -> str | None:
    """fp8 needs a GPU with fp8 units, bfloat16 compute (per-row scales) and torchao."""
    if device.type != "cuda":
        return "fp8 needs a CUDA GPU with fp8 units (compute capability 8.9+: Ada, Hopper)"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        major, minor = capability
        return f"the GPU (compute capability {major}.{minor}) has no fp8 units; 8.9+ has"
    if dtype != torch.bfloat16:
        return "fp8 with per-row scales computes in bfloat16: use --dtype bfloat16 or auto"
    return _torchao_missing()


_CHECKS: dict[str, Callable[[torch.device, torch.dtype], str | None]] = {
    "int8": _check_int8,
    "fp8": _check_fp8,
}


def _torchao_missing() -> str | None:
    """Why torchao cannot be used, or None."""
    try:
        import torchao.quantization  # noqa: F401
    except ImportError as exc:  # absent, or built for another torch
        return f"{INSTALL_HINT}: {exc}"
    return None


@functools.cache
def _int8_gemm_is_exact() -> bool:
    """The CPU int8 GEMM on its worst case: every product at the int8 extremes."""
    a = torch.full((4, 64), -INT8_MAX - 1, dtype=torch.int8)
    b = torch.full((64, 8), -INT8_MAX - 1, dtype=torch.int8)
    return bool((torch._int_mm(a, b) == 64 * 128 * 128).all())


class Int8Linear(torch.nn.Module):
    """A projection's int8 weight [out, in] with float32 per-channel scales; CPU int8 GEMM."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:  # [out, in]
        super().__init__()
        scale = weight.float().abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).eps)
        scale = scale / INT8_MAX  # [out]
        qweight = torch.round(weight.float() / scale[:, None]).to(torch.int8)  # [out, in]
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.contiguous())

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, in] in the compute dtype
        bias: torch.Tensor | None,  # [out]
    ) -> torch.Tensor:  # [num_tokens, out] in the compute dtype
        """x @ W.T + bias with x quantized per token: int8 GEMM, int32 sums, float32 scaling."""
        x_scale = x.abs().amax(dim=-1, keepdim=True).float()  # [num_tokens, 1]
        x_scale = x_scale.clamp_min_(torch.finfo(torch.float32).eps).div_(INT8_MAX)
        # |x / x_scale| <= 127 by construction: no clamp is needed before the cast
        qx = torch.round(x / x_scale).to(torch.int8)  # [num_tokens, in]
        y = torch._int_mm(qx, self.qweight.t()).float()  # [num_tokens, out] exact int32 sums
        y.mul_(x_scale).mul_(self.scale)
        if bias is not None:
            y.add_(bias)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        """Shape, as nn.Linear prints it."""
        out_features, in_features = self.qweight.shape
        return f"in_features={in_features}, out_features={out_features}, int8"


def _torchao_config(name: str) -> Any:
    """torchao's dynamic-activation config of a scheme (imported only when asked for)."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        PerRow,
    )

    # set_inductor_config off: quantizing must not change torch.compile settings process-wide
    if name == "int8":
        return Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    return Float8DynamicActivationFloat8WeightConfig(
        granularity=PerRow(), set_inductor_config=False
    )


def torchao_weight(weight: torch.Tensor, config: Any) -> torch.Tensor:
    """A weight as torchao's quantized tensor subclass (F.linear dispatches to its kernel).

    torchao keeps a weight it cannot run as it was (fp8: dims not multiples of 16).
    """
    from torchao.quantization import quantize_

    out_features, in_features = weight.shape
    holder = torch.nn.Linear(in_features, out_features, bias=False, device="meta")
    holder.weight = torch.nn.Parameter(weight, requires_grad=False)
    quantize_(holder, config)
    return holder.weight.detach()


def quantize_linears(
    model: torch.nn.Module, name: str | None, device: torch.device, use_torchao: bool | None = None
) -> int:
    """Replaces every projection weight in place; returns how many were quantized.

    `use_torchao` None: torchao on CUDA, the int8 GEMM above on the CPU (True compares them).
    """
    if name is None:
        return 0
    with_torchao = (device.type == "cuda" or name == "fp8") if use_torchao is None else use_torchao
    config = _torchao_config(name) if with_torchao else None
    count = 0
    for module in list(model.modules()):
        buffers = dict(module.named_buffers(recurse=False))
        for slot in QUANTIZED_WEIGHTS[name]:
            weight = buffers.get(slot)
            if weight is None:
                continue
            if config is not None:
                quantized = torchao_weight(weight, config)
                module.register_buffer(slot, quantized)
                count += int(type(quantized) is not torch.Tensor)  # a kept weight is plain
            else:
                delattr(module, slot)  # the slot becomes a submodule of the same name
                module.add_module(slot, Int8Linear(weight))
                count += 1
    return count

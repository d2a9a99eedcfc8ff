"""int8 and fp8 weights for the layers' projections.

`--quantization int8` stores the layers' projection weights as int8 with one float32 scale per
output channel, and quantizes their inputs per token at run time (the scheme of torchao's
Int8DynamicActivationInt8WeightConfig). On the CPU the inputs of the projections a norm feeds
(qkv, MLP up) are smoothed first, with ranges measured at load (smoothing.py); the scaling
around the GEMM is written here and the GEMM is the fastest exact one of int8_kernels.py, chosen
at load by timing them on the model's own projections (cpu_kernels.py); on CUDA,
int8 and fp8 (per-row scales, Ada and Hopper) are torchao's tensor subclasses, which `F.linear`
dispatches. Embeddings, norms, attention and heads keep the compute dtype. Fidelity and speed:
docs/models.md, Precision.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from poolserve.models.int8_kernels import INT8_LEVELS, Int8Kernel, Scratch
from poolserve.types.errors import UnsupportedQuantizationError

# The GEMM an Int8Linear runs without a start-up choice (tests, benchmarks): torch's own.
INT_MM = Int8Kernel(None, INT8_LEVELS)


# The projections each scheme quantizes, by the buffer names the decoder and encoder layers give
# them: every one (fp8 keeps a per-element exponent, as vLLM's).
PROJECTION_WEIGHTS = ("qkv_weight", "o_weight", "gate_up_weight", "up_weight", "down_weight")
QUANTIZED_WEIGHTS: dict[str, tuple[str, ...]] = {
    "int8": PROJECTION_WEIGHTS,
    "fp8": PROJECTION_WEIGHTS,
}
# ... but int8 quantizes qkv only with its input smoothed (smoothing.py; the CPU path): a norm's
# few wide channels leave the others of a per-token int8 scale a handful of levels (MiniLM: qkv in
# int8 unsmoothed, worst cosine to float32 0.992; smoothed, 0.997). Unsmoothed it keeps the
# compute dtype: torchao's int8 on CUDA, a slot without a measured range.
SMOOTHED_ONLY: dict[str, tuple[str, ...]] = {"int8": ("qkv_weight",), "fp8": ()}
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper have fp8 tensor cores
INT8_MAX = INT8_LEVELS
INSTALL_HINT = "install torchao (pip install 'poolserve[quantization]')"


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
    """int8 runs on the CPU (its GEMM chosen at load: cpu_kernels.py) and on CUDA (torchao)."""
    if device.type == "cuda":
        return _torchao_missing()
    if device.type != "cpu":
        return "int8 runs on cpu and cuda"
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


class Int8Linear(torch.nn.Module):
    """A projection's int8 weight [out, in] with float32 per-channel scales, on an int8 GEMM.

    `kernel` is the GEMM chosen at start for this CPU (cpu_kernels.py); the kernels of one
    activation range compute the same exact integer sums, so among them the choice changes
    speed, not outputs (the 7-bit range is coarser: chosen only where no full-range one pays).
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    weight_sums: torch.Tensor
    inverse_smoothing: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,  # [out, in]
        kernel: Int8Kernel = INT_MM,
        smooth: torch.Tensor | None = None,  # [in] s: x / s times W * s (smoothing.py)
        scratch: Scratch | None = None,  # shared by a model's projections (None: its own)
    ) -> None:
        super().__init__()
        self.scratch = Scratch() if scratch is None else scratch
        if smooth is not None:
            weight = weight.float() * smooth
        scale = weight.float().abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).eps)
        scale = scale / INT8_MAX  # [out]
        qweight = torch.round(weight.float() / scale[:, None]).to(torch.int8)  # [out, in]
        self.kernel = kernel
        self.packed = kernel.pack(qweight.contiguous(), scale.contiguous())
        # int_mm reads the int8 weight itself; an engine keeps its own packed copy, and the
        # buffer only states the shape (a meta tensor: no storage; counted by cpu_threads)
        keep = qweight if kernel.engine is None else qweight.to("meta")
        self.register_buffer("qweight", keep.contiguous())
        self.register_buffer("scale", scale.contiguous())
        # an asymmetric kernel's shift adds offset * sum(qweight) per channel back, weight-scaled
        self.register_buffer("weight_sums", qweight.float().sum(1).mul_(scale).contiguous())
        inverse = None if smooth is None else smooth.float().reciprocal().contiguous()
        self.register_buffer("inverse_smoothing", inverse)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, in] in the compute dtype
        bias: torch.Tensor | None,  # [out]
    ) -> torch.Tensor:  # [num_tokens, out] in the compute dtype
        """x @ W.T + bias with x quantized per token: int8 GEMM, exact sums, float32 scaling."""
        given = x
        if x.dtype != torch.float32 or self.inverse_smoothing is not None:
            # the float32 (or smoothed) copy on a reusable buffer: the caller's x stays as it is
            x = self.scratch.get(x.shape, torch.float32, "input")
            if self.inverse_smoothing is None:
                x.copy_(given)
            else:
                torch.mul(given, self.inverse_smoothing, out=x)
        own = x is not given  # this call's own copy: the kernel scales it in place
        levels = self.kernel.levels
        high, low = x.amax(-1, keepdim=True), x.amin(-1, keepdim=True)  # [num_tokens, 1] each
        if self.kernel.asymmetric:
            # each token's [low, high] in 2 * levels + 1 steps: x / x_scale - offset spans
            # [-levels - 1, levels], the range the engine's sentinel rows fix
            x_scale = (high - low).clamp_min_(torch.finfo(torch.float32).eps).div_(2 * levels + 1)
            offset = low.div(x_scale).add_(levels + 1)
            y = self.kernel.matmul(x, x_scale, self.packed, offset, scratch=self.scratch)
            y.addcmul_(offset, self.weight_sums)  # the shift's share, weight-scaled
        else:
            # max |x| per token from the two extremes: no |x| tensor is written
            x_scale = torch.maximum(high, low.neg_())
            x_scale = x_scale.clamp_min_(torch.finfo(torch.float32).eps).div_(levels)
            # |x / x_scale| <= levels by construction: no clamp is needed before the GEMM rounds
            y = self.kernel.matmul(x, x_scale, self.packed, in_place=own, scratch=self.scratch)
        if bias is None:
            return y.mul_(x_scale).to(given.dtype)
        return torch.addcmul(bias, y, x_scale, out=y).to(
            given.dtype
        )  # one pass: bias + y * x_scale

    def extra_repr(self) -> str:
        """Shape, as nn.Linear prints it, and the GEMM."""
        out_features, in_features = self.qweight.shape
        smoothed = ", smoothed" if self.inverse_smoothing is not None else ""
        return (
            f"in_features={in_features}, out_features={out_features}, "
            f"int8 {self.kernel.name}{smoothed}"
        )


def buffer_name(prefix: str, slot: str) -> str:
    """A projection's buffer name in the model ('layers.0.qkv_weight'): smoothing's keys."""
    return f"{prefix}.{slot}" if prefix else slot


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
    model: torch.nn.Module,
    name: str | None,
    device: torch.device,
    use_torchao: bool | None = None,
    kernel: Int8Kernel = INT_MM,
    smoothing: Mapping[str, torch.Tensor] | None = None,  # smoothing.measure_smoothing's
) -> int:
    """Replaces every projection weight in place; returns how many were quantized.

    `use_torchao` None: torchao on CUDA, Int8Linear on `kernel` on the CPU (True compares them).
    An Int8Linear whose buffer name ('layers.0.qkv_weight') is in `smoothing` is smoothed by it;
    torchao's weights are not.
    """
    if name is None:
        return 0
    with_torchao = (device.type == "cuda" or name == "fp8") if use_torchao is None else use_torchao
    config = _torchao_config(name) if with_torchao else None
    factors = {} if smoothing is None or config is not None else smoothing
    scratch = Scratch()  # the projections run one after another: one set of input buffers
    count = 0
    for prefix, module in list(model.named_modules()):
        buffers = dict(module.named_buffers(recurse=False))
        for slot in QUANTIZED_WEIGHTS[name]:
            weight = buffers.get(slot)
            smooth = factors.get(buffer_name(prefix, slot))
            if weight is None or (smooth is None and slot in SMOOTHED_ONLY[name]):
                continue
            if config is not None:
                quantized = torchao_weight(weight, config)
                module.register_buffer(slot, quantized)
                count += int(type(quantized) is not torch.Tensor)  # a kept weight is plain
            else:
                delattr(module, slot)  # the slot becomes a submodule of the same name
                module.add_module(slot, Int8Linear(weight, kernel, smooth, scratch))
                count += 1
    return count

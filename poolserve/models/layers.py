"""Small numeric building blocks shared by the decoder and encoder forwards."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from poolserve.models.float_kernels import PackedLinear
from poolserve.models.quantization import Int8Linear
from poolserve.types.errors import ModelLoadError

# A projection weight: a tensor (plain, or torchao's quantized subclass), or a CPU kernel's
# module chosen at load (cpu_kernels.py): the int8 one, or a oneDNN-prepacked float weight.
Weight = torch.Tensor | Int8Linear | PackedLinear

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    # CLIP's: x * sigmoid(1.702 x)
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function a config names."""
    if name not in ACTIVATIONS:
        raise ModelLoadError(f"unsupported activation {name!r}")
    return ACTIVATIONS[name]


# Activations oneDNN computes as the same function in a packed GEMM's epilogue (saving a pass
# over the MLP's widest tensor): activation -> (oneDNN post-op, its algorithm).
FUSED_POST_OPS: dict[Callable[[torch.Tensor], torch.Tensor], tuple[str, str]] = {
    ACTIVATIONS["gelu"]: ("gelu", "none"),
    ACTIVATIONS["gelu_new"]: ("gelu", "tanh"),
    ACTIVATIONS["gelu_pytorch_tanh"]: ("gelu", "tanh"),
    ACTIVATIONS["relu"]: ("relu", ""),
}


# The same activations computed in place on a projection's output (the call's own new tensor)
# where no GEMM epilogue takes them (an int8 GEMM's output is scaled per token after it; torch's
# float GEMM has none): the MLP's widest tensor is not allocated and faulted in a second time.
IN_PLACE: dict[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] = {
    ACTIVATIONS["silu"]: functools.partial(F.silu, inplace=True),
    ACTIVATIONS["gelu"]: torch.ops.aten.gelu_,
    ACTIVATIONS["gelu_new"]: functools.partial(torch.ops.aten.gelu_, approximate="tanh"),
    ACTIVATIONS["gelu_pytorch_tanh"]: functools.partial(torch.ops.aten.gelu_, approximate="tanh"),
    ACTIVATIONS["relu"]: functools.partial(F.relu, inplace=True),
}


def linear_act(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """act(x @ weight.T + bias), fused where the weight is oneDNN-packed and oneDNN has it, else
    in place on the projection's output where the activation has an in-place form."""
    post_op = FUSED_POST_OPS.get(act)
    if post_op is not None and isinstance(weight, PackedLinear):
        return weight(x, bias, post_op)
    return IN_PLACE.get(act, act)(linear(x, weight, bias))


def gated(
    act: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor
) -> torch.Tensor:
    """act(gate) * up, written over `gate` where the activation has an in-place form: gate and
    up are halves of the caller's own projection output, so no MLP-wide tensor is allocated."""
    return IN_PLACE.get(act, act)(gate).mul_(up)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias, whatever form the projection's weight was given at load."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    return weight(x, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32; a model-dtype weight scales after the cast back, a float32 one before.

    Llama-style norms cast to the model dtype and then scale; Gemma scales by (1 + weight) in
    float32 and casts last. norm_weight() stores Gemma's folded weight in float32, so the weight's
    dtype picks the order (both orders are the same computation in a float32 model).
    """
    x32 = x.float()
    # mean(x^2) from the norm: one read of x, where pow() writes a step-sized tensor (the two
    # sum in another order: the variance differs in its last bits, about 4e-7 relative)
    variance = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_().div_(x.shape[-1])
    normed = x32 * torch.rsqrt(variance.add_(eps))  # the one new step-sized tensor
    # the weight scales in place, in the reference's order (weight * y == y * weight bit for bit)
    if weight.dtype == torch.float32:
        return normed.mul_(weight).to(x.dtype)
    return normed.to(x.dtype).mul_(weight)


def norm_weight(
    weight: torch.Tensor, offset: bool, placement: tuple[torch.device, torch.dtype]
) -> torch.Tensor:
    """An RMSNorm weight placed for rms_norm(); Gemma's (1 + weight) is folded in float32."""
    if offset:
        return (weight.float() + 1.0).to(placement[0]).contiguous()
    return weight.to(device=placement[0], dtype=placement[1]).contiguous()


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap), Gemma2's soft-capping of logits; identity without a cap."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


def to_device(
    tensor: torch.Tensor | None, device: torch.device, dtype: torch.dtype
) -> torch.Tensor | None:
    """Moves an optional weight to the model's device and dtype."""
    return None if tensor is None else tensor.to(device=device, dtype=dtype).contiguous()

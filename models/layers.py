"""Small numeric building blocks shared by the decoder and encoder forwards."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from models.errors import ModelLoadError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function a config names."""
    if name not in ACTIVATIONS:
        raise ModelLoadError(f"unsupported activation {name!r}")
    return ACTIVATIONS[name]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back before the weight, as the reference does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def to_device(
    tensor: torch.Tensor | None, device: torch.device, dtype: torch.dtype
) -> torch.Tensor | None:
    """Moves an optional weight to the model's device and dtype."""
    return None if tensor is None else tensor.to(device=device, dtype=dtype).contiguous()

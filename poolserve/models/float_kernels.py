"""The CPU GEMMs a float32 or bfloat16 projection can run on: torch's F.linear, or oneDNN's
linear on a weight prepacked once into its blocked layout.

`F.linear` hands every call's weight to the BLAS as it is stored; oneDNN's prepacked weight (the
one torch's own compiler uses when it freezes a model: `mkldnn._reorder_linear_weight`, then
`mkldnn._linear_pointwise`) skips that per-call packing. Measured on MiniLM's projections on an
AVX-512 CPU, 2 threads: 10% to 30% less time. Both are private torch operators, so each kernel is
checked against F.linear once before it may run (`is_close`), and the start-up timing decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from poolserve.models.quantization import PROJECTION_WEIGHTS

# A kernel must match F.linear within this share of the output's scale (float32 accumulation
# order differs; bfloat16 rounds its output).
CLOSE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}


@dataclass(frozen=True)
class FloatKernel:
    """One float GEMM: "torch" keeps the plain weight; "onednn" prepacks it (PackedLinear)."""

    name: str

    def wrap(self, weight: torch.Tensor) -> torch.Tensor | PackedLinear:  # [out, in]
        """The weight in the form `layers.linear` runs this kernel with."""
        return weight if self.name == "torch" else PackedLinear(weight)


TORCH = FloatKernel("torch")
ONEDNN = FloatKernel("onednn")
KERNELS = (TORCH, ONEDNN)


class PackedLinear(torch.nn.Module):
    """A projection's weight in oneDNN's blocked layout (same dtype, same bytes)."""

    packed: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:  # [out, in]
        super().__init__()
        # None: packed for any number of rows (a step's token count varies)
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, None))
        self.out_features, self.in_features = weight.shape

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, in]
        bias: torch.Tensor | None,  # [out]
        post_op: tuple[str, str] = ("none", ""),  # oneDNN's fused activation and its algorithm
    ) -> torch.Tensor:  # [num_tokens, out]
        """act(x @ W.T + bias) on oneDNN's kernel; no activation by default."""
        attr, algorithm = post_op
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, bias, attr, [], algorithm
        )

    def extra_repr(self) -> str:
        """Shape, as nn.Linear prints it, and the GEMM."""
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def is_close(kernel: FloatKernel, dtype: torch.dtype) -> bool:
    """The kernel runs in `dtype` here and matches F.linear on a small random problem."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 40, generator=generator).to(dtype)
    bias = torch.randn(24, generator=generator).to(dtype)
    x = torch.randn(7, 40, generator=generator).to(dtype)
    want = F.linear(x, weight, bias).float()
    try:
        wrapped = kernel.wrap(weight)
        got = F.linear(x, wrapped, bias) if isinstance(wrapped, torch.Tensor) else wrapped(x, bias)
    except (RuntimeError, NotImplementedError, AttributeError):  # absent from this build or CPU
        return False
    scale = float(want.abs().max())
    return bool((got.float() - want).abs().max() <= CLOSE[dtype] * scale)


def pack_linears(model: torch.nn.Module, kernel: FloatKernel) -> int:
    """Puts every plain projection weight on `kernel` in place (after int8 took its own)."""
    if kernel == TORCH:
        return 0
    count = 0
    for module in list(model.modules()):
        buffers = dict(module.named_buffers(recurse=False))
        for slot in PROJECTION_WEIGHTS:
            weight = buffers.get(slot)
            if type(weight) is torch.Tensor and weight.dim() == 2:
                delattr(module, slot)  # the slot becomes a submodule of the same name
                module.add_module(slot, PackedLinear(weight))
                count += 1
    return count

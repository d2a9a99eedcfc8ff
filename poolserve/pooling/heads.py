"""Heads turn pooled hidden states into task outputs; they compute in float32."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from poolserve.types.params import NO_CALIBRATION, LogitCalibration
from poolserve.types.tasks import PoolingType


def run_fp32(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run a shared head module on float32 input with float32 weights, never mutating it."""
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    if all(t.dtype == torch.float32 or not t.is_floating_point() for t in state.values()):
        return module(x)
    # A half-precision checkpoint head: use float32 copies of its weights for this call.
    fp32_state = {k: t.float() if t.is_floating_point() else t for k, t in state.items()}
    return torch.func.functional_call(module, fp32_state, (x,))


def _activate(logits: torch.Tensor) -> torch.Tensor:
    """Sigmoid for one label, softmax over labels otherwise (the last dimension)."""
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


class Head(ABC):
    """Maps one request's pooled states to its float32 output."""

    # Whether the output can be the input itself (no computation); then the method must make a
    # finished output own its storage under async scheduling.
    may_alias_input: bool = False

    @abstractmethod
    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """The task output for this request."""

    def calibrated(self, calibration: LogitCalibration) -> Head:
        """This head with its classifier logits calibrated; a head without logits is itself."""
        return self

    def batch_key(self) -> Hashable | None:
        """Equal for heads that compute the same function row by row, so that one call on rows
        `[B, hidden]` gives each request's output (None: this head runs one request at a time)."""
        return None


class EmbeddingHead(Head):
    """Optional Dense projection, Matryoshka truncation, then L2 normalization."""

    def __init__(
        self, projection: nn.Module | None, dimensions: int | None, normalize: bool
    ) -> None:
        self.projection = projection
        self.dimensions = dimensions
        self.normalize = normalize
        self.may_alias_input = projection is None and not normalize

    def batch_key(self) -> Hashable | None:
        """Row by row: the projection (the model's one module), truncation and normalization."""
        return (EmbeddingHead, id(self.projection), self.dimensions, self.normalize)

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[..., hidden]` -> `[..., dimensions or embed size]`."""
        x = pooled.float()  # [..., hidden]
        if self.projection is not None:
            x = run_fp32(self.projection, x)  # [embed_output_size]
        if self.dimensions is not None:
            x = x[..., : self.dimensions]  # [dimensions]
        return F.normalize(x, p=2.0, dim=-1) if self.normalize else x


class ClassifierHead(Head):
    """The checkpoint's score layer on one pooled row `[hidden]` or per token `[T, hidden]`."""

    def __init__(
        self,
        score: nn.Module,
        use_activation: bool,
        calibration: LogitCalibration = NO_CALIBRATION,
    ) -> None:
        self.score = score
        self.use_activation = use_activation
        self.calibration = calibration

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[..., hidden]` -> `[..., num_labels]`: probabilities, or (calibrated) logits."""
        logits = self.calibration(run_fp32(self.score, pooled.float()))  # [..., num_labels]
        return _activate(logits) if self.use_activation else logits

    def calibrated(self, calibration: LogitCalibration) -> Head:
        """The same classifier, its logits calibrated before the activation (as vLLM's)."""
        return ClassifierHead(self.score, self.use_activation, calibration)


class TokenEmbeddingHead(Head):
    """Per-token embeddings `[T, D]`: optionally projected (ColBERT), L2-normalized per token."""

    def __init__(self, normalize: bool, projection: nn.Module | None = None) -> None:
        self.normalize = normalize
        self.projection = projection
        self.may_alias_input = not normalize and projection is None

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[T, hidden]` -> `[T, D]` (D = hidden without a projection)."""
        x = pooled.float()  # [T, hidden]
        if self.projection is not None:
            x = run_fp32(self.projection, x)  # [T, D]
        return F.normalize(x, p=2.0, dim=-1) if self.normalize else x


# Reduce all token states `[T, hidden]` to one row as the named pooling type does.
SEQUENCE_REDUCERS: dict[PoolingType, Callable[[torch.Tensor], torch.Tensor]] = {
    PoolingType.CLS: lambda x: x[0],
    PoolingType.LAST: lambda x: x[-1],
    PoolingType.MEAN: lambda x: x.float().mean(dim=0),
}


class EmbedTokenClassifyHead(Head):
    """The embedding followed by the flattened per-token classifier outputs, `[D + T * L]`."""

    def __init__(
        self, embed_pooling: PoolingType, embed: EmbeddingHead, tokens: ClassifierHead
    ) -> None:
        self.reduce = SEQUENCE_REDUCERS[embed_pooling]
        self.embed = embed
        self.tokens = tokens

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[T, hidden]` -> `[D + T * L]`."""
        embedding = self.embed(self.reduce(pooled))  # [D]
        token_outputs = self.tokens(pooled)  # [T, L]
        return torch.cat([embedding, token_outputs.reshape(-1)])

    def calibrated(self, calibration: LogitCalibration) -> Head:
        """The per-token classifier part calibrated; the embedding is not a logit."""
        head = copy.copy(self)
        head.tokens = ClassifierHead(self.tokens.score, self.tokens.use_activation, calibration)
        return head


class ProcessRewardHead(Head):
    """Softmax over the PRM labels at each step, optionally selecting label columns."""

    def __init__(self, head: nn.Module, returned_token_ids: tuple[int, ...] | None) -> None:
        self.head = head
        self.returned_token_ids = returned_token_ids

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[num_steps, hidden]` -> `[num_steps, num_labels or len(returned_token_ids)]`."""
        probs = torch.softmax(run_fp32(self.head, pooled.float()), dim=-1)  # [S, num_labels]
        if self.returned_token_ids is None:
            return probs
        # Column views stacked on the device: no index tensor to copy from the host.
        return torch.stack([probs[:, i] for i in self.returned_token_ids], dim=1)  # [S, k]


class TokenRewardHead(Head):
    """Raw per-token reward of a `Qwen2ForRewardModel` head, `[T]`."""

    def __init__(self, head: nn.Module) -> None:
        self.head = head

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[T, hidden]` -> `[T]`."""
        return run_fp32(self.head, pooled.float()).squeeze(-1)  # [T]

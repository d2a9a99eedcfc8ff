"""Builds the checkpoint's head modules (score, classifier, PRM, reward) in float32."""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.errors import ModelLoadError
from models.registry import ArchitectureEntry
from models.spec import HeadKind, ModelHeads
from models.weights import take


def _linear(state: dict[str, torch.Tensor], prefix: str) -> torch.nn.Linear:
    """A float32 Linear from `{prefix}weight` and an optional `{prefix}bias`."""
    weight = take(state, f"{prefix}weight")
    bias = state.get(f"{prefix}bias")
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
        if bias is not None:
            linear.bias.copy_(bias.float())
    return linear


def _head_prefix(entry: ArchitectureEntry) -> str:
    """The head's weight prefix; registry entries with a head always name one."""
    if entry.head_prefix is None:
        raise ModelLoadError("architecture entry has a head kind but no head prefix")
    return entry.head_prefix


def _classifier(entry: ArchitectureEntry, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """score / classifier Linear; BERT sequence classifiers first pool CLS via dense + tanh."""
    classifier = _linear(state, _head_prefix(entry))
    if entry.pooler_prefix is None:
        return classifier
    return torch.nn.Sequential(_linear(state, entry.pooler_prefix), torch.nn.Tanh(), classifier)


def _mlp_head(entry: ArchitectureEntry, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Linear(h, h) - ReLU - Linear(h, n), saved as score.0 / score.2."""
    prefix = _head_prefix(entry)
    return torch.nn.Sequential(
        _linear(state, f"{prefix}0."), torch.nn.ReLU(), _linear(state, f"{prefix}2.")
    )


_BUILDERS: dict[
    HeadKind, Callable[[ArchitectureEntry, dict[str, torch.Tensor]], torch.nn.Module]
] = {
    HeadKind.SEQUENCE_CLASSIFIER: _classifier,
    HeadKind.TOKEN_CLASSIFIER: _classifier,
    HeadKind.PROCESS_REWARD: _mlp_head,
    HeadKind.TOKEN_REWARD: _mlp_head,
}
_FIELDS = {
    HeadKind.SEQUENCE_CLASSIFIER: "seq_classifier",
    HeadKind.TOKEN_CLASSIFIER: "token_classifier",
    HeadKind.PROCESS_REWARD: "process_reward",
    HeadKind.TOKEN_REWARD: "token_reward",
}


def build_heads(
    entry: ArchitectureEntry, state: dict[str, torch.Tensor], device: torch.device
) -> ModelHeads:
    """The head modules of a checkpoint (full state dict, original key names)."""
    if entry.head_kind is HeadKind.NONE:
        return ModelHeads()
    module = _BUILDERS[entry.head_kind](entry, state).float().to(device).eval()
    module.requires_grad_(False)
    return ModelHeads(**{_FIELDS[entry.head_kind]: module})


def head_out_features(heads: ModelHeads) -> int | None:
    """Output width of whichever head is set (the number of labels), None without a head."""
    for module in (
        heads.seq_classifier,
        heads.token_classifier,
        heads.process_reward,
        heads.token_reward,
    ):
        if module is not None:
            linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
            return linears[-1].out_features
    return None

"""Builds the checkpoint's head modules (score, classifier, PRM, reward) in float32."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PretrainedConfig

from models.errors import ModelLoadError
from models.layers import activation
from models.registry import ArchitectureEntry, HeadTransform
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


class _Activation(torch.nn.Module):
    """A named activation as a module, so head chains stay plain Sequentials."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.fn = torch.tanh if name == "tanh" else activation(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """fn(x)."""
        return self.fn(x)

    def extra_repr(self) -> str:
        """The activation's name, for printed head chains."""
        return self.name


def _layer_norm(state: dict[str, torch.Tensor], prefix: str, eps: float) -> torch.nn.LayerNorm:
    """A float32 LayerNorm from `{prefix}weight` and an optional `{prefix}bias`."""
    weight = take(state, f"{prefix}weight")
    bias = state.get(f"{prefix}bias")
    norm = torch.nn.LayerNorm(weight.shape[0], eps=eps, bias=bias is not None)
    with torch.no_grad():
        norm.weight.copy_(weight.float())
        if bias is not None:
            norm.bias.copy_(bias.float())
    return norm


def _transform(
    transform: HeadTransform, state: dict[str, torch.Tensor], config: PretrainedConfig
) -> list[torch.nn.Module]:
    """Dense, activation and optional LayerNorm, as the checkpoint's head applies them."""
    name = transform.activation
    if transform.activation_key is not None:
        name = str(getattr(config, transform.activation_key))
    modules = [_linear(state, transform.dense_prefix), _Activation(name)]
    if transform.norm_prefix is not None:
        eps = float(getattr(config, transform.eps_key))
        modules.append(_layer_norm(state, transform.norm_prefix, eps))
    return modules


def _classifier(
    entry: ArchitectureEntry, state: dict[str, torch.Tensor], config: PretrainedConfig
) -> torch.nn.Module:
    """score / classifier Linear, after the transform encoder heads apply (BERT's pooler...)."""
    classifier = _linear(state, _head_prefix(entry))
    if entry.transform is None:
        return classifier
    return torch.nn.Sequential(*_transform(entry.transform, state, config), classifier)


def _mlp_head(
    entry: ArchitectureEntry, state: dict[str, torch.Tensor], config: PretrainedConfig
) -> torch.nn.Module:
    """Linear(h, h) - ReLU - Linear(h, n), saved as score.0 / score.2."""
    prefix = _head_prefix(entry)
    return torch.nn.Sequential(
        _linear(state, f"{prefix}0."), torch.nn.ReLU(), _linear(state, f"{prefix}2.")
    )


_BUILDERS: dict[
    HeadKind,
    Callable[[ArchitectureEntry, dict[str, torch.Tensor], PretrainedConfig], torch.nn.Module],
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
    entry: ArchitectureEntry,
    state: dict[str, torch.Tensor],
    device: torch.device,
    config: PretrainedConfig,
) -> ModelHeads:
    """The head modules of a checkpoint (full state dict, original key names)."""
    if entry.head_kind is HeadKind.NONE:
        return ModelHeads()
    module = _BUILDERS[entry.head_kind](entry, state, config).float().to(device).eval()
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

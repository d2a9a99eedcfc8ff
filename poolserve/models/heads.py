"""Builds the checkpoint's head module (score, classifier, PRM, reward, MLM, ColBERT) in float32."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from poolserve.models.decoder_config import LogitsTransform, logits_transform
from poolserve.models.families.records import (
    ArchitectureEntry,
    HeadTransform,
    MaskedLMHead,
    PerToken,
)
from poolserve.models.late_interaction import token_projection
from poolserve.models.layers import activation
from poolserve.models.registry import DECODER_FAMILIES, MASKED_LM_LAYOUTS
from poolserve.models.weights import take
from poolserve.types.errors import ModelLoadError
from poolserve.types.model_info import SEQ_POOLER, SEQ_SCORE
from poolserve.types.tasks import LABELLED_HEADS, HeadKind

logger = logging.getLogger(__name__)


def _linear(state: dict[str, torch.Tensor], prefix: str) -> torch.nn.Linear:
    """A float32 Linear from `{prefix}weight` and an optional `{prefix}bias`."""
    return _linear_of(take(state, f"{prefix}weight"), state.get(f"{prefix}bias"))


def _linear_of(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    """A float32 Linear holding copies of `weight` `[out, in]` and `bias` `[out]`."""
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
        eps = (
            transform.eps
            if transform.eps is not None
            else float(getattr(config, transform.eps_key))
        )
        modules.append(_layer_norm(state, transform.norm_prefix, eps))
    return modules


def _classifier(
    entry: ArchitectureEntry, state: dict[str, torch.Tensor], config: PretrainedConfig
) -> torch.nn.Module:
    """score / classifier Linear, after the transform encoder heads apply (BERT's pooler...)."""
    classifier = _linear(state, _head_prefix(entry))
    transform = [] if entry.transform is None else _transform(entry.transform, state, config)
    if classifier_pooling(entry, config) == LATE:
        # the head sees every token `[T, hidden]` (pooling ALL) and averages its logits
        return torch.nn.Sequential(*transform, classifier, _TokenMean())
    if not transform:
        return classifier
    if entry.per_token is PerToken.CLASSIFIER:
        # the transform is the backbone's pooler: named, so token_classify can leave it out
        pooler = torch.nn.Sequential(*transform)
        return torch.nn.Sequential(OrderedDict([(SEQ_POOLER, pooler), (SEQ_SCORE, classifier)]))
    return torch.nn.Sequential(*transform, classifier)


# A sequence classifier's pooling that runs the whole head on every token and averages the
# logits (EuroBERT's "late"); pooling hands it every token's state.
LATE = "late"


class _TokenMean(torch.nn.Module):
    """The mean over the token dimension, `[..., T, labels] -> [..., labels]`, as a sum over
    the tokens divided by their count (transformers' masked mean over a prompt's tokens)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x.sum(-2) / T."""
        return x.sum(dim=-2) / x.shape[-2]


def classifier_pooling(entry: ArchitectureEntry, config: PretrainedConfig) -> str | None:
    """The sequence classifier's pooling name ("cls", "mean", "late"); None: the backbone's
    default token. An entry that maps config.classifier_pooling refuses a value it lacks."""
    value = getattr(config, "classifier_pooling", None)
    if not entry.classifier_pooling:
        if entry.backbone.is_decoder:
            return None
        if value == LATE:  # only a head built to average its logits may be handed every token
            raise ModelLoadError(f"classifier_pooling {LATE!r} is not supported here")
        return value
    names = dict(entry.classifier_pooling)
    if value not in names:
        known = ", ".join(sorted(names))
        raise ModelLoadError(f"classifier_pooling {value!r} is not supported (known: {known})")
    return names[value]


def _mlp_head(
    entry: ArchitectureEntry, state: dict[str, torch.Tensor], config: PretrainedConfig
) -> torch.nn.Module:
    """Linear(h, h) - ReLU - Linear(h, n), saved as score.0 / score.2."""
    prefix = _head_prefix(entry)
    return torch.nn.Sequential(
        _linear(state, f"{prefix}0."), torch.nn.ReLU(), _linear(state, f"{prefix}2.")
    )


def _masked_lm(
    entry: ArchitectureEntry, state: dict[str, torch.Tensor], config: PretrainedConfig
) -> torch.nn.Module:
    """The MLM head: transform, then the vocabulary decoder, `[..., hidden] -> [..., vocab]`."""
    layout = _masked_lm_layout(state, config)
    if layout is None:
        raise ModelLoadError(f"the checkpoint holds no {config.model_type} MLM head weights")
    transform = [] if layout.transform is None else _transform(layout.transform, state, config)
    return torch.nn.Sequential(*transform, _decoder(layout, state, config))


def _masked_lm_layout(
    state: dict[str, torch.Tensor], config: PretrainedConfig
) -> MaskedLMHead | None:
    """The family's first MLM layout whose dense weight (without a transform: its decoder's
    weight, or the embeddings it is tied to) the checkpoint holds."""
    layouts = MASKED_LM_LAYOUTS.get(str(config.model_type), ())
    return next((x for x in layouts if _masked_lm_marker(x, config) in state), None)


def _masked_lm_marker(layout: MaskedLMHead, config: PretrainedConfig) -> str:
    """The tensor whose presence says the checkpoint holds this MLM head."""
    if layout.transform is not None:
        return f"{layout.transform.dense_prefix}weight"
    if getattr(config, "tie_word_embeddings", True):
        return layout.embeddings
    return f"{layout.decoder_prefix}weight"


def _decoder(
    layout: MaskedLMHead, state: dict[str, torch.Tensor], config: PretrainedConfig
) -> torch.nn.Linear:
    """The vocabulary Linear: tied to the word embeddings unless the config unties it, as in HF.

    Tying also ties the decoder's bias to the head's own (BERT's cls.predictions.bias); an untied
    decoder keeps its own weight and bias.
    """
    own = layout.decoder_prefix
    untied = not getattr(config, "tie_word_embeddings", True) and f"{own}weight" in state
    weight = take(state, f"{own}weight" if untied else layout.embeddings)
    biases = (f"{own}bias", layout.bias) if untied else (layout.bias, f"{own}bias")
    bias = next((state[key] for key in biases if key is not None and key in state), None)
    return _linear_of(weight, bias)


# vLLM's hf-overrides `method`s that read a causal LM as a classifier from LM-head rows.
FROM_2_WAY_SOFTMAX = "from_2_way_softmax"  # rows (false, true): one logit, true minus false
NO_POST_PROCESSING = "no_post_processing"  # one logit per row, as the LM head gives it
LM_HEAD_METHODS = (FROM_2_WAY_SOFTMAX, NO_POST_PROCESSING)
# Where a tied LM head's weights live: the decoder's input embeddings.
TIED_LM_HEADS = (
    "model.embed_tokens.weight",
    "embed_tokens.weight",
    "model.language_model.embed_tokens.weight",  # a vision-language checkpoint's decoder
)


@dataclass(frozen=True)
class LMHeadRows:
    """A causal LM scored through the LM-head rows of a few tokens (`classifier_from_token`)."""

    method: str
    token_ids: tuple[int, ...]


class _Logits(torch.nn.Module):
    """The causal LM's logits transform (Granite's scaling, Gemma's soft-cap) as a module."""

    def __init__(self, transform: LogitsTransform) -> None:
        super().__init__()
        self.transform = transform

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        """transform(logits)."""
        return self.transform(logits)


def lm_head_method(config: PretrainedConfig) -> str | None:
    """How the config reads its causal LM as a classifier (vLLM's names); None: it does not."""
    method = getattr(config, "method", None)
    if method is None and getattr(config, "is_original_qwen3_reranker", False):
        method = FROM_2_WAY_SOFTMAX  # what vLLM derives from the flag
    if method is None:
        return None
    tokens = getattr(config, "classifier_from_token", None)
    if method not in LM_HEAD_METHODS:
        raise ModelLoadError(f"method {method!r} is not supported (known: {LM_HEAD_METHODS})")
    wanted = 2 if method == FROM_2_WAY_SOFTMAX else None
    if not isinstance(tokens, list) or not tokens or (wanted and len(tokens) != wanted):
        raise ModelLoadError(
            f"method {method} needs classifier_from_token: a list of "
            f'{wanted or "one or more"} tokens, e.g. ["no", "yes"]'
        )
    return str(method)


def _lm_head_rows(
    rows: LMHeadRows, state: dict[str, torch.Tensor], config: PretrainedConfig
) -> torch.nn.Module:
    """Only the tokens' rows of the LM head (or tied embeddings), then the logits transform."""
    name = "lm_head.weight"
    if getattr(config, "tie_word_embeddings", False):
        name = next((k for k in TIED_LM_HEADS if k in state), TIED_LM_HEADS[0])
    weight = take(state, name)[list(rows.token_ids)]  # [num_tokens, hidden], a copy of the rows
    family = DECODER_FAMILIES[str(config.model_type)]
    modules = [_linear_of(weight, None), _Logits(logits_transform(config, family))]
    if rows.method == FROM_2_WAY_SOFTMAX:
        # softmax over (false, true) at true = sigmoid(true - false): one logit, as in vLLM
        modules.append(_linear_of(torch.tensor([[-1.0, 1.0]]), None))
    return torch.nn.Sequential(*modules)


_BUILDERS: dict[
    HeadKind,
    Callable[[ArchitectureEntry, dict[str, torch.Tensor], PretrainedConfig], torch.nn.Module],
] = {
    HeadKind.SEQUENCE_CLASSIFIER: _classifier,
    HeadKind.TOKEN_CLASSIFIER: _classifier,
    HeadKind.PROCESS_REWARD: _mlp_head,
    HeadKind.TOKEN_REWARD: _mlp_head,
    HeadKind.MASKED_LM: _masked_lm,
    HeadKind.LATE_INTERACTION: token_projection,
}


def build_head(
    entry: ArchitectureEntry,
    state: dict[str, torch.Tensor],
    device: torch.device,
    config: PretrainedConfig,
    lm_head_rows: LMHeadRows | None = None,
) -> torch.nn.Module | None:
    """The head module of a checkpoint (full state dict, original key names), of the entry's
    head kind; None without one."""
    if entry.head_kind is HeadKind.NONE:
        return None
    if lm_head_rows is not None:
        module = _lm_head_rows(lm_head_rows, state, config).to(device).eval()
        module.requires_grad_(False)
        return module
    if entry.head_kind is HeadKind.MASKED_LM and _masked_lm_layout(state, config) is None:
        # a dense embedder fine-tuned from an MLM may be saved without the head (sentence-
        # transformers saves the backbone alone): it still serves embed and token_embed
        logger.warning("no MLM head weights in the checkpoint: sparse embeddings are off")
        return None
    module = _BUILDERS[entry.head_kind](entry, state, config).float().to(device).eval()
    module.requires_grad_(False)
    return module


def head_out_features(head: torch.nn.Module | None, kind: HeadKind) -> int | None:
    """A labelled head's output width (the number of labels); None for any other."""
    if head is None or kind not in LABELLED_HEADS:
        return None
    linears = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    return linears[-1].out_features


class _Recording(dict[str, torch.Tensor]):
    """A state dict that notes every key a head builder reads."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(state)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        if key in self:
            self.read.add(key)
        return super().get(key, default)


@dataclass(frozen=True)
class HeadFactory:
    """Builds the checkpoint's head again from its own tensors with some replaced: a LoRA
    adapter's head (its `modules_to_save`, or LoRA merged into a head Linear). Kept for the
    small labelled heads only (classifiers, rewards): it holds the tensors the head reads."""

    entry: ArchitectureEntry
    tensors: dict[str, torch.Tensor]  # every tensor the head was built from, by checkpoint name
    device: torch.device
    config: PretrainedConfig

    def build(self, replaced: dict[str, torch.Tensor]) -> torch.nn.Module | None:
        """The head with `replaced` tensors (checkpoint names, shapes as the originals')."""
        return build_head(self.entry, {**self.tensors, **replaced}, self.device, self.config)


def build_head_and_factory(
    entry: ArchitectureEntry,
    state: dict[str, torch.Tensor],
    device: torch.device,
    config: PretrainedConfig,
    lm_head_rows: LMHeadRows | None = None,
) -> tuple[torch.nn.Module | None, HeadFactory | None]:
    """`build_head`, and for a labelled head the factory that builds it again for an adapter."""
    if lm_head_rows is not None or entry.head_kind not in LABELLED_HEADS:
        return build_head(entry, state, device, config, lm_head_rows), None
    recording = _Recording(state)
    head = build_head(entry, recording, device, config)
    tensors = {key: state[key] for key in recording.read}
    return head, HeadFactory(entry, tensors, device, config)

"""Frozen records describing a loaded model: spec, heads, what load_model() produces."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from poolserve.types.images import ImageInputs
from poolserve.types.model import SentenceTransformersConfig
from poolserve.types.tasks import HeadKind
from poolserve.types.vision import InlineImages

if TYPE_CHECKING:
    from poolserve.models.heads import HeadFactory
    from poolserve.models.packed import PackedModel
    from poolserve.models.peft import ServedAdapters


@dataclass(frozen=True)
class ModelSpec:
    """What the scheduler and pooling need to know about a model's shape and outputs."""

    architecture: str
    family: str
    is_causal: bool
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    dtype: torch.dtype
    head_kind: HeadKind
    num_labels: int | None
    labels: tuple[str, ...]
    supports_matryoshka: bool
    matryoshka_dimensions: tuple[int, ...] | None
    # How the checkpoint's sequence classifier pools, when its config says (ModernBERT's
    # classifier_pooling: "cls" or "mean"; EuroBERT's read as "cls", "mean" or "late": the head
    # on every token, its logits averaged); None = the backbone's default token.
    classifier_pooling: str | None = None
    # --quantization of the layers' projection weights (int8, fp8); None = the dtype's weights
    quantization: str | None = None
    # vLLM's use_sep_token: a text pair is laid out by the tokenizer's pair template; false: the
    # two texts are scored as one concatenated text (an LLM read through LM-head rows)
    pair_separator: bool = True
    # classifier_from_token of a causal LM read through LM-head rows (e.g. ("no", "yes")); the
    # front end knows an LLM reranker's prompt recipe by them (frontend/score_recipes.py)
    score_tokens: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoadedModel:
    """Everything load_model() produces."""

    path: Path
    spec: ModelSpec
    model: PackedModel
    # the checkpoint's one head module (float32), of kind spec.head_kind; None: no head
    head: torch.nn.Module | None
    tokenizer: PreTrainedTokenizerBase
    sentence_transformers: SentenceTransformersConfig | None
    lora: ServedAdapters | None = None  # LoRA serving: its room and --lora-modules' adapters
    # the head built again from its tensors with an adapter's replaced (LoRA served only)
    head_factory: HeadFactory | None = None
    # a model that takes images (a dual encoder's image tower): its processor and token cost
    images: ImageInputs | None = None
    # texts padded with the pad token to this many tokens, as the model was trained (SigLIP)
    pad_texts_to: int | None = None
    # a vision-language model's images inside its prompts (Qwen-VL): processor, placeholder
    inline_images: InlineImages | None = None

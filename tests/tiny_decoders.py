"""Tiny random-weight checkpoints of the Gemma 1/2/3, Phi-3, Granite and bidirectional decoders."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from tests.tiny_models import INIT_RANGE, MINILM_DIR, TOKENIZER_FILES, VOCAB_SIZE, TinySpec

# transformers starts norm weights at 1 (Gemma: 0, as it scales by 1 + weight) and biases at 0;
# random ones make a wrong norm offset, norm order or missing bias show in the outputs.
PERTURB_SCALE = 0.3


def _decoder(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "initializer_range": INIT_RANGE,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
    }
    base.update(overrides)
    return base


# Windows shorter than the 300-token test prompts; soft-caps small enough that tanh bends.
_GEMMA2 = _decoder(
    sliding_window=24,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=3.0,
    query_pre_attn_scalar=24,
)
_GEMMA3 = _decoder(
    sliding_window=32,
    layer_types=["sliding_attention", "full_attention"],
    query_pre_attn_scalar=32,
    final_logit_softcapping=3.0,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0},
    },
)
_PHI3 = _decoder(
    num_key_value_heads=1,
    sliding_window=48,
    partial_rotary_factor=0.5,
    bos_token_id=1,
    eos_token_id=2,
)
_GRANITE = _decoder(
    embedding_multiplier=4.0,
    residual_multiplier=0.5,
    attention_multiplier=0.1,
    logits_scaling=2.0,
    attention_bias=True,
    mlp_bias=True,
)

TINY_DECODERS: dict[str, TinySpec] = {
    "gemma": TinySpec("GemmaForCausalLM", "GemmaConfig", _decoder(num_key_value_heads=1)),
    "gemma_cls": TinySpec("GemmaForSequenceClassification", "GemmaConfig", _decoder(num_labels=3)),
    "gemma_tokcls": TinySpec("GemmaForTokenClassification", "GemmaConfig", _decoder(num_labels=4)),
    "gemma2": TinySpec("Gemma2ForCausalLM", "Gemma2Config", _GEMMA2),
    # The Skywork-Reward-Gemma-2 shape: one score per prompt.
    "gemma2_reward": TinySpec(
        "Gemma2ForSequenceClassification", "Gemma2Config", {**_GEMMA2, "num_labels": 1}
    ),
    "gemma2_tokcls": TinySpec(
        "Gemma2ForTokenClassification", "Gemma2Config", {**_GEMMA2, "num_labels": 3}
    ),
    "gemma3": TinySpec("Gemma3ForCausalLM", "Gemma3TextConfig", _GEMMA3),
    "gemma3_base": TinySpec("Gemma3TextModel", "Gemma3TextConfig", _GEMMA3),
    "gemma3_cls": TinySpec(
        "Gemma3TextForSequenceClassification", "Gemma3TextConfig", {**_GEMMA3, "num_labels": 2}
    ),
    # EmbeddingGemma's shape: bidirectional, sliding window (40 -> |q - k| < 21) on local layers.
    "gemma3_bidir": TinySpec(
        "Gemma3TextModel",
        "Gemma3TextConfig",
        {**_GEMMA3, "sliding_window": 40, "use_bidirectional_attention": True},
    ),
    "phi3": TinySpec("Phi3ForCausalLM", "Phi3Config", _PHI3),
    "phi3_cls": TinySpec("Phi3ForSequenceClassification", "Phi3Config", {**_PHI3, "num_labels": 2}),
    "phi3_tokcls": TinySpec("Phi3ForTokenClassification", "Phi3Config", {**_PHI3, "num_labels": 3}),
    "granite": TinySpec("GraniteForCausalLM", "GraniteConfig", _GRANITE),
    "granite_base": TinySpec("GraniteModel", "GraniteConfig", _GRANITE),
    # gte-Qwen2's shape: `is_causal: false`; the second layer slides (|q - k| <= 20).
    "qwen2_bidir": TinySpec(
        "Qwen2Model",
        "Qwen2Config",
        _decoder(is_causal=False, use_sliding_window=True, sliding_window=20, max_window_layers=1),
    ),
}


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Random norm weights and biases, drawn in a fixed order from a seeded generator."""
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith(".bias") or "norm" in name:
                param.add_(torch.randn(param.shape, generator=gen) * PERTURB_SCALE)


def build_hf_decoder(name: str, seed: int = 0) -> torch.nn.Module:
    """A random-weight transformers model of the named tiny spec (float32, eager, eval mode)."""
    spec = TINY_DECODERS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, spec.config_class)(**spec.config)
    config._attn_implementation = "eager"
    model = getattr(transformers, spec.hf_class)(config)
    _perturb(model, seed)
    return model.eval()


def save_tiny_decoder(name: str, directory: Path, seed: int = 0) -> Path:
    """Save the named tiny checkpoint (config, safetensors, tokenizer) into directory."""
    directory.mkdir(parents=True, exist_ok=True)
    build_hf_decoder(name, seed).save_pretrained(directory)
    for filename in TOKENIZER_FILES:
        shutil.copy(MINILM_DIR / filename, directory / filename)
    return directory


def decoder_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """name -> directory of that tiny checkpoint, built on first use under pytest's temp dir."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = save_tiny_decoder(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get

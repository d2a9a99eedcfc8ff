"""bge-m3: an XLM-RoBERTa checkpoint with its sparse and ColBERT heads saved as `.pt` beside it.

FlagEmbedding's BGEM3 saves `sparse_linear.pt` (Linear hidden -> 1) and `colbert_linear.pt`
(Linear hidden -> dim) with torch.save of each Linear's state dict (`weight`, `bias`). They are
read with torch.load(weights_only=True): tensors only, never arbitrary unpickling.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from poolserve.models.families.records import ArchitectureEntry, Backbone
from poolserve.models.families.roberta import BGE_M3_BACKBONES
from poolserve.types.errors import ModelLoadError
from poolserve.types.model_info import M3_COLBERT, M3_SPARSE
from poolserve.types.tasks import HeadKind

logger = logging.getLogger(__name__)

SPARSE_FILE = "sparse_linear.pt"
COLBERT_FILE = "colbert_linear.pt"
# the special tokens FlagEmbedding leaves out of the lexical weights
UNUSED_TOKENS = ("cls_token", "eos_token", "pad_token", "unk_token")


def m3_entry(path: Path, config: PretrainedConfig, entry: ArchitectureEntry) -> ArchitectureEntry:
    """The entry with bge-m3's head kind when both head files lie beside an XLM-R base model."""
    if (
        entry.backbone is not Backbone.ENCODER
        or entry.head_kind is not HeadKind.NONE
        or str(config.model_type) not in BGE_M3_BACKBONES
    ):
        return entry
    present = [name for name in (SPARSE_FILE, COLBERT_FILE) if (path / name).is_file()]
    if len(present) == 1:
        logger.warning("%s without its pair: serving the dense output only", present[0])
    if len(present) < 2:
        return entry
    return dataclasses.replace(entry, head_kind=HeadKind.BGE_M3)


def load_m3_heads(
    path: Path, config: PretrainedConfig, device: torch.device
) -> torch.nn.ModuleDict:
    """sparse_linear and colbert_linear: float32 Linears on the device (M3_SPARSE, M3_COLBERT)."""
    hidden = int(config.hidden_size)
    sparse = _linear(path / SPARSE_FILE, hidden, out_features=1)
    colbert = _linear(path / COLBERT_FILE, hidden, out_features=None)
    heads = torch.nn.ModuleDict({M3_SPARSE: sparse, M3_COLBERT: colbert})
    heads = heads.float().to(device).eval()
    heads.requires_grad_(False)
    return heads


def _linear(file: Path, hidden: int, out_features: int | None) -> torch.nn.Linear:
    """The Linear saved in `file`: `weight` `[out, hidden]` and `bias` `[out]`, nothing else."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as exc:
        raise ModelLoadError(
            f"cannot read {file.name} as tensors only (torch.load weights_only): {exc}"
        ) from exc
    if (
        not isinstance(state, dict)
        or set(state) != {"weight", "bias"}
        or not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in state.values())
    ):
        raise ModelLoadError(f"{file.name} must hold a Linear's state dict: tensors weight, bias")
    weight, bias = state["weight"], state["bias"]
    out = weight.shape[0] if out_features is None else out_features
    if list(weight.shape) != [out, hidden] or list(bias.shape) != [out]:
        raise ModelLoadError(
            f"{file.name} holds weight {list(weight.shape)} and bias {list(bias.shape)}, "
            f"expected [{out}, {hidden}] and [{out}]"
        )
    linear = torch.nn.Linear(hidden, out)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
        linear.bias.copy_(bias.float())
    return linear


def m3_unused_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids FlagEmbedding drops from the lexical weights: CLS, EOS, PAD and UNK, if defined."""
    special = tokenizer.special_tokens_map
    tokens = [str(special[name]) for name in UNUSED_TOKENS if name in special]
    ids = tokenizer.convert_tokens_to_ids(tokens)  # a list for a list
    return frozenset(ids if isinstance(ids, list) else [ids])

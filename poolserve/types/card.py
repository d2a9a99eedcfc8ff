"""`ModelCard`: what a front end knows of the model the engine core serves, without its weights.

The core builds it once after loading and sends it to every front end, pickled: the tokenizer,
the spec, the sentence-transformers settings and the pooling view of the heads, with every
module moved to the meta device (its structure and sizes, no storage), so validation,
scorer plans and /info run on the front end exactly as they would next to the engine.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from poolserve.config.scheduler import SchedulerConfig
from poolserve.engine.loop import Engine
from poolserve.models.spec import LoadedModel, ModelSpec, SentenceTransformersConfig
from poolserve.types.model_info import PoolingModelInfo
from poolserve.types.tasks import PoolingTask


@dataclass(frozen=True)
class ModelCard:
    """A served model as front ends see it."""

    path: Path
    spec: ModelSpec
    tokenizer: PreTrainedTokenizerBase
    sentence_transformers: SentenceTransformersConfig | None
    num_token_types: int  # 0: the model takes no token type ids
    pooling_info: PoolingModelInfo  # head modules on the meta device
    supported_tasks: frozenset[PoolingTask]
    max_model_len: int  # the engine's: the model's, the flag's and the step budget's minimum
    scheduler: SchedulerConfig
    device: str  # where the engine runs: cpu, cuda

    @classmethod
    def of(cls, engine: Engine) -> ModelCard:
        """The card of a built engine."""
        loaded: LoadedModel = engine.loaded
        st = loaded.sentence_transformers
        return cls(
            path=loaded.path,
            spec=loaded.spec,
            tokenizer=loaded.tokenizer,
            sentence_transformers=None if st is None else dataclasses.replace(st, dense=None),
            num_token_types=loaded.model.num_token_types,
            pooling_info=_without_storage(engine.pooling_info),
            supported_tasks=frozenset(engine.supported_tasks),
            max_model_len=engine.max_model_len,
            scheduler=engine.config,
            device=engine.device.type,
        )

    def dumps(self) -> bytes:
        """The card as it travels."""
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def loads(payload: bytes) -> ModelCard:
        """A card the core sent (a trusted peer: the server's own engine core)."""
        card = pickle.loads(payload)
        if not isinstance(card, ModelCard):
            raise TypeError(f"expected a ModelCard, got {type(card).__name__}")
        return card


def _without_storage(info: PoolingModelInfo) -> PoolingModelInfo:
    """The pooling view with every module replaced by its meta-device twin."""
    modules: dict[str, Any] = {
        f.name: _meta(getattr(info, f.name))
        for f in dataclasses.fields(info)
        if isinstance(getattr(info, f.name), torch.nn.Module)
    }
    return dataclasses.replace(info, **modules)


def _meta(module: torch.nn.Module) -> torch.nn.Module:
    """A copy with the same structure and shapes and no weights."""
    # the memo hands deepcopy meta tensors for every weight, so no storage is ever copied
    memo: dict[int, object] = {
        id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for p in module.parameters()
    }
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
    return copy.deepcopy(module, memo)

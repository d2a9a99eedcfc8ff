"""`ModelCard`: what a front end knows of the model the engine core serves, without its weights.

The core builds it once after loading (`poolserve/engine/card.py`) and sends it to every front
end, pickled: the tokenizer, the model's facts, the sentence-transformers settings and pooling's
view of the heads without their modules, so validation, scorer plans and /info run on the front
end exactly as next to the engine, and a front end never imports torch to read it.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from poolserve.types.images import ImageInputs
from poolserve.types.limits import SchedulerConfig
from poolserve.types.lora import LoraModule
from poolserve.types.model import SentenceTransformersConfig
from poolserve.types.model_info import PoolingModelInfo
from poolserve.types.tasks import PoolingTask
from poolserve.types.vision import InlineImages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ModelCard:
    """A served model as front ends see it."""

    path: Path
    architecture: str
    vocab_size: int
    dtype: str  # what the model runs in: float32, bfloat16, float16
    labels: tuple[str, ...]  # a classifier's label names, in logit order
    matryoshka_dimensions: tuple[int, ...] | None
    pair_separator: bool  # a text pair is laid out by the tokenizer's pair template
    tokenizer: PreTrainedTokenizerBase
    sentence_transformers: SentenceTransformersConfig | None  # without its Dense modules
    num_token_types: int  # 0: the model takes no token type ids
    pooling_info: PoolingModelInfo  # the facts, without a module
    supported_tasks: frozenset[PoolingTask]
    max_model_len: int  # the engine's: the model's, the flag's and the step budget's minimum
    scheduler: SchedulerConfig
    device: str  # where the engine runs: cpu, cuda
    family: str = ""  # config.json's model_type (qwen3, gemma, bert)
    # an LLM reranker's classifier_from_token (e.g. ("no", "yes")): with `family` and the name,
    # what tells the front end the prompt recipe of its checkpoint (frontend/score_recipes.py)
    score_tokens: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()  # the LoRA adapters a request may name (jina-v3's tasks)
    # PEFT adapters (--lora-modules): each a name a request's `model` may send
    lora_modules: tuple[LoraModule, ...] = ()
    images: ImageInputs | None = None  # None: the model takes no images
    pad_texts_to: int | None = None  # texts padded with the pad token to this length (SigLIP)
    # a vision-language model's images inside its prompts (Qwen-VL); None: it takes none there
    inline_images: InlineImages | None = None

    @property
    def takes_images(self) -> bool:
        """Whether its inputs may be images: an image tower (dual encoder) or images inside
        its prompts (vision-language)."""
        return self.images is not None or self.inline_images is not None

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

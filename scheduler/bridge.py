"""Hands what pooling needs to know about a loaded model from `models` to `pooling`."""

from __future__ import annotations

import torch

from models.errors import ModelLoadError
from models.registry import ARCHITECTURES, Backbone
from models.spec import HeadKind, LoadedModel
from pooling.model_info import PoolingModelInfo
from pooling.params import PoolingType

# A checkpoint config's classifier pooling name -> the pooling method that reproduces it.
CLASSIFIER_POOLING = {"cls": PoolingType.CLS, "mean": PoolingType.MEAN}


def pooling_info_from(
    loaded: LoadedModel, embed_pooling: PoolingType | None = None
) -> PoolingModelInfo:
    """Build pooling's view of a model from the loader's records (embed_pooling overrides)."""
    spec, heads, st = loaded.spec, loaded.heads, loaded.sentence_transformers
    projection = st.dense if st is not None else None
    return PoolingModelInfo(
        # by backbone, not attention: a bidirectional decoder's heads still read the last token
        is_decoder=ARCHITECTURES[spec.architecture].backbone is Backbone.DECODER,
        hidden_size=spec.hidden_size,
        seq_classifier=heads.seq_classifier,
        token_classifier=heads.token_classifier,
        process_reward_head=heads.process_reward,
        token_reward_head=heads.token_reward,
        num_labels=spec.num_labels if spec.head_kind is not HeadKind.NONE else None,
        labels=spec.labels,
        embed_projection=projection,
        embed_output_size=_output_size(projection, spec.hidden_size),
        st_pooling_mode=st.pooling_mode if st is not None else None,
        supports_matryoshka=spec.supports_matryoshka,
        matryoshka_dimensions=spec.matryoshka_dimensions,
        default_pooling_type=embed_pooling,
        classifier_pooling_type=_classifier_pooling(spec.classifier_pooling),
    )


def _classifier_pooling(name: str | None) -> PoolingType | None:
    """The pooling named by the config; an unknown name is refused rather than guessed."""
    if name is None:
        return None
    if name not in CLASSIFIER_POOLING:
        known = ", ".join(sorted(CLASSIFIER_POOLING))
        raise ModelLoadError(f"classifier_pooling {name!r} is not supported (known: {known})")
    return CLASSIFIER_POOLING[name]


def _output_size(projection: torch.nn.Module | None, hidden_size: int) -> int:
    """Width of the embedding after the optional sentence-transformers Dense projection."""
    if projection is None:
        return hidden_size
    with torch.inference_mode():
        probe = projection(torch.zeros(1, hidden_size))  # [1, out_features]
    return int(probe.shape[-1])

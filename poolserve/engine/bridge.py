"""Hands what pooling needs to know about a loaded model from `models` to `pooling`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from poolserve.models.bge_m3 import m3_unused_ids
from poolserve.models.families.records import ArchitectureEntry
from poolserve.models.registry import ARCHITECTURES
from poolserve.models.spec import LoadedModel
from poolserve.types.errors import ModelLoadError
from poolserve.types.model_info import HEAD_FIELDS, PoolingModelInfo, ScoreActivation
from poolserve.types.tasks import HeadKind, PoolingTask, PoolingType

logger = logging.getLogger(__name__)

# A checkpoint config's classifier pooling name -> the pooling method that reproduces it.
# "late" hands the head every token's state: the head (models/heads.py) averages its logits.
CLASSIFIER_POOLING = {"cls": PoolingType.CLS, "mean": PoolingType.MEAN, "late": PoolingType.ALL}
# sentence-transformers' CrossEncoder activation, by the class name ending its saved torch path.
ST_SCORE_ACTIVATIONS = {
    "Sigmoid": ScoreActivation.SIGMOID,
    "Identity": ScoreActivation.IDENTITY,
    "Tanh": ScoreActivation.TANH,
}


def pooling_info_from(
    loaded: LoadedModel,
    embed_pooling: PoolingType | None = None,
    pooler_task: PoolingTask | None = None,
) -> PoolingModelInfo:
    """Build pooling's view of a model from the loader's records (embed_pooling overrides;
    pooler_task: --pooler-config's task)."""
    spec, st = loaded.spec, loaded.sentence_transformers
    projection = st.dense if st is not None else None
    # the loader's one head module, in the field of its kind
    head: dict[str, Any] = {} if loaded.head is None else {HEAD_FIELDS[spec.head_kind]: loaded.head}
    # a static embedding table is no registry architecture: it pools like an encoder
    entry = ARCHITECTURES.get(spec.architecture)
    if pooler_task is PoolingTask.TOKEN_CLASSIFY and spec.head_kind is HeadKind.SEQUENCE_CLASSIFIER:
        _check_per_token(spec.architecture, entry)
    return PoolingModelInfo(
        # by backbone, not attention: a bidirectional decoder's heads still read the last token
        is_decoder=entry is not None and entry.backbone.is_decoder,
        hidden_size=spec.hidden_size,
        **head,
        sparse_excluded_ids=m3_unused_ids(loaded.tokenizer)
        if spec.head_kind is HeadKind.BGE_M3
        else _sparse_excluded_ids(loaded.tokenizer),
        num_labels=spec.num_labels if spec.head_kind is not HeadKind.NONE else None,
        labels=spec.labels,
        embed_projection=projection,
        embed_output_size=_output_size(projection, spec.hidden_size),
        st_pooling_mode=st.pooling_mode if st is not None else None,
        # a sentence-transformers truncate_dim also marks a model trained for Matryoshka sizes
        supports_matryoshka=spec.supports_matryoshka
        or (st is not None and st.truncate_dim is not None),
        matryoshka_dimensions=spec.matryoshka_dimensions,
        default_pooling_type=embed_pooling,
        pooler_task=pooler_task,
        classifier_pooling_type=_classifier_pooling(spec.classifier_pooling),
        score_activation=_score_activation(loaded.path)
        if spec.head_kind is HeadKind.SEQUENCE_CLASSIFIER
        else ScoreActivation.SIGMOID,
    )


def _check_per_token(architecture: str, entry: ArchitectureEntry | None) -> None:
    """A sequence classifier runs on every token only where vLLM defines how (PerToken)."""
    if entry is None or entry.per_token is None:
        raise ModelLoadError(
            f"--pooler-config: token_classify through {architecture} is not served: vLLM runs "
            "a sequence classifier on every token for decoders and BERT, GTE, ModernBERT and "
            "RoBERTa-family classifiers only"
        )


def _classifier_pooling(name: str | None) -> PoolingType | None:
    """The pooling named by the config; an unknown name is refused rather than guessed."""
    if name is None:
        return None
    if name not in CLASSIFIER_POOLING:
        known = ", ".join(sorted(CLASSIFIER_POOLING))
        raise ModelLoadError(f"classifier_pooling {name!r} is not supported (known: {known})")
    return CLASSIFIER_POOLING[name]


def _sparse_excluded_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The special ids (CLS, SEP, PAD, MASK...) sparse pooling skips; UNK stands for real text."""
    return frozenset(tokenizer.all_special_ids) - {tokenizer.unk_token_id}


def _output_size(projection: torch.nn.Module | None, hidden_size: int) -> int:
    """Width of the embedding after the optional sentence-transformers Dense projection."""
    if projection is None:
        return hidden_size
    with torch.inference_mode():
        probe = projection(torch.zeros(1, hidden_size))  # [1, out_features]
    return int(probe.shape[-1])


def _score_activation(path: Path) -> ScoreActivation:
    """The CrossEncoder activation sentence-transformers would load; sigmoid when none is saved."""
    # sentence-transformers 5+ writes config_sentence_transformers.json (read only beside its
    # modules.json), 4 wrote config.json's `sentence_transformers`, older versions
    # `sbert_ce_default_activation_function`; the first found wins, as in its loader.
    saved_as_st = (path / "modules.json").is_file()
    st_config = _json_object(path / "config_sentence_transformers.json") if saved_as_st else {}
    config = _json_object(path / "config.json")
    nested = config.get("sentence_transformers")
    saved = [
        st_config.get("activation_fn"),
        nested.get("activation_fn") if isinstance(nested, dict) else None,
        config.get("sbert_ce_default_activation_function"),
    ]
    name = next((str(value) for value in saved if value is not None), None)
    if name is None:
        return ScoreActivation.SIGMOID
    if not name.startswith("torch."):
        # sentence-transformers only imports torch classes without trust_remote_code
        logger.warning("ignoring the untrusted CrossEncoder activation %s: sigmoid", name)
        return ScoreActivation.SIGMOID
    activation = ST_SCORE_ACTIVATIONS.get(name.rsplit(".", 1)[-1])
    if activation is None:
        known = ", ".join(sorted(ST_SCORE_ACTIVATIONS))
        raise ModelLoadError(f"CrossEncoder activation {name!r} is not supported (known: {known})")
    return activation


def _json_object(path: Path) -> dict[str, Any]:
    """A JSON object file's content; {} when the file is absent or holds something else."""
    if not path.is_file():
        return {}
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path.name}: {exc}") from exc
    return document if isinstance(document, dict) else {}

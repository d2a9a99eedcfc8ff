"""jina-embeddings-v3: XLM-RoBERTa with rotary positions (post-LN, GELU MLP) and task LoRA.

Two checkpoint forms:
- transformers' native `jina_embeddings_v3` (JinaEmbeddingsV3Model and heads): plain weights,
  no adapters (transformers 5.24 implements none);
- the Hub's remote-code one (jinaai/jina-embeddings-v3: `model_type: "xlm-roberta"`,
  architectures `XLMRobertaLoRA`), whose config.json is read here into a native config
  (`xlm_roberta_lora`) and whose weights carry five task adapters as torch parametrizations
  (models/adapters.py): `lora_adaptations` names them, `lora_alpha / lora_rank` scales them;
  every Linear and the word and token type tables are adapted. No task: no adapter, as the
  remote code's encode() without `task`.
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import PretrainedConfig

from poolserve.models.families.records import (
    ENCODER_HEADS,
    ArchitectureEntry,
    EmbeddingNames,
    EncoderFamily,
    EncoderLayout,
    EncoderNames,
    HeadTransform,
    LayerNames,
    MaskedLMHead,
    Positions,
    encoder_entry,
    family_classes,
)
from poolserve.models.families.roberta import roberta_lm_head
from poolserve.types.errors import ModelLoadError

REMOTE_ARCHITECTURE = "XLMRobertaLoRA"
REMOTE_MODEL_TYPE = "xlm_roberta_lora"

_JINA = EncoderFamily(
    family_classes("JinaEmbeddingsV3", ENCODER_HEADS),
    EncoderLayout.JINA_V3,
    "roberta.",
    HeadTransform("classifier.dense."),
    seq_classifier="classifier.out_proj.",
    positions=Positions.ROTARY,
)
FAMILIES: dict[str, EncoderFamily] = {
    "jina_embeddings_v3": _JINA,
    # the remote code's class is not a transformers class: ARCHITECTURES below holds it
    REMOTE_MODEL_TYPE: EncoderFamily(
        (), EncoderLayout.JINA_V3, "roberta.", None, positions=Positions.ROTARY
    ),
}

ARCHITECTURES: dict[str, ArchitectureEntry] = {
    REMOTE_ARCHITECTURE: encoder_entry(FAMILIES[REMOTE_MODEL_TYPE], REMOTE_ARCHITECTURE),
}

LAYOUTS: dict[EncoderLayout, EncoderNames] = {
    # The Hub's names, which transformers also writes back (its conversion mapping renames them
    # and splits Wqkv on load); the remote code's parametrized weights are renamed plain first.
    EncoderLayout.JINA_V3: (
        EmbeddingNames(norm="emb_ln"),
        LayerNames(
            "encoder.layers.{i}.",
            ("mixer.Wqkv",),
            "mixer.out_proj",
            "norm1",
            ("mlp.fc1",),
            "mlp.fc2",
            "norm2",
        ),
    ),
}

MASKED_LM: dict[str, tuple[MaskedLMHead, ...]] = {
    "jina_embeddings_v3": (roberta_lm_head("roberta."),),
    REMOTE_MODEL_TYPE: (roberta_lm_head("roberta."),),
}


@functools.cache
def _remote_config() -> type[PretrainedConfig]:
    """The native config class a remote-code config.json is read into (transformers' own
    JinaEmbeddingsV3Config, which transformers has from 5.x on; imported here, so an older
    transformers still serves every other family)."""
    try:
        from transformers import JinaEmbeddingsV3Config
    except ImportError as exc:
        raise ModelLoadError(
            "jina-embeddings-v3 needs a transformers with JinaEmbeddingsV3"
        ) from exc

    class XLMRobertaLoRAConfig(JinaEmbeddingsV3Config):
        model_type = REMOTE_MODEL_TYPE

    return XLMRobertaLoRAConfig


# Remote-code switches the native forward does not implement, with the values it accepts.
_ACCEPTED: dict[str, tuple[Any, ...]] = {
    "position_embedding_type": ("rotary",),
    "rotary_emb_interleaved": (False, None),
    "rotary_emb_scale_base": (None,),
}
# Remote-code fields read into native ones or that change nothing in a forward.
_DROPPED = (
    "auto_map",
    "architectures",
    "model_type",
    "rotary_emb_base",
    "position_embedding_type",
    "rotary_emb_interleaved",
    "rotary_emb_scale_base",
    "use_flash_attn",
    "use_cache",
    "emb_pooler",
    "load_trained_adapters",
    "lora_main_params_trainable",
    "lora_dropout_p",  # dropout: training only
    "torch_dtype",
    "dtype",
    "transformers_version",
)
_REMOTE_ROPE_THETA = 10_000.0  # XLMRobertaFlashConfig's rotary_emb_base default


def read_remote_config(raw: dict[str, Any]) -> PretrainedConfig:
    """A remote-code jina-embeddings-v3 config.json as a native config; refuses what the native
    forward lacks. The adapter fields (lora_adaptations, lora_rank, lora_alpha,
    task_instructions, matryoshka_dimensions) stay on it."""
    unsupported = [
        f"{name}={raw[name]!r}"
        for name, accepted in _ACCEPTED.items()
        if name in raw and raw[name] not in accepted
    ]
    if unsupported:
        raise ModelLoadError(
            "this jina-embeddings-v3 config needs remote code for: " + ", ".join(unsupported)
        )
    fields = {k: v for k, v in raw.items() if k not in _DROPPED}
    theta = float(raw.get("rotary_emb_base") or _REMOTE_ROPE_THETA)
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    config = _remote_config()(**fields)
    config.architectures = [REMOTE_ARCHITECTURE]
    return config


# config.json readers keyed by the architecture they are written for (the remote model_type,
# "xlm-roberta", is plain XLM-R's too)
CONFIGS = {REMOTE_ARCHITECTURE: read_remote_config}

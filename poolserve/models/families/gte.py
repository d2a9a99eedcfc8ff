"""GTE (Alibaba's "NewModel"): rotary, post-LN, GLU MLP; its Hub config read natively.

Hub checkpoints (gte-multilingual-base, gte-*-en-v1.5, arctic-embed-m-v2.0) carry
`model_type: "new"` and remote code; their config.json is read into a native GteConfig here.
Their tensors have the names transformers' `gte` saves, under `new.` instead of `gte.`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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
    PerToken,
    Positions,
    encoder_entry,
    family_classes,
)
from poolserve.types.errors import ModelLoadError

FAMILIES: dict[str, EncoderFamily] = {
    "gte": EncoderFamily(
        family_classes("Gte", ENCODER_HEADS),
        EncoderLayout.GTE,
        "gte.",
        HeadTransform("gte.pooler.dense."),
        positions=Positions.ROTARY,
        gated_mlp=True,
        per_token=PerToken.CLASSIFIER,  # vLLM's GteNewForSequenceClassification
    ),
    # The remote code's classes are not transformers classes: ARCHITECTURES below holds them.
    "new": EncoderFamily(
        (),
        EncoderLayout.GTE,
        "new.",
        HeadTransform("new.pooler.dense."),
        positions=Positions.ROTARY,
        gated_mlp=True,
        per_token=PerToken.CLASSIFIER,  # vLLM's GteNewForSequenceClassification
    ),
}

ARCHITECTURES: dict[str, ArchitectureEntry] = {
    name: encoder_entry(FAMILIES["new"], name) for name in family_classes("New", ENCODER_HEADS)
}

LAYOUTS: dict[EncoderLayout, EncoderNames] = {
    # The Hub layout, which transformers also writes back (its conversion mapping splits qkv_proj
    # and up_gate_proj on load): fused q, k, v, and up then gate in one Linear.
    EncoderLayout.GTE: (
        EmbeddingNames(),
        LayerNames(
            "encoder.layer.{i}.",
            ("attention.qkv_proj",),
            "attention.o_proj",
            "attn_ln",
            ("mlp.up_gate_proj",),
            "mlp.down_proj",
            "mlp_ln",
            gate_second=True,
        ),
    ),
}

MASKED_LM: dict[str, tuple[MaskedLMHead, ...]] = {
    # transformers' GteLMHead applies gelu whatever hidden_act says; the remote code hidden_act.
    "gte": (
        MaskedLMHead(
            HeadTransform("lm_head.dense.", activation="gelu", norm_prefix="lm_head.norm."),
            "lm_head.decoder.",
            "gte.embeddings.word_embeddings.weight",
        ),
    ),
    "new": (
        MaskedLMHead(
            HeadTransform(
                "lm_head.dense.", activation_key="hidden_act", norm_prefix="lm_head.norm."
            ),
            "lm_head.decoder.",
            "new.embeddings.word_embeddings.weight",
        ),
    ),
}


@functools.cache
def _new_config() -> type[PretrainedConfig]:
    """The config class of a Hub GTE config.json written for remote code (model_type "new"),
    read natively: transformers' GteConfig, which transformers has from 5.18 on (imported here,
    so an older transformers still serves every other family)."""
    try:
        from transformers import GteConfig
    except ImportError as exc:
        raise ModelLoadError("GTE models need transformers 5.18 or later") from exc

    class NewConfig(GteConfig):
        model_type = "new"

    return NewConfig


# Remote-code switches the native forward does not implement, with the values it accepts.
_ACCEPTED: dict[str, tuple[Any, ...]] = {
    "position_embedding_type": ("rope",),
    "layer_norm_type": ("layer_norm",),
    "logn_attention_scale": (False,),
    "pack_qkv": (True,),
}
# Remote-code fields that change nothing in a forward (kernels, padding, remote classes).
_IGNORED = (
    "auto_map",
    "unpad_inputs",
    "use_memory_efficient_attention",
    "logn_attention_clip1",
    "rope_theta",
    "rope_scaling",
)
# The remote code's config defaults where GteConfig's differ.
_REMOTE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 30528,
    "max_position_embeddings": 2048,
    "pad_token_id": None,
}
_REMOTE_ROPE_THETA = 10_000.0


def _rope_parameters(raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The remote code's rope as transformers' rope parameters; refused where it has no twin.

    The remote NTK rope (no `mixed_b`) builds its table once at max_position_embeddings x
    factor: inv_freq = (theta x factor) ** (-2i / d) / factor ** (2 / d), which is transformers'
    `linear` rope of theta x factor and factor ** (2 / d), computed in the same order.
    """
    theta = float(raw.get("rope_theta", _REMOTE_ROPE_THETA))
    scaling = raw.get("rope_scaling")
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind != "ntk" or scaling.get("mixed_b") is not None:
        raise ModelLoadError(f"this GTE config needs remote code for: rope_scaling={scaling!r}")
    factor = float(scaling["factor"])
    if factor <= 1.0:  # the table then never grows past max_position_embeddings: plain rope
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "linear", "rope_theta": theta * factor, "factor": factor ** (2 / head_dim)}


def remote_gte_config(raw: dict[str, Any]) -> PretrainedConfig:
    """The native config of a Hub GTE config.json; refuses switches the forward lacks, by name."""
    unsupported = [
        f"{name}={raw[name]!r}"
        for name, accepted in _ACCEPTED.items()
        if name in raw and raw[name] not in accepted
    ]
    if unsupported:
        raise ModelLoadError("this GTE config needs remote code for: " + ", ".join(unsupported))
    dropped = (*_ACCEPTED, *_IGNORED, "model_type")
    fields = {k: v for k, v in raw.items() if k not in dropped}
    config = _new_config()(**{**_REMOTE_DEFAULTS, **fields})
    head_dim = int(config.hidden_size) // int(config.num_attention_heads)
    config.rope_parameters = _rope_parameters(raw, head_dim)
    return config


CONFIGS: dict[str, Callable[[dict[str, Any]], PretrainedConfig]] = {"new": remote_gte_config}

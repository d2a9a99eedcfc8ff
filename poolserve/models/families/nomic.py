"""NomicBERT: rotary, SwiGLU, the Hub's tensor names, and its remote-code config fields."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from poolserve.models.families.bert import bert_predictions
from poolserve.models.families.records import (
    ENCODER_HEADS,
    EmbeddingNames,
    EncoderFamily,
    EncoderLayout,
    EncoderNames,
    HeadTransform,
    LayerNames,
    MaskedLMHead,
    Positions,
    family_classes,
)
from poolserve.types.errors import ModelLoadError

FAMILIES: dict[str, EncoderFamily] = {
    "nomic_bert": EncoderFamily(
        family_classes("NomicBert", ENCODER_HEADS),
        EncoderLayout.NOMIC,
        "nomic_bert.",
        HeadTransform("nomic_bert.pooler.dense."),
        positions=Positions.ROTARY,
        gated_mlp=True,
    ),
}

LAYOUTS: dict[EncoderLayout, EncoderNames] = {
    # The Hub layout, which transformers also writes back: act(fc12) * fc11.
    EncoderLayout.NOMIC: (
        EmbeddingNames(norm="emb_ln"),
        LayerNames(
            "encoder.layers.{i}.",
            ("attn.Wqkv",),
            "attn.out_proj",
            "norm1",
            ("mlp.fc12", "mlp.fc11"),
            "mlp.fc2",
            "norm2",
        ),
    ),
}

MASKED_LM: dict[str, tuple[MaskedLMHead, ...]] = {
    "nomic_bert": (bert_predictions("nomic_bert.", norm="layer_norm"),),
}

# Hub NomicBERT configs are written for remote code: their field -> the native config's field.
_RENAMES = {
    "n_embd": "hidden_size",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
    "n_inner": "intermediate_size",
    "n_positions": "max_position_embeddings",
    "layer_norm_epsilon": "layer_norm_eps",
}
# Remote-code switches the native forward does not implement, with the values it accepts.
_ACCEPTED: dict[str, tuple[Any, ...]] = {
    "rotary_emb_fraction": (1.0,),
    "rotary_emb_interleaved": (False,),
    "rotary_scaling_factor": (None,),
    "prenorm": (False,),
    "parallel_block": (False,),
    "use_rms_norm": (False,),
    "causal": (False,),
    "moe_every_n_layers": (0, None),
}
# Remote-code gated activations -> the activation of their gate.
_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu"}


def adopt_remote_nomic_fields(config: PretrainedConfig) -> None:
    """Maps a Hub NomicBERT config's remote-code fields onto the native ones, in place.

    The spec is read from the same config afterwards, so the mapping has to land on it.
    Refuses switches the native forward lacks, naming each.
    """
    if not hasattr(config, "n_embd"):
        return
    unsupported = [
        f"{name}={getattr(config, name)!r}"
        for name, accepted in _ACCEPTED.items()
        if getattr(config, name, accepted[0]) not in accepted
    ]
    act = str(getattr(config, "activation_function", "swiglu"))
    if act not in _ACTIVATIONS:
        unsupported.append(f"activation_function={act!r}")
    if unsupported:
        raise ModelLoadError(
            "this NomicBERT config needs remote code for: " + ", ".join(unsupported)
        )
    for remote, native in _RENAMES.items():
        if hasattr(config, remote):
            setattr(config, native, getattr(config, remote))
    config.hidden_act = _ACTIVATIONS[act]
    config.head_dim = config.hidden_size // config.num_attention_heads
    base = float(getattr(config, "rotary_emb_base", 10_000.0))
    config.rope_parameters = {"rope_type": "default", "rope_theta": base}

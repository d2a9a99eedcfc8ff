"""One packed decoder forward for every decoder family, with per-family switches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from poolserve.models.adapters import AdapterSegments, LoraEmbedding, LoraLinear, LoraSite
from poolserve.models.attention import AttentionBackend, AttentionMetadata
from poolserve.models.decoder_config import (
    DecoderGeometry,
    decoder_geometry,
    embed_scale,
    layer_rope_types,
    layer_windows,
)
from poolserve.models.families.records import DecoderFamily
from poolserve.models.kv_cache import PagedKVCache
from poolserve.models.layers import (
    Weight,
    activation,
    gated,
    linear,
    norm_weight,
    rms_norm,
    to_device,
)
from poolserve.models.packed import PackedModel
from poolserve.models.rope import Rotary, apply_rotary
from poolserve.models.weights import take

# Our norm slots -> checkpoint names. Llama-style layers norm only each block's input; Gemma2/3
# also norm the attention and MLP outputs, and call the MLP's input norm pre_feedforward.
_NORM_NAMES: dict[bool, dict[str, str]] = {
    False: {"input_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    True: {
        "input_norm": "input_layernorm",
        "attn_out_norm": "post_attention_layernorm",
        "mlp_norm": "pre_feedforward_layernorm",
        "mlp_out_norm": "post_feedforward_layernorm",
    },
}


@dataclass(frozen=True)
class VisionRows:
    """A vision-language step's image tokens: the vision tower's rows put in place of their
    placeholders after the embedding, and Qwen3-VL's deepstack rows added to those tokens after
    each of the first layers."""

    index: torch.Tensor  # [num_image_tokens] int64: the placeholders' places in the step
    embeds: torch.Tensor  # [num_image_tokens, hidden]
    deepstack: tuple[torch.Tensor, ...] = ()  # per layer from the first: [num_image_tokens, hidden]


@dataclass(frozen=True)
class AttentionStep:
    """What every layer's attention needs in one forward."""

    backend: AttentionBackend
    meta: AttentionMetadata
    kv_cache: PagedKVCache | None
    adapters: AdapterSegments | None = None  # each token's LoRA adapter (None: none runs)


# Our projection slots -> the checkpoint's module, fused (Phi-3) or its parts (the others).
_PROJECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv": ("self_attn.qkv_proj", tuple(f"self_attn.{n}_proj" for n in ("q", "k", "v"))),
    "o": ("self_attn.o_proj", ("self_attn.o_proj",)),
    "gate_up": ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    "down": ("mlp.down_proj", ("mlp.down_proj",)),
}


def _layer_sites(index: int, state: dict[str, torch.Tensor]) -> dict[str, LoraSite]:
    """Where each stored projection of layer `index` lands among the forward's fused slots."""
    sites = {}
    for slot, (fused, parts) in _PROJECTIONS.items():
        stored = (fused,) if f"{fused}.weight" in state else parts
        weights = [take(state, f"{name}.weight") for name in stored]
        sizes = tuple(int(w.shape[0]) for w in weights)
        for k, name in enumerate(stored):
            sites[f"layers.{index}.{name}"] = LoraSite(
                index, slot, k, sizes, int(weights[k].shape[1])
            )
    return sites


def _projection(
    state: dict[str, torch.Tensor], fused: str, parts: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and optional bias of a projection Phi-3 stores fused and the others split."""
    if f"{fused}.weight" in state:
        return state[f"{fused}.weight"], state.get(f"{fused}.bias")
    weight = torch.cat([take(state, f"{part}.weight") for part in parts])
    if f"{parts[0]}.bias" not in state:
        return weight, None
    return weight, torch.cat([take(state, f"{part}.bias") for part in parts])


def _layer_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """One layer's projection weights under our names, fused where the checkpoint splits them."""
    qkv, qkv_bias = _projection(state, *_PROJECTIONS["qkv"])
    gate_up, gate_up_bias = _projection(state, *_PROJECTIONS["gate_up"])
    return {
        "qkv_weight": qkv,
        "qkv_bias": qkv_bias,
        "o_weight": take(state, "self_attn.o_proj.weight"),
        "o_bias": state.get("self_attn.o_proj.bias"),
        "gate_up_weight": gate_up,
        "gate_up_bias": gate_up_bias,
        "down_weight": take(state, "mlp.down_proj.weight"),
        "down_bias": state.get("mlp.down_proj.bias"),
    }


def _norm_weights(
    state: dict[str, torch.Tensor],
    family: DecoderFamily,
    placement: tuple[torch.device, torch.dtype],
) -> dict[str, torch.Tensor | None]:
    """One layer's norm weights under our slot names, placed for rms_norm()."""
    names = dict(_NORM_NAMES[family.sandwich_norms])
    if family.qk_norm:
        names.update(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
    norms: dict[str, torch.Tensor | None] = dict.fromkeys(
        ("attn_out_norm", "mlp_out_norm", "q_norm", "k_norm")
    )
    for slot, name in names.items():
        norms[slot] = norm_weight(take(state, f"{name}.weight"), family.norm_offset, placement)
    return norms


class DecoderLayer(torch.nn.Module):
    """Pre-norm attention + gated MLP (fused qkv, gate/up); Gemma2/3 add sandwich norms."""

    qkv_weight: Weight
    qkv_bias: torch.Tensor | None
    o_weight: Weight
    o_bias: torch.Tensor | None
    gate_up_weight: Weight
    gate_up_bias: torch.Tensor | None
    down_weight: Weight
    down_bias: torch.Tensor | None
    input_norm: torch.Tensor
    attn_out_norm: torch.Tensor | None
    mlp_norm: torch.Tensor
    mlp_out_norm: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None

    def __init__(
        self,
        state: dict[str, torch.Tensor],
        family: DecoderFamily,
        geometry: DecoderGeometry,
        act: Callable[[torch.Tensor], torch.Tensor],
        placement: tuple[torch.device, torch.dtype],
        position: tuple[int, int | None, int],
    ) -> None:
        super().__init__()
        self.geometry = geometry
        self.act = act
        # stacked LoRA adapters by projection slot ("qkv", "o", "gate_up", "down"), when served
        self.lora = torch.nn.ModuleDict()
        # layer index, sliding window (None: full attention), index of the rope it uses
        self.index, self.window, self.rope_index = position
        for name, tensor in _layer_weights(state).items():
            self.register_buffer(name, to_device(tensor, *placement))
        for name, tensor in _norm_weights(state, family, placement).items():
            self.register_buffer(name, tensor)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden] residual stream, updated in place
        ropes: list[tuple[torch.Tensor, torch.Tensor]],  # cos, sin [num_tokens, 1, rotary_dim]
        step: AttentionStep,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """One layer over the packed stream, with its own rope (Gemma3: local or global)."""
        g = self.geometry
        h = rms_norm(x, self.input_norm, g.eps)  # [num_tokens, hidden]
        h = self._attention(h, ropes[self.rope_index], step)  # [num_tokens, hidden]
        if self.attn_out_norm is not None:
            h = rms_norm(h, self.attn_out_norm, g.eps)
        x.add_(h, alpha=g.residual_multiplier)
        h = rms_norm(x, self.mlp_norm, g.eps)  # [num_tokens, hidden]
        gate_up = self._linear("gate_up", h, step)  # [num_tokens, 2 * inter]
        gate, up = gate_up.chunk(2, dim=-1)  # [num_tokens, inter] each
        h = self._linear("down", gated(self.act, gate, up), step)
        if self.mlp_out_norm is not None:
            h = rms_norm(h, self.mlp_out_norm, g.eps)
        x.add_(h, alpha=g.residual_multiplier)
        return x

    def _attention(
        self,
        h: torch.Tensor,  # [num_tokens, hidden] normed input
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [num_tokens, 1, rotary_dim]
        step: AttentionStep,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Self-attention of the packed stream, output projection included."""
        g = self.geometry
        num_tokens = h.shape[0]
        qkv = self._linear("qkv", h, step)  # [num_tokens, (H + 2 KV) * D]
        q_size, kv_size = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, g.num_heads, g.head_dim)  # [num_tokens, H, D]
        k = k.view(num_tokens, g.num_kv_heads, g.head_dim)  # [num_tokens, KV, D]
        v = v.view(num_tokens, g.num_kv_heads, g.head_dim)  # [num_tokens, KV, D]
        if self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, g.eps)
            k = rms_norm(k, self.k_norm, g.eps)
        attended = step.backend.attend(
            apply_rotary(q, *rope),
            apply_rotary(k, *rope),
            v,
            layer=self.index,
            meta=step.meta,
            kv_cache=step.kv_cache,
            sliding_window=self.window,
            scale=g.scale,
            softcap=g.softcap,
        )  # [num_tokens, H, D]
        return self._linear("o", attended.reshape(num_tokens, q_size), step)

    def _linear(self, slot: str, x: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        """The slot's projection of x, plus each token's LoRA adapter where it has one."""
        y = linear(x, getattr(self, f"{slot}_weight"), getattr(self, f"{slot}_bias"))
        if step.adapters is None or slot not in self.lora:
            return y
        return cast(LoraLinear, self.lora[slot]).add_to(y, x, step.adapters)


def _layer_state(state: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """The tensors of layer `index`, its prefix removed."""
    prefix = f"layers.{index}."
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}


class DecoderModel(PackedModel):
    """Decoder over packed tokens (every family in the registry); returns final-normed states."""

    embed_tokens: torch.Tensor
    norm: torch.Tensor

    def __init__(
        self,
        config: PretrainedConfig,
        state: dict[str, torch.Tensor],
        family: DecoderFamily,
        backend: AttentionBackend,
        placement: tuple[torch.device, torch.dtype],
    ) -> None:
        super().__init__()
        geometry = decoder_geometry(config, family)
        act = activation(getattr(config, family.activation_key))
        self.vocab_size = int(config.vocab_size)
        self.backend = backend
        self.word_lora: LoraEmbedding | None = None  # PEFT adapters' room, when served
        self.eps = geometry.eps
        self.embed_scale = embed_scale(config, family, placement[1])
        rope_types = layer_rope_types(config, family)
        distinct = list(dict.fromkeys(rope_types))  # one Rotary per distinct rope, in layer order
        self.rotary = torch.nn.ModuleList(
            Rotary(config, geometry.head_dim, kind) for kind in distinct
        ).to(placement[0])
        self.register_buffer(
            "embed_tokens", to_device(take(state, "embed_tokens.weight"), *placement)
        )
        self.register_buffer(
            "norm", norm_weight(take(state, "norm.weight"), family.norm_offset, placement)
        )
        windows = layer_windows(config)
        self._sites: dict[str, LoraSite] = {}
        for i in range(config.num_hidden_layers):
            self._sites.update(_layer_sites(i, _layer_state(state, i)))
        self.layers = torch.nn.ModuleList(
            DecoderLayer(
                _layer_state(state, i),
                family,
                geometry,
                act,
                placement,
                (i, windows[i], distinct.index(rope_types[i])),
            )
            for i in range(config.num_hidden_layers)
        )

    def lora_sites(self) -> dict[str, LoraSite]:
        """Each stored projection of each layer, by its name in the checkpoint."""
        return self._sites

    def word_table(self) -> tuple[str, torch.Tensor] | None:
        """The token embedding table, by its checkpoint name."""
        return "embed_tokens", self.embed_tokens

    def set_word_lora(self, lora: torch.nn.Module) -> None:
        """The token table's stacked adapters (PEFT adapters' room: models/peft.py)."""
        self.word_lora = cast(LoraEmbedding, lora)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64; M-RoPE: [3, num_tokens]
        attn: AttentionMetadata,
        kv_cache: PagedKVCache | None,
        out: torch.Tensor | None = None,  # [>= num_tokens, hidden]
        token_type_ids: torch.Tensor | None = None,  # [num_tokens]; ignored: no type table
        adapters: AdapterSegments | None = None,  # each token's LoRA adapter (None: none runs)
        vision: VisionRows | None = None,  # a vision-language step's image tokens
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Embeds (images' rows in place of their placeholders), runs every layer with
        chunk-aware attention, applies the final norm."""
        self.check_inputs(input_ids)
        if adapters is not None and not self.adapter_names:
            raise ValueError("this model has no adapters")
        x = F.embedding(input_ids, self.embed_tokens)  # [num_tokens, hidden]
        if adapters is not None and self.word_lora is not None:
            # before Gemma's scale, as PEFT's LoRA adds inside the embedding layer
            x = self.word_lora.add_to(x, input_ids, adapters)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if vision is not None:
            x[vision.index] = vision.embeds.to(x.dtype)
        ropes = [cast(Rotary, rotary).cos_sin(positions, x.dtype) for rotary in self.rotary]
        step = AttentionStep(self.backend, attn, kv_cache, adapters)
        deepstack = () if vision is None else vision.deepstack
        for i, layer in enumerate(self.layers):
            x = layer(x, ropes, step)
            if i < len(deepstack):
                assert vision is not None
                x.index_add_(0, vision.index, deepstack[i].to(x.dtype))
        return self.deliver(rms_norm(x, self.norm, self.eps), out)

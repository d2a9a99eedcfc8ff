"""One packed encoder forward for every encoder family, with per-family switches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from transformers import PretrainedConfig

from poolserve.models.adapters import (
    AdapterSegments,
    LoraEmbedding,
    LoraLinear,
    LoraSite,
    adapter_names,
    take_lora_linear,
)
from poolserve.models.attention import AttentionBackend, AttentionMetadata
from poolserve.models.encoder_config import (
    EncoderGeometry,
    encoder_geometry,
    layer_rope_types,
    layer_windows,
)
from poolserve.models.encoder_embeddings import EncoderEmbeddings, layer_norm
from poolserve.models.encoder_relative import (
    BucketScores,
    DisentangledScores,
    LayerBiases,
    RelativeScores,
)
from poolserve.models.encoder_weights import layer_state, layer_tensors
from poolserve.models.families.records import EncoderFamily, LayerNames, Positions, Relative
from poolserve.models.kv_cache import PagedKVCache
from poolserve.models.layers import Weight, activation, gated, linear, linear_act, to_device
from poolserve.models.packed import PackedModel
from poolserve.models.registry import ENCODER_LAYOUTS
from poolserve.models.rope import Rotary, apply_rotary
from poolserve.types.errors import ModelLoadError


@dataclass(frozen=True)
class EncoderStep:
    """What every layer needs in one forward."""

    backend: AttentionBackend
    meta: AttentionMetadata
    ropes: list[tuple[torch.Tensor, torch.Tensor]]  # cos, sin [num_tokens, 1, head_dim] per rope
    biases: LayerBiases | None
    adapters: AdapterSegments | None = None  # each token's LoRA adapter (None: none runs)


class EncoderLayer(torch.nn.Module):
    """Self-attention + MLP, each with a residual; LayerNorm after each (post-LN) or before."""

    qkv_weight: Weight
    qkv_bias: torch.Tensor | None
    o_weight: Weight
    o_bias: torch.Tensor | None
    attn_norm_weight: torch.Tensor | None
    attn_norm_bias: torch.Tensor | None
    up_weight: Weight
    up_bias: torch.Tensor | None
    down_weight: Weight
    down_bias: torch.Tensor | None
    mlp_norm_weight: torch.Tensor
    mlp_norm_bias: torch.Tensor | None

    def __init__(
        self,
        tensors: dict[str, torch.Tensor | None],
        family: EncoderFamily,
        geometry: EncoderGeometry,
        act: Callable[[torch.Tensor], torch.Tensor],
        placement: tuple[torch.device, torch.dtype],
        position: tuple[int, int | None, int | None],
        lora: dict[str, LoraLinear] | None = None,
    ) -> None:
        super().__init__()
        self.geometry = geometry
        # stacked LoRA adapters by projection slot ("qkv", "o", "up", "down"), where stored
        self.lora = torch.nn.ModuleDict(lora or {})
        self.act = act
        self.pre_norm = family.pre_norm
        self.gated = family.gated_mlp
        # layer index, window (None: global attention), index of its rope (None: no rotary)
        self.index, self.window, self.rope_index = position
        for name, tensor in tensors.items():
            self.register_buffer(name, to_device(tensor, *placement))

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        step: EncoderStep,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """One layer over the packed stream."""
        eps = self.geometry.eps
        # each residual sum is written over the branch's output, the layer's own new tensor:
        # no step-sized tensor more (x + h and h + x are the same sum bit for bit)
        if self.pre_norm:
            h = layer_norm(x, self.attn_norm_weight, self.attn_norm_bias, eps)
            x = self._attention(h, step).add_(x)
            h = layer_norm(x, self.mlp_norm_weight, self.mlp_norm_bias, eps)
            return self._mlp(h, step).add_(x)
        x = layer_norm(
            self._attention(x, step).add_(x), self.attn_norm_weight, self.attn_norm_bias, eps
        )
        return layer_norm(self._mlp(x, step).add_(x), self.mlp_norm_weight, self.mlp_norm_bias, eps)

    def _attention(
        self,
        h: torch.Tensor,  # [num_tokens, hidden]
        step: EncoderStep,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Bidirectional self-attention, output projection included."""
        g = self.geometry
        num_tokens = h.shape[0]
        qkv = self._linear("qkv", h, step)  # [num_tokens, 3 * H * D]
        q, k, v = qkv.view(num_tokens, 3, g.num_heads, g.head_dim).unbind(1)  # [num_tokens, H, D]
        if self.rope_index is not None:
            q = apply_rotary(q, *step.ropes[self.rope_index])
            k = apply_rotary(k, *step.ropes[self.rope_index])
        bias = None if step.biases is None else step.biases.for_layer(self.index, q, k)
        attended = step.backend.attend(
            q,
            k,
            v,
            layer=self.index,
            meta=step.meta,
            kv_cache=None,
            sliding_window=self.window,
            scale=g.scale,
            bias=bias,
        )  # [num_tokens, H, D]
        return self._linear("o", attended.reshape(num_tokens, -1), step)

    def _mlp(self, h: torch.Tensor, step: EncoderStep) -> torch.Tensor:  # [num_tokens, hidden]
        """act(up) or, gated, act(first half) * second half; then down."""
        if self.gated:
            up = self._linear("up", h, step)  # [num_tokens, 2 x intermediate]
            gate, value = up.chunk(2, dim=-1)  # [num_tokens, intermediate] each
            up = gated(self.act, gate, value)
        elif step.adapters is not None and "up" in self.lora:
            up = self.act(self._linear("up", h, step))  # [num_tokens, inter]
        else:
            up = linear_act(h, self.up_weight, self.up_bias, self.act)  # [num_tokens, inter]
        return self._linear("down", up, step)

    def _linear(self, slot: str, x: torch.Tensor, step: EncoderStep) -> torch.Tensor:
        """The slot's projection of x, plus each token's LoRA adapter where it has one."""
        y = linear(x, getattr(self, f"{slot}_weight"), getattr(self, f"{slot}_bias"))
        if step.adapters is None or slot not in self.lora:
            return y
        return cast(LoraLinear, self.lora[slot]).add_to(y, x, step.adapters)


def _has_lora(model: torch.nn.Module) -> bool:
    """Whether any projection or table of the model carries stacked LoRA adapters."""
    return any(isinstance(m, LoraLinear | LoraEmbedding) for m in model.modules())


def _relative_scores(
    config: PretrainedConfig,
    state: dict[str, torch.Tensor],
    family: EncoderFamily,
    geometry: EncoderGeometry,
    placement: tuple[torch.device, torch.dtype],
) -> RelativeScores | None:
    """MPNet's bucket bias, DeBERTa's disentangled terms (when relative_attention), or None."""
    if family.relative is Relative.BUCKETS:
        return BucketScores(state, placement)
    if family.relative is Relative.DISENTANGLED and getattr(config, "relative_attention", False):
        shape = (int(config.num_hidden_layers), geometry.num_heads, geometry.head_dim)
        return DisentangledScores(config, state, shape, geometry.scale, placement)
    return None


def _refuse_unsupported(config: PretrainedConfig) -> None:
    """Config switches the forward does not implement."""
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError("only absolute position embeddings are supported for BERT encoders")
    if int(getattr(config, "conv_kernel_size", 0) or 0) > 0:
        raise ModelLoadError("DeBERTa-v2's convolution layer (conv_kernel_size) is not supported")


def _layers(
    config: PretrainedConfig,
    state: dict[str, torch.Tensor],
    family: EncoderFamily,
    geometry: EncoderGeometry,
    placement: tuple[torch.device, torch.dtype],
    rope_index: list[int | None],
    sites: dict[str, LoraSite],
) -> torch.nn.ModuleList:
    """Every layer, with its window and rope; each projection's LoRA site added to `sites`."""
    names: LayerNames = ENCODER_LAYOUTS[family.layout][1]
    windows = layer_windows(config)
    act = activation(getattr(config, family.activation_key))
    layers = []
    for i in range(config.num_hidden_layers):
        tensors = layer_state(state, names, i)
        sites.update(_layer_sites(i, names, tensors))
        layers.append(
            EncoderLayer(
                layer_tensors(tensors, names, family.pre_norm),
                family,
                geometry,
                act,
                placement,
                (i, windows[i], rope_index[i]),
                _layer_lora(config, tensors, names, placement),
            )
        )
    return torch.nn.ModuleList(layers)


def _layer_sites(
    index: int, names: LayerNames, tensors: dict[str, torch.Tensor]
) -> dict[str, LoraSite]:
    """Where each stored projection of layer `index` lands among the forward's fused slots."""
    prefix = names.prefix.format(i=index)
    slots = {"qkv": names.qkv, "o": (names.o,), "up": names.up, "down": (names.down,)}
    sites = {}
    for slot, parts in slots.items():
        weights = [tensors[f"{part}.weight"] for part in parts]
        sizes = tuple(int(w.shape[0]) for w in weights)
        for k, part in enumerate(parts):
            swap = names.gate_second and slot == "up"
            sites[prefix + part] = LoraSite(index, slot, k, sizes, int(weights[k].shape[1]), swap)
    return sites


def _layer_lora(
    config: PretrainedConfig,
    tensors: dict[str, torch.Tensor],
    names: LayerNames,
    placement: tuple[torch.device, torch.dtype],
) -> dict[str, LoraLinear]:
    """The stacked LoRA adapters stored beside a layer's unfused projections, by slot."""
    stored = {"qkv": names.qkv, "o": (names.o,), "up": names.up, "down": (names.down,)}
    found = {}
    for slot, projections in stored.items():
        if len(projections) != 1:  # split projections: no known checkpoint stores LoRA there
            continue
        lora = take_lora_linear(tensors, projections[0], config, placement)
        if lora is not None:
            found[slot] = lora
    return found


class EncoderModel(PackedModel):
    """Encoder over packed tokens (every family in ENCODER_FAMILIES); returns the last states."""

    final_norm_weight: torch.Tensor | None
    final_norm_bias: torch.Tensor | None

    def __init__(
        self,
        config: PretrainedConfig,
        state: dict[str, torch.Tensor],
        family: EncoderFamily,
        backend: AttentionBackend,
        placement: tuple[torch.device, torch.dtype],
    ) -> None:
        super().__init__()
        _refuse_unsupported(config)
        geometry = encoder_geometry(config, family)
        self.vocab_size = int(config.vocab_size)
        self.eps = geometry.eps
        self.backend = backend
        self.embeddings = EncoderEmbeddings(config, state, family, geometry.eps, placement)
        num_types = self.embeddings.token_type
        self.num_token_types = 0 if num_types is None else int(num_types.shape[0])
        self.relative = _relative_scores(config, state, family, geometry, placement)
        # ModernBERT's norm after the last layer
        final = ENCODER_LAYOUTS[family.layout][0].final_norm
        for slot, suffix in (("final_norm_weight", "weight"), ("final_norm_bias", "bias")):
            tensor = None if final is None else state.get(f"{final}.{suffix}")
            self.register_buffer(slot, to_device(tensor, *placement))
        rope_types = layer_rope_types(config, family)
        distinct = list(dict.fromkeys(rope_types))  # one Rotary per distinct rope, in layer order
        rotary = family.positions is Positions.ROTARY
        self.rotary = torch.nn.ModuleList(
            Rotary(config, geometry.head_dim, kind) for kind in (distinct if rotary else [])
        ).to(placement[0])
        rope_index = [distinct.index(kind) if rotary else None for kind in rope_types]
        self._sites: dict[str, LoraSite] = {}
        self.layers = _layers(config, state, family, geometry, placement, rope_index, self._sites)
        # the stacked LoRA adapters' names, by index (jina-embeddings-v3's tasks); () if none
        self.adapter_names = adapter_names(config) if _has_lora(self) else ()

    def lora_sites(self) -> dict[str, LoraSite]:
        """Each stored projection of each layer, by its name in the checkpoint."""
        return self._sites

    def word_table(self) -> tuple[str, torch.Tensor] | None:
        """The word embedding table, by its checkpoint name."""
        return self.embeddings.word_name, self.embeddings.word

    def set_word_lora(self, lora: torch.nn.Module) -> None:
        """The word table's stacked adapters (EncoderEmbeddings applies them)."""
        self.embeddings.word_lora = cast(LoraEmbedding, lora)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn: AttentionMetadata,
        kv_cache: PagedKVCache | None,
        out: torch.Tensor | None = None,  # [>= num_tokens, hidden]
        token_type_ids: torch.Tensor | None = None,  # [num_tokens] int64 segment ids (BERT pairs)
        adapters: AdapterSegments | None = None,  # each token's LoRA adapter (None: none runs)
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Embeds and runs every layer bidirectionally over whole prompts."""
        self.check_inputs(input_ids)
        self._check_token_types(token_type_ids, input_ids.shape[0])
        if attn.causal or attn.has_context:
            raise ValueError("encoder attention is bidirectional and never chunked")
        if adapters is not None and not self.adapter_names:
            raise ValueError("this model has no adapters")
        x = self.embeddings(input_ids, positions, token_type_ids, adapters)  # [num_tokens, hidden]
        ropes = [cast(Rotary, rotary).cos_sin(positions, x.dtype) for rotary in self.rotary]
        biases = None if self.relative is None else self.relative.begin()
        step = EncoderStep(self.backend, attn, ropes, biases, adapters)
        for layer in self.layers:
            x = layer(x, step)
        x = layer_norm(x, self.final_norm_weight, self.final_norm_bias, self.eps)
        return self.deliver(x, out)

    def _check_token_types(self, token_type_ids: torch.Tensor | None, num_tokens: int) -> None:
        """One type id per token, each below type_vocab_size (checked while on the host).

        Models without a type table ignore the ids, as transformers' DeBERTa-v3 does with the
        0/1 ids its tokenizer gives pairs.
        """
        if token_type_ids is None:
            return
        if token_type_ids.shape != (num_tokens,):
            raise ValueError(f"token_type_ids must have shape ({num_tokens},)")
        if self.num_token_types and token_type_ids.device.type == "cpu" and num_tokens:
            low, high = int(token_type_ids.min()), int(token_type_ids.max())
            if low < 0 or high >= self.num_token_types:
                raise ValueError(f"token type ids must lie in [0, {self.num_token_types})")

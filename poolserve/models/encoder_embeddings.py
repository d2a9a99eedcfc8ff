"""Encoder embeddings: tokens, learned or fairseq-offset positions, token types, LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from poolserve.models.adapters import AdapterSegments, take_lora_embedding
from poolserve.models.encoder_config import padding_idx, uses_position_table
from poolserve.models.families.records import EmbeddingNames, EncoderFamily, Positions
from poolserve.models.layers import to_device
from poolserve.models.registry import ENCODER_LAYOUTS
from poolserve.models.weights import take


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm over the last dim (bias optional); identity where a layer has no norm."""
    if weight is None:
        return x
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def offset_positions(
    input_ids: torch.Tensor,  # [num_tokens] int64
    positions: torch.Tensor,  # [num_tokens] int64, 0 at each sequence's first token
    pad: int,
) -> torch.Tensor:  # [num_tokens] int64
    """fairseq positions: non-padding tokens count from pad + 1 per sequence; padding is pad."""
    keep = input_ids.ne(pad).long()  # [num_tokens]
    counted = keep.cumsum(0)  # [num_tokens] non-padding tokens so far in the stream
    first = torch.arange(input_ids.shape[0], device=input_ids.device) - positions  # [num_tokens]
    ahead = (counted - keep)[first]  # [num_tokens] non-padding tokens before the sequence
    return (counted - ahead) * keep + pad


class EncoderEmbeddings(torch.nn.Module):
    """Token, position and token type embeddings, optional projection, LayerNorm."""

    word: torch.Tensor
    position: torch.Tensor | None
    token_type: torch.Tensor | None
    projection: torch.Tensor | None
    norm_weight: torch.Tensor
    norm_bias: torch.Tensor | None

    def __init__(
        self,
        config: PretrainedConfig,
        state: dict[str, torch.Tensor],
        family: EncoderFamily,
        eps: float,
        placement: tuple[torch.device, torch.dtype],
    ) -> None:
        super().__init__()
        names: EmbeddingNames = ENCODER_LAYOUTS[family.layout][0]
        self.eps = eps
        self.kind = family.positions
        self.pad = padding_idx(config, family) if family.positions is Positions.OFFSET else 0
        table = (
            take(state, f"{names.position}.weight") if uses_position_table(config, family) else None
        )
        tensors = {
            "word": take(state, f"{names.word}.weight"),
            "position": table,
            "token_type": state.get(f"{names.token_type}.weight"),
            "projection": state.get(f"{names.projection}.weight"),
            "norm_weight": take(state, f"{names.norm}.weight"),
            "norm_bias": state.get(f"{names.norm}.bias"),
        }
        for name, tensor in tensors.items():
            self.register_buffer(name, to_device(tensor, *placement))
        # stacked LoRA adapters of the word and token type tables (jina-embeddings-v3's, or
        # PEFT adapters' room: models/peft.py)
        self.word_name = names.word
        self.word_lora = take_lora_embedding(state, names.word, config, placement)
        self.type_lora = take_lora_embedding(state, names.token_type, config, placement)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        token_type_ids: torch.Tensor | None,  # [num_tokens] int64; None: every token is type 0
        adapters: AdapterSegments | None = None,  # each token's LoRA adapter
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Sums the embeddings, projects (DeBERTa) and normalises."""
        x = F.embedding(input_ids, self.word)  # [num_tokens, embedding_size]
        if adapters is not None and self.word_lora is not None:
            x = self.word_lora.add_to(x, input_ids, adapters)
        if self.token_type is not None:  # a model without a table ignores the ids
            if adapters is not None and self.type_lora is not None:
                types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
                rows = F.embedding(types, self.token_type)  # [num_tokens, embedding_size]
                x = x + self.type_lora.add_to(rows, types, adapters)
            elif token_type_ids is None:
                x = x + self.token_type[0]
            else:
                x = x + F.embedding(token_type_ids, self.token_type)
        if self.position is not None:
            if self.kind is Positions.OFFSET:
                positions = offset_positions(input_ids, positions, self.pad)
            x = x + F.embedding(positions, self.position)
        if self.projection is not None:
            x = F.linear(x, self.projection)  # [num_tokens, hidden]
        return layer_norm(x, self.norm_weight, self.norm_bias, self.eps)

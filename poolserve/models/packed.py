"""The packed-model interface and host-side token id and token type validation."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from poolserve.models.attention import AttentionMetadata
from poolserve.models.errors import InvalidTokenIdError, InvalidTokenTypeError
from poolserve.models.kv_cache import PagedKVCache


def validate_token_ids(token_ids: Sequence[int] | torch.Tensor, vocab_size: int) -> None:
    """Raises InvalidTokenIdError for a negative id or one >= vocab_size (host ids only)."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.device.type != "cpu":
            raise ValueError("validate_token_ids checks host tensors; got one on the device")
        if token_ids.numel() == 0:
            return
        low, high = int(token_ids.min()), int(token_ids.max())
    else:
        if len(token_ids) == 0:
            return
        low, high = min(token_ids), max(token_ids)
    if low < 0:
        raise InvalidTokenIdError(low, vocab_size)
    if high >= vocab_size:
        raise InvalidTokenIdError(high, vocab_size)


def validate_token_type_ids(
    token_type_ids: torch.Tensor, num_tokens: int, num_token_types: int
) -> None:
    """Raises InvalidTokenTypeError unless each token has one id inside the type table."""
    if token_type_ids.shape != (num_tokens,):
        raise InvalidTokenTypeError(
            f"{token_type_ids.numel()} token type ids given for a prompt of {num_tokens} tokens"
        )
    if num_token_types == 0 or num_tokens == 0:
        return  # a model without a table ignores the values, as transformers does
    low, high = int(token_type_ids.min()), int(token_type_ids.max())
    if low < 0 or high >= num_token_types:
        bad = low if low < 0 else high
        raise InvalidTokenTypeError(
            f"token type id {bad} is out of range [0, {num_token_types}) of this model"
        )


class PackedModel(torch.nn.Module, abc.ABC):
    """A backbone over a flat token stream: returns hidden states [num_tokens, hidden]."""

    vocab_size: int
    num_token_types: int = 0  # rows of the token type table; 0: the model ignores type ids

    @abc.abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn: AttentionMetadata,
        kv_cache: PagedKVCache | None,
        out: torch.Tensor | None = None,  # [>= num_tokens, hidden]
        token_type_ids: torch.Tensor | None = None,  # [num_tokens] int64; None: every type is 0
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Runs the backbone; writes into `out` and returns a view of it when given."""

    def check_inputs(self, input_ids: torch.Tensor) -> None:
        """Validates ids still on the host; device ids were validated before their copy."""
        if input_ids.device.type == "cpu":
            validate_token_ids(input_ids, self.vocab_size)

    @staticmethod
    def deliver(hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Places final hidden states into the caller's persistent buffer when one is given."""
        if out is None:
            return hidden
        target = out[: hidden.shape[0]]  # [num_tokens, hidden]
        target.copy_(hidden)
        return target

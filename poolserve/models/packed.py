"""The packed-model interface and host-side token id and token type validation."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from poolserve.models.adapters import LoraSite
from poolserve.models.attention import AttentionMetadata
from poolserve.models.kv_cache import PagedKVCache
from poolserve.types.prompts import check_token_ids, check_token_type_ids


def validate_token_ids(token_ids: Sequence[int] | torch.Tensor, vocab_size: int) -> None:
    """Raises InvalidTokenIdError for a negative id or one >= vocab_size (host ids only)."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.device.type != "cpu":
            raise ValueError("validate_token_ids checks host tensors; got one on the device")
        check_token_ids(token_ids.numpy(), vocab_size)
    else:
        check_token_ids(token_ids, vocab_size)


def validate_token_type_ids(
    token_type_ids: torch.Tensor, num_tokens: int, num_token_types: int
) -> None:
    """Raises InvalidTokenTypeError unless each token has one id inside the type table."""
    check_token_type_ids(token_type_ids.numpy(), num_tokens, num_token_types)


class PackedModel(torch.nn.Module, abc.ABC):
    """A backbone over a flat token stream: returns hidden states [num_tokens, hidden]."""

    vocab_size: int
    num_token_types: int = 0  # rows of the token type table; 0: the model ignores type ids
    # names of the stacked LoRA adapters a forward may apply per token (`adapters=`), by index
    adapter_names: tuple[str, ...] = ()
    # rows of positions per token: 1, or M-RoPE's 3 (frame, row, column: Qwen-VL)
    position_rows: int = 1

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

    def lora_sites(self) -> dict[str, LoraSite]:
        """Each module a LoRA adapter may train, by its checkpoint name inside the backbone (a
        PEFT module path ends with it); {} where the model has no projections to adapt."""
        return {}

    def word_table(self) -> tuple[str, torch.Tensor] | None:
        """The token embedding table a LoRA adapter may train: its checkpoint name, the table."""
        return None

    def set_word_lora(self, lora: torch.nn.Module) -> None:
        """Where the forward finds the stacked adapters of the token embedding table."""
        raise NotImplementedError(f"{type(self).__name__} has no adaptable embedding table")

    def lora_slots(self, index: int) -> torch.nn.ModuleDict:
        """Layer `index`'s stacked adapters by projection slot (its `lora` ModuleDict)."""
        slots = self.get_submodule(f"layers.{index}.lora")
        assert isinstance(slots, torch.nn.ModuleDict)
        return slots

    @staticmethod
    def deliver(hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Places final hidden states into the caller's persistent buffer when one is given."""
        if out is None:
            return hidden
        target = out[: hidden.shape[0]]  # [num_tokens, hidden]
        target.copy_(hidden)
        return target

"""A request's `input` into token-id prompts: checks, tokenization off the loop, truncation."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from service.errors import InvalidRequestError
from service.state import ModelHandle


@dataclass(frozen=True)
class RawInputs:
    """The inputs of one request, before tokenization: texts or token ids, never both."""

    texts: tuple[str, ...] | None
    token_ids: tuple[tuple[int, ...], ...] | None

    def __len__(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or ())


def split_input(value: object, max_batch: int) -> RawInputs:
    """Classify and check the `input` field (the schema already checked its types)."""
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
        value = [value]  # one text or one token-id prompt
    assert isinstance(value, list)
    if not value:
        raise InvalidRequestError("input must not be empty", "input")
    if len(value) > max_batch:
        raise InvalidRequestError(
            f"input has {len(value)} items, more than the limit of {max_batch} "
            "(--max-client-batch-size)",
            "input",
        )
    if isinstance(value[0], str):
        if any(not text for text in value):
            raise InvalidRequestError("input must not contain empty strings", "input")
        return RawInputs(tuple(value), None)
    if any(not ids for ids in value):
        raise InvalidRequestError("input must not contain empty token lists", "input")
    return RawInputs(None, tuple(tuple(ids) for ids in value))


def truncation_length(requested: int | None, model: ModelHandle) -> int | None:
    """How many tokens to keep, or None to keep all (-1 means the model's limit)."""
    if requested is None:
        return None
    if requested == -1:
        return model.max_model_len
    if requested == 0 or requested > model.max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens must be between 1 and max_model_len ({model.max_model_len}), "
            f"got {requested}",
            "truncate_prompt_tokens",
        )
    return requested


async def tokenize(
    inputs: RawInputs, model: ModelHandle, keep: int | None, side: str
) -> list[list[int]]:
    """Token ids of every input; texts are tokenized in a worker thread."""
    if inputs.token_ids is not None:
        return [_truncate(list(ids), keep, side) for ids in inputs.token_ids]
    texts = list(inputs.texts or ())
    tokenizer = model.tokenizers[side]
    return await asyncio.to_thread(_encode, tokenizer, texts, keep)


def _encode(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], keep: int | None
) -> list[list[int]]:
    encoded = tokenizer(
        list(texts), add_special_tokens=True, truncation=keep is not None, max_length=keep
    )
    return [list(ids) for ids in encoded["input_ids"]]


def _truncate(ids: list[int], keep: int | None, side: str) -> list[int]:
    if keep is None or len(ids) <= keep:
        return ids
    return ids[-keep:] if side == "left" else ids[:keep]

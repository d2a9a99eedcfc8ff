"""The checks a prompt passes before any work: its length, its token ids, its token type ids.

Both sides run them: a front end before it sends a prompt, the engine when one is submitted.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poolserve.types.errors import (
    EmptyPromptError,
    InvalidTokenIdError,
    InvalidTokenTypeError,
    PromptTooLongError,
)


def check_token_ids(token_ids: Sequence[int] | np.ndarray, vocab_size: int) -> None:
    """Raises InvalidTokenIdError for a negative id or one >= vocab_size."""
    if len(token_ids) == 0:
        return
    if isinstance(token_ids, np.ndarray):
        low, high = int(token_ids.min()), int(token_ids.max())
    else:
        low, high = min(token_ids), max(token_ids)
    if low < 0:
        raise InvalidTokenIdError(low, vocab_size)
    if high >= vocab_size:
        raise InvalidTokenIdError(high, vocab_size)


def check_token_type_ids(token_type_ids: np.ndarray, num_tokens: int, num_token_types: int) -> None:
    """Raises InvalidTokenTypeError unless each token has one id inside the type table."""
    if token_type_ids.shape != (num_tokens,):
        raise InvalidTokenTypeError(
            f"{token_type_ids.size} token type ids given for a prompt of {num_tokens} tokens"
        )
    if num_token_types == 0 or num_tokens == 0:
        return  # a model without a table ignores the values, as transformers does
    low, high = int(token_type_ids.min()), int(token_type_ids.max())
    if low < 0 or high >= num_token_types:
        bad = low if low < 0 else high
        raise InvalidTokenTypeError(
            f"token type id {bad} is out of range [0, {num_token_types}) of this model"
        )


def checked_prompt(prompt: Sequence[int], max_model_len: int, vocab_size: int) -> np.ndarray:
    """The prompt as the int64 array a request keeps, after length and id checks."""
    if len(prompt) == 0:
        raise EmptyPromptError()
    if len(prompt) > max_model_len:
        raise PromptTooLongError(len(prompt), max_model_len)
    if isinstance(prompt, np.ndarray):
        ids = prompt.astype(np.int64, copy=False)  # [num_prompt_tokens]
        check_token_ids(ids, vocab_size)
        return ids
    # Python's min and max on the tokenizer's list: exact for ids of any size (one beyond int64
    # is refused before the conversion) and a fifth of the cost of checking an array
    check_token_ids(prompt, vocab_size)
    return np.asarray(prompt, dtype=np.int64)


def checked_token_types(
    token_type_ids: Sequence[Sequence[int] | None] | None,
    token_ids: Sequence[np.ndarray],
    num_token_types: int,
) -> list[np.ndarray | None]:
    """Each prompt's type ids as the int64 array its request keeps, or None for all type 0."""
    if token_type_ids is None:
        return [None] * len(token_ids)
    if len(token_type_ids) != len(token_ids):
        raise ValueError(f"{len(token_type_ids)} token type lists for {len(token_ids)} prompts")
    return [
        None if types is None else _checked_types(types, len(ids), num_token_types)
        for ids, types in zip(token_ids, token_type_ids, strict=True)
    ]


def _checked_types(
    token_type_ids: Sequence[int], num_tokens: int, num_token_types: int
) -> np.ndarray | None:
    """One prompt's checked type ids; None when the forward would not tell them from none."""
    try:
        types = np.asarray(token_type_ids, dtype=np.int64)  # [num_tokens]
    except (OverflowError, TypeError, ValueError) as exc:
        raise InvalidTokenTypeError(f"token type ids must be integers: {exc}") from exc
    check_token_type_ids(types, num_tokens, num_token_types)
    # All type 0 is what no types mean, so the step skips its type buffer: a tokenizer's ids for
    # a single text cost nothing. A model without a type table ignores them, as transformers does.
    if num_token_types == 0 or not types.any():
        return None
    return types

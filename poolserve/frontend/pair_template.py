"""Where a tokenizer puts special tokens and type ids around two texts, probed once at start."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Specials:
    """Special tokens a tokenizer puts at one place of a prompt, with their token type ids."""

    ids: tuple[int, ...] = ()
    types: tuple[int, ...] = ()


@dataclass(frozen=True)
class PairLayout:
    """Where the special tokens and type ids go around two texts: `prefix A middle B suffix`."""

    prefix: Specials
    middle: Specials
    suffix: Specials
    first_type: int = 0
    second_type: int = 0
    has_types: bool = False  # the tokenizer gives token_type_ids (BERT); else every type is 0

    def __len__(self) -> int:
        return len(self.prefix.ids) + len(self.middle.ids) + len(self.suffix.ids)

    def join(self, first: Sequence[int], second: Sequence[int]) -> Prompt:
        """The prompt of two content-token runs, as tokenizer(first, second) lays it out."""
        ids = [*self.prefix.ids, *first, *self.middle.ids, *second, *self.suffix.ids]
        if not self.has_types:
            return Prompt(ids, None)
        types = [
            *self.prefix.types,
            *[self.first_type] * len(first),
            *self.middle.types,
            *[self.second_type] * len(second),
            *self.suffix.types,
        ]
        return Prompt(ids, types)


@dataclass(frozen=True)
class Prompt:
    """One prompt for the engine: token ids and, for BERT-style pairs, token type ids."""

    token_ids: list[int]
    token_type_ids: list[int] | None


def probe_pair_template(tokenizer: PreTrainedTokenizerBase) -> PairLayout | None:
    """The tokenizer's own pair template, read off tokenizer("a", "b"); None if it has none."""
    encoded = tokenizer("a", "b")
    ids = list(encoded["input_ids"])
    types = encoded.get("token_type_ids")
    first = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    second = list(tokenizer("b", add_special_tokens=False)["input_ids"])
    start = _find(ids, first, 0)
    middle = None if start is None else _find(ids, second, start + len(first))
    if start is None or middle is None:
        return None
    end = start + len(first)
    stop = middle + len(second)
    kinds = list(types) if types is not None else [0] * len(ids)
    return PairLayout(
        Specials(tuple(ids[:start]), tuple(kinds[:start])),
        Specials(tuple(ids[end:middle]), tuple(kinds[end:middle])),
        Specials(tuple(ids[stop:]), tuple(kinds[stop:])),
        first_type=kinds[start],
        second_type=kinds[middle],
        has_types=types is not None,
    )


def _find(ids: list[int], run: list[int], start: int) -> int | None:
    """Where `run` first occurs in `ids` from `start` (None: nowhere)."""
    for at in range(start, len(ids) - len(run) + 1):
        if ids[at : at + len(run)] == run:
            return at
    return None

"""Exact truncation without tokenizing whole texts: bounded windows at the kept side."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from poolserve.service.frontend.jobs import TruncationSide
from poolserve.service.state import SpecialTokens

# A first window of this many characters per wanted token covers normal text in one pass.
FIRST_CHARS_PER_TOKEN = 8
FIRST_EXTRA_CHARS = 64
# Pre-tokens (words) next to a window's cut that may tokenize differently in the whole text.
BOUNDARY_WORDS = 2
# A character after whitespace: where a left-side window prefers to start (see _cut).
_WORD_START = re.compile(r"(?<=\s)\S")


@dataclass(frozen=True)
class Window:
    """Content tokens of one text: all of them, or a run at the kept side equal to the whole's."""

    ids: list[int]
    complete: bool
    num_chars: int  # characters of the text the tokenizer saw last


# Why a window's run is exact: the normalizer works on characters and their close neighbours
# (case, accents, composed marks, spacing around CJK), the pre-tokenizer splits words left to
# right looking at most a character ahead (numbers grouped in threes count from a run's start,
# so a left window never starts inside one: see _left_start), and the model (WordPiece, BPE,
# Unigram) encodes each word alone. A cut therefore changes only the words touching it, and the
# tokens of every other word equal the whole text's. A window grows (doubling, at most
# max_chars) until it is the whole text or holds `want` tokens outside its BOUNDARY_WORDS words
# at the cut. A tokenizer that does not split words (one word per text) never yields such a run,
# so it falls back to the whole text, which max_chars bounds.
def content_windows(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    want: int,
    side: TruncationSide,
    max_chars: int,
) -> list[Window]:
    """Content tokens of each text: all of them, or >= want exact ones from a window at `side`."""
    fast = bool(getattr(tokenizer, "is_fast", False))  # word_ids need a fast tokenizer
    first = want * FIRST_CHARS_PER_TOKEN + FIRST_EXTRA_CHARS if fast else max_chars
    widths = [min(len(text), max_chars, first) for text in texts]
    done: dict[int, Window] = {}
    pending = list(range(len(texts)))
    while pending:
        cuts = {i: _cut(texts[i], widths[i], side) for i in pending}
        windows = [texts[i][slice(*cuts[i])] for i in pending]
        encoded = tokenizer(windows, add_special_tokens=False)
        retry = []
        for j, i in enumerate(pending):
            ids, num_chars = list(encoded["input_ids"][j]), len(windows[j])
            if num_chars == len(texts[i]):
                done[i] = Window(ids, True, num_chars)
                continue
            exact = _exact_run(ids, encoded.word_ids(j), side) if fast else []
            if len(exact) >= want or widths[i] >= min(max_chars, len(texts[i])):
                done[i] = Window(exact, False, num_chars)
                continue
            widths[i] = min(2 * widths[i], max_chars, len(texts[i]))
            retry.append(i)
        pending = retry
    return [done[i] for i in range(len(texts))]


def _cut(text: str, width: int, side: TruncationSide) -> tuple[int, int]:
    """[start, stop) of the window: its first `width` characters, or its last from a safe start."""
    if side == "right" or width >= len(text):
        return 0, width
    return _left_start(text, len(text) - width), len(text)


# A left window starts where pre-tokenizers that count from a run's start (digits in threes,
# Llama 3's \p{N}{1,3}) count from the same place as in the whole text: right after whitespace
# when there is such a word start in the first half of its range, else at the first character
# that does not split a run of numbers. Text without whitespace there (Chinese, Japanese, URLs,
# long joined runs) is cut inside a word: like any cut, that changes only the words touching it,
# which _exact_run drops, and whole runs of numbers group as in the whole text. Looking only at
# the first half keeps the window at least half its width (a lone space near the end of a long
# Chinese text would otherwise leave a few characters however wide the window grows). Only a
# range that is all the tail of one run of numbers gets an empty window.
def _left_start(text: str, start: int) -> int:
    """The first safe start of a left window at or after `start`."""
    found = _WORD_START.search(text, start, start + (len(text) - start) // 2 + 1)
    if found:
        return found.start()
    # str.isnumeric covers \p{N} (and some CJK numerals, which only move the cut further right)
    while 0 < start < len(text) and text[start - 1].isnumeric() and text[start].isnumeric():
        start += 1
    return start


def _exact_run(ids: list[int], words: list[int | None], side: TruncationSide) -> list[int]:
    """The tokens at the kept side before the BOUNDARY_WORDS pre-tokens next to the cut."""
    known = [w for w in words if w is not None]
    if not known:
        return []
    if side == "right":
        last_exact = max(known) - BOUNDARY_WORDS
        stop = next((k for k, w in enumerate(words) if w is None or w > last_exact), len(ids))
        return ids[:stop]
    first_exact = min(known) + BOUNDARY_WORDS
    count = next(
        (k for k, w in enumerate(reversed(words)) if w is None or w < first_exact), len(ids)
    )
    return ids[len(ids) - count :]


def special_tokens(tokenizer: PreTrainedTokenizerBase) -> SpecialTokens:
    """Where the tokenizer's post-processor puts its special tokens around a text."""
    content = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    if not content:
        raise ValueError("the tokenizer gives no tokens for a plain letter")
    for start in range(len(full) - len(content) + 1):
        if full[start : start + len(content)] == content:
            return SpecialTokens(tuple(full[:start]), tuple(full[start + len(content) :]))
    raise ValueError("the tokenizer's special tokens do not surround the text's own tokens")

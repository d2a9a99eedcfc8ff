"""Exact truncation without tokenizing whole texts: bounded windows at the kept side."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from poolserve.frontend.jobs import TruncationSide
from poolserve.frontend.state import SpecialTokens

# A first window of this many characters per wanted token covers normal text in one pass.
FIRST_CHARS_PER_TOKEN = 8
FIRST_EXTRA_CHARS = 64
# Pre-tokens (words) next to a window's cut that may tokenize differently in the whole text.
BOUNDARY_WORDS = 2
# A character after whitespace: where a left-side window prefers to start (see _cut).
_WORD_START = re.compile(r"(?<=\s)\S")


# What transformers runs between `tokenizer(texts)` and the Rust backend's encode_batch: a fast
# tokenizer whose class overrides none of them returns the backend's ids unchanged, so those
# tokenizers are encoded by the backend directly (no BatchEncoding, no per-call kwargs merge:
# the wrapper adds ~15 us to the ~20 us encode of a short text). Any other class (slow
# tokenizers, classes with their own __call__ or input modes such as NLLB's language codes) goes
# through transformers' wrapper. tests/frontend/test_fast_tokenize.py proves the ids equal.
WRAPPER_STEPS = (
    "__call__",
    "_encode_plus",
    "_batch_encode_plus",
    "_convert_encoding",
    "set_truncation_and_padding",
    "_switch_to_input_mode",
)
_DIRECT: dict[type, bool] = {}
# Texts of at most this many characters together are encoded one by one on the calling thread;
# more go to the backend's encode_batch, which spreads them over its thread pool. Measured on 2
# cores (docs/benchmarks.md "Per-request CPU: the fast path"): 2 to 4 short texts (up to 1024
# characters) took 1.5x to 3x the CPU on the pool (waking its threads) and came back later; 8
# texts of 256 came back sooner for 15% more CPU; from 16 texts the CPU is the same and the
# pool halves the wait. The same size as texts.INLINE_CHARS: what is encoded on the event loop
# never waits on the pool.
POOLED_CHARS = 1024


class Tokens(Protocol):
    """One text's tokens: the backend's Encoding, or the wrapper's answer for that text."""

    @property
    def ids(self) -> list[int]: ...

    @property
    def word_ids(self) -> list[int | None]: ...


def runs_backend_directly(cls: type) -> bool:
    """True when the class's `tokenizer(texts)` is the backend's encode_batch, nothing changed."""
    direct = _DIRECT.get(cls)
    if direct is None:
        direct = _DIRECT[cls] = issubclass(cls, PreTrainedTokenizerFast) and all(
            getattr(cls, step, None) is getattr(PreTrainedTokenizerFast, step, None)
            for step in WRAPPER_STEPS
        )
    return direct


def backend_of(tokenizer: object) -> Tokenizer | None:
    """The Rust tokenizer that `tokenizer(texts)` runs with nothing changed, else None."""
    if not runs_backend_directly(type(tokenizer)):
        return None
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    backend = tokenizer.backend_tokenizer
    # the wrapper's own settings before every call: a tokenizer.json's truncation and padding
    # off (MiniLM's cuts at 128), special tokens split in text only when the tokenizer says so
    split = bool(tokenizer.split_special_tokens)
    if backend.encode_special_tokens != split:
        backend.encode_special_tokens = split
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    return backend


class _Wrapped:
    """One text of the wrapper's BatchEncoding, read like an Encoding."""

    def __init__(self, encoded: object, index: int) -> None:
        self._encoded = encoded
        self._index = index

    @property
    def ids(self) -> list[int]:
        """The text's token ids."""
        return list(self._encoded["input_ids"][self._index])  # type: ignore[index]

    @property
    def word_ids(self) -> list[int | None]:
        """The pre-token of each token (fast tokenizers only)."""
        words: list[int | None] = self._encoded.word_ids(self._index)  # type: ignore[attr-defined]
        return words


def encode_batch(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    add_special_tokens: bool = False,
    with_words: bool = False,
) -> Sequence[Tokens]:
    """Each text's tokens exactly as `tokenizer(texts, add_special_tokens=...)` gives them.

    Without `with_words` only the ids are meant to be read: the backend then skips offsets and
    word ids (its encode_batch_fast, the same ids, ~20% less time).
    """
    backend = backend_of(tokenizer)
    if backend is not None:
        encode = backend.encode_batch if with_words else backend.encode_batch_fast
        if len(texts) > 1 and sum(map(len, texts)) <= POOLED_CHARS:
            return [encode([text], add_special_tokens=add_special_tokens)[0] for text in texts]
        return encode(list(texts), add_special_tokens=add_special_tokens)
    encoded = tokenizer(list(texts), add_special_tokens=add_special_tokens)
    return [_Wrapped(encoded, j) for j in range(len(texts))]


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
        partial = any(len(windows[j]) < len(texts[i]) for j, i in enumerate(pending))
        encoded = encode_batch(tokenizer, windows, with_words=fast and partial)
        retry = []
        for j, i in enumerate(pending):
            ids, num_chars = encoded[j].ids, len(windows[j])
            if num_chars == len(texts[i]):
                done[i] = Window(ids, True, num_chars)
                continue
            exact = _exact_run(ids, encoded[j].word_ids, side) if fast else []
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
    content = encode_batch(tokenizer, ["a"], add_special_tokens=False)[0].ids
    full = encode_batch(tokenizer, ["a"], add_special_tokens=True)[0].ids
    if not content:
        raise ValueError("the tokenizer gives no tokens for a plain letter")
    for start in range(len(full) - len(content) + 1):
        if full[start : start + len(content)] == content:
            return SpecialTokens(tuple(full[:start]), tuple(full[start + len(content) :]))
    raise ValueError("the tokenizer's special tokens do not surround the text's own tokens")

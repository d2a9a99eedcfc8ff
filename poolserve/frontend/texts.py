"""A request's `input` into token-id prompts: bounds, tokenization off the loop, truncation."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from poolserve.frontend.jobs import Truncate, TruncationSide
from poolserve.frontend.state import ModelHandle, SpecialTokens
from poolserve.frontend.truncation import Window, content_windows, encode_batch
from poolserve.types.errors import InvalidRequestError, OverloadedError, PayloadTooLargeError

T = TypeVar("T")

NO_SPECIALS = SpecialTokens((), ())
# Encodability is checked in slices so a huge text never needs a second full-size copy.
ENCODE_CHECK_CHARS = 1 << 20
# Tokenizing this many characters or fewer runs on the event loop instead of a worker thread.
# Measured on 2 cores (docs/benchmarks.md "Per-request CPU: the fast path"): the thread hop
# costs 15-35 us of CPU (executor queue, a thread wake-up, the result handed back to the loop),
# what encoding ~100 characters costs (~0.2 us each); one text of 256 to 2048 characters took
# 60-270 us less CPU per request inline, at concurrency 1 and 64 alike. Inline, the loop is held
# for the whole encode, ~0.25 ms at 1024 characters: past that one request's tokenization adds
# more to every other request's latency than the hop costs, so it goes to a worker thread.
INLINE_CHARS = 1024


class InputTooLongError(InvalidRequestError):
    """An input longer than the server or the model allows (400)."""

    code = "context_length_exceeded"


@dataclass(frozen=True)
class RawInputs:
    """The inputs of one request, before tokenization: texts or token ids, never both."""

    texts: tuple[str, ...] | None
    token_ids: tuple[tuple[int, ...], ...] | None

    def __len__(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or ())


@dataclass(frozen=True)
class Truncation:
    """How prompts are cut: keep `keep` tokens (None: all) from the start (right) or end (left).

    Uncut, a prompt above `limit` tokens is refused (None: max_model_len).
    """

    keep: int | None
    side: TruncationSide
    limit: int | None = None

    def most(self, model: ModelHandle) -> tuple[int, str]:
        """The most tokens an uncut prompt may have, and the name of that limit."""
        if self.limit is None or self.limit == model.max_model_len:
            return model.max_model_len, "max_model_len"
        return self.limit, "the model's max_seq_length"


def check_batch_size(num_items: int, max_batch: int, field: str) -> None:
    """400 when one request carries more inputs than --max-client-batch-size."""
    if num_items > max_batch:
        raise InvalidRequestError(
            f"{field} has {num_items} items, more than the limit of {max_batch} "
            "(--max-client-batch-size)",
            field,
        )


def split_input(value: object, max_batch: int) -> RawInputs:
    """Classify and check the `input` field (the schema already checked its types)."""
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
        value = [value]  # one text or one token-id prompt
    assert isinstance(value, list)
    if not value:
        raise InvalidRequestError("input must not be empty", "input")
    check_batch_size(len(value), max_batch, "input")
    if isinstance(value[0], str):
        if any(not text for text in value):
            raise InvalidRequestError("input must not contain empty strings", "input")
        return RawInputs(tuple(value), None)
    if any(not ids for ids in value):
        raise InvalidRequestError("input must not contain empty token lists", "input")
    return RawInputs(None, tuple(tuple(ids) for ids in value))


def truncation_for(truncate: Truncate, model: ModelHandle) -> Truncation:
    """The request's truncation (-1: the model's limit) within sentence-transformers' own.

    With no length asked, `truncate.auto` (None: the server's --auto-truncate) cuts at the
    model's limit instead of refusing longer inputs.
    """
    keep = model.st_max_seq_length
    requested = truncate.tokens
    side = truncate.side or model.truncation_side
    if truncate.auto is False and requested is None:
        # a client that forbids truncation (TEI's `truncate: false`, Cohere's NONE) is refused
        # above the sentence-transformers length rather than cut to it
        return Truncation(None, side, keep)
    auto = model.auto_truncate if truncate.auto is None else truncate.auto
    if requested is None and auto:
        requested = -1
    if requested is not None:
        if requested > model.max_model_len:  # vLLM's words, then the numbers
            raise InvalidRequestError(
                "truncate_prompt_tokens value is greater than max_model_len. Please request a "
                f"smaller truncation size. (max_model_len is {model.max_model_len}, got "
                f"{requested})",
                "truncate_prompt_tokens",
            )
        if requested == 0:
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be between 1 and max_model_len "
                f"({model.max_model_len}), or -1, got {requested}",
                "truncate_prompt_tokens",
            )
        wanted = model.max_model_len if requested == -1 else requested
        keep = wanted if keep is None else min(keep, wanted)
    return Truncation(keep, side)


def specials_for(model: ModelHandle, add_special_tokens: bool) -> SpecialTokens:
    """The special tokens put around every text: the tokenizer's, or none when not wanted."""
    return model.specials if add_special_tokens else NO_SPECIALS


def text_cost(
    texts: Sequence[str], model: ModelHandle, truncation: Truncation, specials: SpecialTokens
) -> int:
    """Characters the texts may have tokenized; 400 or 413 before any tokenizer runs."""
    limits = model.limits
    num_specials = len(specials)
    if truncation.keep is not None and truncation.keep <= num_specials:
        raise InvalidRequestError(
            f"truncate_prompt_tokens must be more than the {num_specials} special tokens the "
            "model adds to every text",
            "truncate_prompt_tokens",
        )
    if truncation.keep is None:
        longest = max(range(len(texts)), key=lambda i: len(texts[i]))
        if len(texts[longest]) > limits.max_input_chars:
            raise InputTooLongError(
                f"{_name('input', longest, len(texts))} has {len(texts[longest])} characters, "
                f"more than the limit of {limits.max_input_chars} (--max-input-chars); "
                "shorten it or set truncate_prompt_tokens",
                "input",
            )
    total = sum(min(len(text), limits.max_input_chars) for text in texts)
    if total > limits.max_request_chars:
        raise PayloadTooLargeError(
            f"the inputs have {total} characters to tokenize, more than the limit of "
            f"{limits.max_request_chars} per request (--max-request-chars); split the request",
            "input",
        )
    return total


def check_prompt(prompt: str, num_texts: int, model: ModelHandle) -> None:
    """A prompt to prepend to every text, bounded before any copy is made: a long `prompt` times
    many inputs would otherwise multiply one body's characters."""
    limits = model.limits
    if len(prompt) > limits.max_input_chars:
        raise InputTooLongError(
            f"prompt has {len(prompt)} characters, more than the limit of "
            f"{limits.max_input_chars} (--max-input-chars)",
            "prompt",
        )
    if len(prompt) * num_texts > limits.max_request_chars:
        raise PayloadTooLargeError(
            f"the prompt on each of {num_texts} inputs makes {len(prompt) * num_texts} "
            f"characters, more than the limit of {limits.max_request_chars} per request "
            "(--max-request-chars); split the request",
            "prompt",
        )


async def tokenize(
    inputs: RawInputs,
    model: ModelHandle,
    truncation: Truncation,
    on_reject: Callable[[str], None],
    add_special_tokens: bool = True,
) -> list[list[int]]:
    """Token ids of every input; texts within the character bounds, in a worker thread."""
    if inputs.token_ids is not None:  # token ids are taken as sent: no special tokens added
        return [cut_ids(list(ids), truncation) for ids in inputs.token_ids]
    texts = inputs.texts or ()
    specials = specials_for(model, add_special_tokens)
    num_chars = text_cost(texts, model, truncation, specials)
    return await run_budgeted(
        model, num_chars, on_reject, encode_texts, model, texts, truncation, specials, inline=True
    )


async def tokenize_prompt(
    model: ModelHandle, prompt: str, add_special_tokens: bool, on_reject: Callable[[str], None]
) -> list[int]:
    """All token ids of one `/tokenize` prompt, within the same character bounds."""
    if len(prompt) > model.limits.max_input_chars:
        raise InputTooLongError(
            f"prompt has {len(prompt)} characters, more than the limit of "
            f"{model.limits.max_input_chars} (--max-input-chars)",
            "prompt",
        )

    def encode() -> list[int]:
        check_encodable([prompt], "prompt")
        return encode_batch(model.tokenizer, [prompt], add_special_tokens)[0].ids

    return await run_budgeted(model, len(prompt), on_reject, encode, inline=True)


async def run_budgeted(
    model: ModelHandle,
    num_chars: int,
    on_reject: Callable[[str], None],
    work: Callable[..., T],
    *args: object,
    inline: bool = False,
) -> T:
    """Run work while num_chars of the character budget are held (429 if full).

    Work whose cost follows its characters (tokenizing) may run `inline` on the loop when it has
    at most INLINE_CHARS of them; everything else runs in a worker thread.
    """
    try:
        model.tokenizing.reserve(num_chars)
    except OverloadedError as exc:
        on_reject(exc.reason.value)
        raise
    if inline and num_chars <= INLINE_CHARS:
        try:
            return work(*args)
        finally:
            model.tokenizing.release(num_chars)
    running = asyncio.get_running_loop().run_in_executor(None, work, *args)

    def finished(future: asyncio.Future[T]) -> None:
        # the thread cannot be stopped: the budget is freed when it ends, not when a caller leaves
        model.tokenizing.release(num_chars)
        if not future.cancelled():
            future.exception()  # retrieved: a caller that left cannot log it as unhandled

    running.add_done_callback(finished)
    return await asyncio.shield(running)


def check_encodable(texts: Sequence[str], param: str) -> None:
    """400 for a text UTF-8 cannot encode (a lone surrogate), before any tokenizer sees it."""
    for index, text in enumerate(texts):
        if text.isascii():  # known without a scan
            continue
        for start in range(0, len(text), ENCODE_CHECK_CHARS):
            try:
                text[start : start + ENCODE_CHECK_CHARS].encode("utf-8")
            except UnicodeEncodeError as exc:
                where = start + exc.start
                raise InvalidRequestError(
                    f"{_name(param, index, len(texts))} has an unpaired surrogate "
                    f"U+{ord(text[where]):04X} at character {where}; text must be valid Unicode",
                    param,
                ) from None


def encode_texts(
    model: ModelHandle,
    texts: Sequence[str],
    truncation: Truncation,
    specials: SpecialTokens | None = None,
) -> list[list[int]]:
    """Token ids of every text as the tokenizer would give them, tokenizing bounded windows."""
    check_encodable(texts, "input")
    specials = model.specials if specials is None else specials
    if truncation.keep is not None:
        want = truncation.keep - len(specials)  # text_cost made sure it is positive
        windows = content_windows(
            model.tokenizer, texts, want, truncation.side, model.limits.max_input_chars
        )
        return [
            _kept(window, want, truncation.side, specials, _name("input", i, len(texts)))
            for i, window in enumerate(windows)
        ]
    # one token past the limit tells a prompt too long; the engine refuses complete ones itself
    limit, what = truncation.most(model)
    want = limit - len(specials) + 1
    windows = content_windows(model.tokenizer, texts, want, "right", model.limits.max_input_chars)
    return [
        _whole(window, limit, what, specials, _name("input", i, len(texts)))
        for i, window in enumerate(windows)
    ]


def _kept(
    window: Window, want: int, side: TruncationSide, specials: SpecialTokens, name: str
) -> list[int]:
    """The truncated prompt: specials around the `want` content tokens at the kept side."""
    if not window.complete and len(window.ids) < want:
        raise InputTooLongError(
            f"{name} has fewer than {want} tokens in the {window.num_chars} characters at its "
            "kept side, so it cannot be truncated exactly; shorten it or raise --max-input-chars",
            "input",
        )
    ids = window.ids[:want] if side == "right" else window.ids[max(0, len(window.ids) - want) :]
    return [*specials.prefix, *ids, *specials.suffix]


def _whole(window: Window, limit: int, what: str, specials: SpecialTokens, name: str) -> list[int]:
    """The untruncated prompt, or context_length_exceeded once a prefix proves it too long."""
    num_tokens = len(window.ids) + len(specials)
    if not window.complete or num_tokens > limit:
        raise InputTooLongError(
            f"{name} has more than {limit} tokens ({what}): its first {window.num_chars} "
            f"characters already make {num_tokens}. Please reduce the length of the input "
            "prompt, or set truncate_prompt_tokens",
            "input",
        )
    return [*specials.prefix, *window.ids, *specials.suffix]


def cut_ids(ids: list[int], truncation: Truncation) -> list[int]:
    """Token-id prompts follow the same truncation as texts (no specials are added)."""
    keep = truncation.keep
    if keep is None or len(ids) <= keep:
        return ids
    return ids[-keep:] if truncation.side == "left" else ids[:keep]


def _name(param: str, index: int, count: int) -> str:
    """How a message names one item of a field: `input`, or `input 3` among several."""
    return param if count == 1 else f"{param} {index}"

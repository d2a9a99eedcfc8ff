"""Late chunking: a whole document through the model once, one embedding per span of it.

A request names each input's spans as character ranges `[start, end)` of the text it sent, or a
`chunk_size`: windows of that many content tokens. Characters become token positions through
the fast tokenizer's offsets, on exactly the token ids the ordinary path sends (the text's own
tokens between the special tokens the tokenizer puts around it). A token belongs to a span when
the character its range starts at lies inside the span; the special tokens around the text, and
tokens that start inside a prepended prompt, belong to no span. The engine pools the mean of each
span's token states (`SpanMeanPool`) and runs the embedding head on every row.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import cast

from tokenizers import Encoding
from transformers import PreTrainedTokenizerBase

from poolserve.frontend.jobs import TextJob, Truncate
from poolserve.frontend.state import ModelHandle, SpecialTokens
from poolserve.frontend.texts import (
    InputTooLongError,
    RawInputs,
    Truncation,
    check_encodable,
    run_budgeted,
    specials_for,
    text_cost,
)
from poolserve.frontend.truncation import backend_of, encode_batch
from poolserve.types.errors import InvalidRequestError
from poolserve.types.tasks import PoolingTask

Span = tuple[int, int]  # [start, end): characters of a text, or positions of a prompt's tokens
CharSpans = tuple[tuple[Span, ...], ...]  # each input's spans, in characters
FIELD = "late_chunking"


@dataclass(frozen=True)
class LateChunking:
    """A request's late chunking: character spans per input, or windows of content tokens."""

    spans: tuple[tuple[Span, ...], ...] | None = None
    chunk_size: int | None = None
    # Jina's `late_chunking: true` (joined.py): before the inputs are joined, neither spans nor
    # chunk_size; after, `spans` holds each input's span of the one document
    joined: bool = False

    def __post_init__(self) -> None:
        forms = (self.spans is not None) + (self.chunk_size is not None)
        before_joining = self.joined and self.spans is None
        if forms != (0 if before_joining else 1):
            raise ValueError("late chunking takes exactly one of spans and chunk_size")


@dataclass(frozen=True)
class Document:
    """One prompt: its token ids, and where the text's own tokens sit in it and in the text."""

    token_ids: list[int]
    first: int  # position of the text's first token in the prompt
    starts: list[int]  # each text token's first character in the input text
    ends: list[int]  # each text token's end character in the input text


@dataclass(frozen=True)
class LatePlan:
    """A late-chunking job checked: its texts (any prompt prepended) and how to cut them."""

    late: LateChunking
    texts: tuple[str, ...]
    prompt_chars: int  # the prompt's characters before each input's own
    add_special_tokens: bool


def check_late(
    job: TextJob, raw: RawInputs | None, model: ModelHandle, max_len: int, limit: int
) -> None:
    """400 before any work for what late chunking cannot take; `limit`: most spans in all."""
    assert job.late_chunking is not None
    check_job(job.late_chunking, job.task, job.truncate)
    check_inputs(job.late_chunking, raw, model, max_len, limit)


async def late_prompts(
    plan: LatePlan,
    model: ModelHandle,
    max_len: int,
    limit: int,
    on_reject: Callable[[str], None],
) -> tuple[list[list[int]], tuple[tuple[Span, ...], ...], tuple[tuple[Span, ...], ...]]:
    """Each text's prompt, its spans as token ranges, and as characters (a chunk_size window's
    characters come from the tokenizer's offsets)."""
    documents = await tokenize_documents(
        plan.texts,
        plan.prompt_chars,
        model,
        max_len,
        plan.add_special_tokens,
        on_reject,
        joined=plan.late.joined,
    )
    token_spans, char_spans = resolve(plan.late, documents, limit)
    return [d.token_ids for d in documents], token_spans, char_spans


def check_job(late: LateChunking, job_task: PoolingTask, truncate: Truncate) -> None:
    """400 for what late chunking never combines with, before anything is read."""
    if job_task is not PoolingTask.EMBED:
        message = f"late_chunking applies to task 'embed', not {job_task.value!r}"
        raise InvalidRequestError(message, "task")
    if truncate.tokens is not None or truncate.auto:
        message = "late_chunking cannot be combined with truncation: the document must fit"
        raise InvalidRequestError(message, "truncate_prompt_tokens")
    if late.chunk_size is not None and late.chunk_size < 1:
        message = f"chunk_size must be a positive number of tokens, got {late.chunk_size}"
        raise InvalidRequestError(message, "late_chunking.chunk_size")


def check_inputs(
    late: LateChunking, raw: RawInputs | None, model: ModelHandle, max_len: int, limit: int
) -> None:
    """400 for inputs late chunking cannot split, and spans out of bounds, before any work."""
    if raw is None:
        raise InvalidRequestError("late_chunking applies to input texts, not messages", "messages")
    if raw.texts is None:
        raise InvalidRequestError("late_chunking applies to input texts, not token ids", "input")
    if not getattr(model.tokenizer, "is_fast", False):
        message = "late_chunking needs a fast tokenizer (character offsets); this model has none"
        raise InvalidRequestError(message, FIELD)
    if late.spans is not None:
        _check_spans(late.spans, raw.texts, max_len, limit)


def _check_spans(
    spans: Sequence[Sequence[Span]], texts: Sequence[str], most_per_text: int, limit: int
) -> None:
    """One list per input, within bounds; every span a non-empty range inside its text."""
    if len(spans) != len(texts):
        message = f"spans has {len(spans)} lists for {len(texts)} inputs: send one per input"
        raise InvalidRequestError(message, "late_chunking.spans")
    total = sum(len(ranges) for ranges in spans)
    if total > limit:
        message = (
            f"spans has {total} spans, more than the limit of {limit} per request "
            "(--max-client-batch-size)"
        )
        raise InvalidRequestError(message, "late_chunking.spans")
    for i, (ranges, text) in enumerate(zip(spans, texts, strict=True)):
        name = f"late_chunking.spans[{i}]"
        if not ranges:
            raise InvalidRequestError(f"{name} is empty: name one span or more", name)
        if len(ranges) > most_per_text:  # a document holds at most max_model_len tokens
            message = f"{name} has {len(ranges)} spans, more than max_model_len ({most_per_text})"
            raise InvalidRequestError(message, name)
        for j, (start, end) in enumerate(ranges):
            if not 0 <= start < end <= len(text):
                message = (
                    f"{name}[{j}] = [{start}, {end}) is not a range 0 <= start < end <= "
                    f"{len(text)} (the input's characters)"
                )
                raise InvalidRequestError(message, f"{name}[{j}]")


async def tokenize_documents(
    texts: Sequence[str],
    prompt_chars: int,
    model: ModelHandle,
    max_len: int,
    add_special_tokens: bool,
    on_reject: Callable[[str], None],
    *,
    joined: bool = False,
) -> list[Document]:
    """Each text whole, with offsets, within the character bounds and the tokenizing budget
    (`joined`: the one document of Jina's `late_chunking: true`)."""
    specials = specials_for(model, add_special_tokens)
    whole = Truncation(None, model.truncation_side, max_len)
    num_chars = text_cost(texts, model, whole, specials)
    work = _documents
    args = (model.tokenizer, texts, prompt_chars, specials, max_len, joined)
    return await run_budgeted(model, num_chars, on_reject, work, *args, inline=True)


def _documents(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    prompt_chars: int,
    specials: SpecialTokens,
    max_len: int,
    joined: bool = False,
) -> list[Document]:
    """The prompts as the ordinary path builds them (specials around the text's tokens)."""
    check_encodable(texts, "input")
    documents = []
    for index, (ids, offsets) in enumerate(_with_offsets(tokenizer, texts)):
        num_tokens = len(ids) + len(specials)
        if num_tokens > max_len:
            name = "input" if len(texts) == 1 else f"input {index}"
            if joined:
                name = "the document of the joined inputs (late_chunking: true)"
            raise InputTooLongError(
                f"{name} has {num_tokens} tokens, more than max_model_len ({max_len});"
                " late_chunking never truncates: split the document",
                "input",
            )
        firsts = [start for start, _ in offsets]
        if any(b < a for a, b in pairwise(firsts)):
            message = f"the tokenizer's offsets of input {index} are not in text order"
            raise InvalidRequestError(message, FIELD)
        # tokens that start inside the prompt are the prompt's: they lead the text's own
        own = bisect_left(firsts, prompt_chars)
        starts = [start - prompt_chars for start in firsts[own:]]
        ends = [end - prompt_chars for _, end in offsets[own:]]
        token_ids = [*specials.prefix, *ids, *specials.suffix]
        documents.append(Document(token_ids, len(specials.prefix) + own, starts, ends))
    return documents


def _with_offsets(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]
) -> list[tuple[list[int], list[Span]]]:
    """Each text's own token ids (no special tokens) and their character ranges."""
    if backend_of(tokenizer) is not None:  # the ordinary path's own call, offsets kept
        encoded = cast(Sequence[Encoding], encode_batch(tokenizer, texts, with_words=True))
        return [(list(e.ids), list(e.offsets)) for e in encoded]
    batch = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = batch["input_ids"], batch["offset_mapping"]
    return [(list(i), [(s, e) for s, e in o]) for i, o in zip(ids, offsets, strict=True)]


def resolve(
    late: LateChunking, documents: Sequence[Document], limit: int
) -> tuple[tuple[tuple[Span, ...], ...], tuple[tuple[Span, ...], ...]]:
    """Each input's token ranges (positions in its prompt) and character spans, checked."""
    if late.chunk_size is not None:
        pairs = [_windows(doc, late.chunk_size, i) for i, doc in enumerate(documents)]
        total = sum(len(tokens) for tokens, _ in pairs)
        if total > limit:
            message = (
                f"chunk_size {late.chunk_size} cuts the inputs into {total} windows, more than "
                f"the limit of {limit} per request (--max-client-batch-size)"
            )
            raise InvalidRequestError(message, "late_chunking.chunk_size")
        return tuple(t for t, _ in pairs), tuple(c for _, c in pairs)
    assert late.spans is not None
    tokens = tuple(
        _token_ranges(d, s, i) for i, (d, s) in enumerate(zip(documents, late.spans, strict=True))
    )
    return tokens, tuple(tuple(ranges) for ranges in late.spans)


def _token_ranges(document: Document, spans: Sequence[Span], index: int) -> tuple[Span, ...]:
    """The tokens whose first character lies inside each span (a run: offsets are in order)."""
    name = f"late_chunking.spans[{index}]"
    if len(spans) > len(document.token_ids):  # the engine's bound: a span per token at most
        message = (
            f"{name} has {len(spans)} spans for a document of {len(document.token_ids)} tokens"
        )
        raise InvalidRequestError(message, name)
    ranges = []
    for j, (start, end) in enumerate(spans):
        low, high = bisect_left(document.starts, start), bisect_left(document.starts, end)
        if low == high:
            message = f"{name}[{j}] = [{start}, {end}) holds no token's first character"
            raise InvalidRequestError(message, f"{name}[{j}]")
        ranges.append((document.first + low, document.first + high))
    return tuple(ranges)


def _windows(
    document: Document, size: int, index: int
) -> tuple[tuple[Span, ...], tuple[Span, ...]]:
    """Consecutive windows of `size` text tokens: their positions and the characters they cover."""
    count = len(document.starts)
    if count == 0:
        message = f"input {index} has no tokens of its own to cut into windows"
        raise InvalidRequestError(message, "late_chunking.chunk_size")
    tokens, chars = [], []
    for low in range(0, count, size):
        high = min(low + size, count)
        tokens.append((document.first + low, document.first + high))
        chars.append((document.starts[low], max(document.ends[low:high])))
    return tuple(tokens), tuple(chars)

"""Scoring requests' texts into prompts: the tokenizer's pair layout, bounded, truncated exactly."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from poolserve.frontend.jobs import ScoreJob, TruncationSide
from poolserve.frontend.pair_template import PairLayout, Prompt, Specials
from poolserve.frontend.state import ModelHandle
from poolserve.frontend.texts import InputTooLongError, check_encodable, run_budgeted
from poolserve.frontend.truncation import content_windows
from poolserve.types.errors import InvalidRequestError, PayloadTooLargeError


class PromptMode(Enum):
    """How a job's texts become prompts."""

    TEMPLATE = "template"  # one prompt per pair, laid out as tokenizer(query, document) does
    CONCATENATE = "concatenate"  # one prompt per pair: both texts inside one text's specials
    SEPARATE = "separate"  # one prompt per text


@dataclass(frozen=True)
class PairTruncation:
    """How a job's prompts are cut: the whole prompt's cap (None: none), each side's own cap, and
    the most tokens an uncut prompt may have (and that limit's name)."""

    keep: int | None
    side: TruncationSide
    max_doc_tokens: int | None
    max_query_tokens: int | None = None
    limit: tuple[int, str] | None = None  # None: max_model_len


def pair_layout(model: ModelHandle, template: bool) -> PairLayout:
    """The tokenizer's own pair template (probed at start), or both texts inside one text's
    specials."""
    if not template:
        return PairLayout(
            Specials(model.specials.prefix), Specials(), Specials(model.specials.suffix)
        )
    if model.pair_template is None:
        raise InvalidRequestError(
            "this model's tokenizer has no pair template (tokenizer(a, b) does not hold both "
            "texts' own tokens), so text pairs cannot be laid out as it was trained",
            "model",
        )
    return model.pair_template


def check_pairs(job: ScoreJob, max_batch: int) -> None:
    """400 for an empty side or more pairs than one request may score."""
    for name, texts in ((job.query_field, job.queries), (job.document_field, job.documents)):
        if not texts:
            raise InvalidRequestError(f"{name} must not be empty", name)
    if len(job.pairs) > max_batch:
        raise InvalidRequestError(
            f"{job.document_field} makes {len(job.pairs)} pairs, more than the limit of "
            f"{max_batch} (--max-client-batch-size)",
            job.document_field,
        )


def check_texts(job: ScoreJob, model: ModelHandle, cuts: PairTruncation) -> int:
    """Characters the job may tokenize; 400 or 413 before any tokenizer runs."""
    limits = model.limits
    groups = (
        (job.query_field, job.queries, cuts.keep is not None or cuts.max_query_tokens is not None),
        (
            job.document_field,
            job.documents,
            cuts.keep is not None or cuts.max_doc_tokens is not None,
        ),
    )
    total = 0
    for field, texts, truncated in groups:
        for index, text in enumerate(texts):
            if not text:
                raise InvalidRequestError(f"{field} must not contain empty strings", field)
            if not truncated and len(text) > limits.max_input_chars:
                raise InputTooLongError(
                    f"{_name(field, index, len(texts))} has {len(text)} characters, more than "
                    f"the limit of {limits.max_input_chars} (--max-input-chars); shorten it or "
                    "set truncate_prompt_tokens",
                    field,
                )
        total += sum(min(len(text), limits.max_input_chars) for text in texts)
    if total > limits.max_request_chars:
        raise PayloadTooLargeError(
            f"the texts have {total} characters to tokenize, more than the limit of "
            f"{limits.max_request_chars} per request (--max-request-chars); split the request",
            job.document_field,
        )
    return total


async def tokenize_job(
    job: ScoreJob,
    model: ModelHandle,
    mode: PromptMode,
    cuts: PairTruncation,
    on_reject: Callable[[str], None],
) -> list[Prompt]:
    """The job's prompts, tokenized in a worker thread under the tokenizing budget.

    One prompt per pair, or (SEPARATE) each query, then each document, alone.
    """
    num_chars = check_texts(job, model, cuts)
    capped = cuts.max_doc_tokens is not None or cuts.max_query_tokens is not None
    if mode is PromptMode.CONCATENATE and not capped:
        num_chars = _check_joined(job, model, cuts)
        return await run_budgeted(
            model, num_chars, on_reject, _joined_prompts, job, model, cuts, inline=True
        )
    return await run_budgeted(
        model, num_chars, on_reject, _prompts, job, model, mode, cuts, inline=True
    )


def _check_joined(job: ScoreJob, model: ModelHandle, cuts: PairTruncation) -> int:
    """Characters of the pairs' joined texts (a query counts once per pair); 400 or 413."""
    limits = model.limits
    total = 0
    for query, document in job.pairs:
        num_chars = len(job.queries[query]) + len(job.documents[document])
        if cuts.keep is None and num_chars > limits.max_input_chars:
            raise InputTooLongError(
                f"{_name(job.document_field, document, len(job.documents))} with its "
                f"{job.query_field} has {num_chars} characters, more than the limit of "
                f"{limits.max_input_chars} (--max-input-chars); shorten it or set "
                "truncate_prompt_tokens",
                job.document_field,
            )
        total += min(num_chars, limits.max_input_chars)
    if total > limits.max_request_chars:
        raise PayloadTooLargeError(
            f"the pairs have {total} characters to tokenize, more than the limit of "
            f"{limits.max_request_chars} per request (--max-request-chars); split the request",
            job.document_field,
        )
    return total


def _joined_prompts(job: ScoreJob, model: ModelHandle, cuts: PairTruncation) -> list[Prompt]:
    """vLLM's prompt of an LLM read as a reranker: query + document tokenized as one text (so
    tokens that merge across the join, or a SentencePiece word start, come out as vLLM's)."""
    check_encodable(job.queries, job.query_field)
    check_encodable(job.documents, job.document_field)
    layout = pair_layout(model, template=False)
    texts = [job.queries[query] + job.documents[document] for query, document in job.pairs]
    most, what = cuts.limit or (model.max_model_len, "max_model_len")
    if cuts.keep is not None and cuts.keep <= len(layout):
        raise InvalidRequestError(
            f"truncate_prompt_tokens must be more than the {len(layout)} special tokens the "
            "model adds to every prompt",
            "truncate_prompt_tokens",
        )
    capped = cuts.keep is not None
    want = (most if cuts.keep is None else cuts.keep) - len(layout)
    side = cuts.side if capped else "right"
    windows = content_windows(
        model.tokenizer, texts, want if capped else want + 1, side, model.limits.max_input_chars
    )
    prompts = []
    for (_, document), window in zip(job.pairs, windows, strict=True):
        name = f"{_name(job.document_field, document, len(job.documents))} with its query"
        if not capped and (not window.complete or len(window.ids) > want):
            raise InputTooLongError(
                f"{name} has more than {most} tokens ({what}) with the special tokens. Please "
                "reduce the length of the input prompt, or set truncate_prompt_tokens",
                job.document_field,
            )
        if not window.complete and len(window.ids) < want:
            raise InputTooLongError(
                f"{name} has fewer than {want} tokens in the {window.num_chars} characters at "
                "its kept side, so it cannot be truncated exactly; shorten it or raise "
                "--max-input-chars",
                job.document_field,
            )
        prompts.append(layout.join(_cut(window.ids, want, side), []))
    return prompts


def _prompts(
    job: ScoreJob, model: ModelHandle, mode: PromptMode, cuts: PairTruncation
) -> list[Prompt]:
    """Tokenize each text once (bounded windows), then lay out the prompts."""
    check_encodable(job.queries, job.query_field)
    check_encodable(job.documents, job.document_field)
    joint = mode is not PromptMode.SEPARATE
    layout = pair_layout(model, template=mode is PromptMode.TEMPLATE)
    num_specials = len(layout)
    # a pair keeps at least one token of each text
    if cuts.keep is not None and cuts.keep <= num_specials + (1 if joint else 0):
        raise InvalidRequestError(
            f"truncate_prompt_tokens must be more than the {num_specials} special tokens "
            f"{'and one query token ' if joint else ''}the model adds to every prompt",
            "truncate_prompt_tokens",
        )
    most, what = cuts.limit or (model.max_model_len, "max_model_len")
    limit = most - num_specials
    budget = limit if cuts.keep is None else cuts.keep - num_specials
    queries = _contents(model, job.queries, job.query_field, budget, cuts, cuts.max_query_tokens)
    documents = _contents(
        model, job.documents, job.document_field, budget, cuts, cuts.max_doc_tokens
    )
    if not joint:
        return [layout.join(ids, []) for ids in (*queries, *documents)]
    prompts = []
    for query, document in job.pairs:
        first, second = queries[query], documents[document]
        if cuts.keep is not None:
            first, second = _fit(first, second, budget, cuts.side)
        elif len(first) + len(second) > limit:
            raise InputTooLongError(
                f"{_name(job.document_field, document, len(job.documents))} with its "
                f"{job.query_field} makes {len(first) + len(second) + num_specials} tokens, more "
                f"than {what} ({most}). Please reduce the length of the input prompt, or set "
                "truncate_prompt_tokens",
                job.document_field,
            )
        prompts.append(layout.join(first, second))
    return prompts


def _contents(
    model: ModelHandle,
    texts: Sequence[str],
    field: str,
    budget: int,
    cuts: PairTruncation,
    own_cap: int | None,
) -> list[list[int]]:
    """Content tokens of each text: all of them, or the `want` at the kept side when capped."""
    capped = cuts.keep is not None or own_cap is not None
    want = min(budget, own_cap) if own_cap is not None else budget
    # uncapped, one token past the budget proves a text too long without reading the rest
    windows = content_windows(
        model.tokenizer,
        texts,
        want if capped else want + 1,
        cuts.side,
        model.limits.max_input_chars,
    )
    kept = []
    for index, window in enumerate(windows):
        name = _name(field, index, len(texts))
        if not capped and (not window.complete or len(window.ids) > want):
            most, what = cuts.limit or (model.max_model_len, "max_model_len")
            raise InputTooLongError(
                f"{name} has more than {most} tokens ({what}) with the special tokens. Please "
                "reduce the length of the input prompt, or set truncate_prompt_tokens",
                field,
            )
        if not window.complete and len(window.ids) < want:
            raise InputTooLongError(
                f"{name} has fewer than {want} tokens in the {window.num_chars} characters at "
                "its kept side, so it cannot be truncated exactly; shorten it or raise "
                "--max-input-chars",
                field,
            )
        kept.append(_cut(window.ids, want, cuts.side))
    return kept


def _fit(
    query: list[int], document: list[int], budget: int, side: TruncationSide
) -> tuple[list[int], list[int]]:
    """Cut the document first, then the query, until the pair fits `budget` content tokens."""
    if len(query) + len(document) <= budget:
        return query, document
    # the document keeps at least one token: a pair without its document scores nothing
    doc_keep = min(len(document), max(budget - len(query), 1))
    return _cut(query, budget - doc_keep, side), _cut(document, doc_keep, side)


def _cut(ids: list[int], keep: int, side: TruncationSide) -> list[int]:
    """At most `keep` tokens: the start when truncation keeps the right side off, else the end."""
    if len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[len(ids) - keep :]


def _name(field: str, index: int, count: int) -> str:
    """How a message names one item of a field: `documents`, or `documents 3` among several."""
    return field if count == 1 else f"{field} {index}"

"""A scoring job's prompts through the model's score template: each pair rendered, then tokenized.

The rendered text is tokenized whole, with the tokenizer's own special tokens, as vLLM and the
model cards' transformers recipes do (so a word never splits differently at the template's
seams). Truncation never cuts the template: a document (then a query) is cut to its own cap
(`max_tokens_per_doc`, `max_tokens_per_query`), and `truncate_prompt_tokens` cuts the document
by what the rendered prompt has too many.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from poolserve.frontend.jobs import ScoreJob, TruncationSide
from poolserve.frontend.pair_template import Prompt
from poolserve.frontend.pairs import PairTruncation, check_texts, pair_layout
from poolserve.frontend.score_template import ScoreTemplate, render_pair
from poolserve.frontend.state import ModelHandle
from poolserve.frontend.texts import InputTooLongError, check_encodable, run_budgeted
from poolserve.types.errors import InvalidRequestError

# a document cut to fit truncate_prompt_tokens is re-rendered at most this many times (a cut
# changes the tokens only where it falls, so the second render nearly always fits)
FIT_ROUNDS = 8


async def tokenize_templated(
    job: ScoreJob,
    model: ModelHandle,
    cuts: PairTruncation,
    on_reject: Callable[[str], None],
    whole: frozenset[int] = frozenset(),
) -> list[Prompt]:
    """The job's prompts, one per pair, tokenized under the tokenizing budget."""
    num_chars = check_texts(job, model, cuts)
    return await run_budgeted(
        model, num_chars, on_reject, templated_prompts, job, model, cuts, whole
    )


def templated_prompts(
    job: ScoreJob, model: ModelHandle, cuts: PairTruncation, whole: frozenset[int] = frozenset()
) -> list[Prompt]:
    """Each pair rendered by the model's score template and tokenized whole. A document in
    `whole` (an image's placeholder text, score_images.py) is never cut, nor measured here:
    its image's grid makes its prompt's length, checked once the image's size is known."""
    template = model.score_template
    assert template is not None  # plans.py sends only a model with a template here
    check_encodable(job.queries, job.query_field)
    check_encodable(job.documents, job.document_field)
    if job.instruction is not None:
        check_encodable([job.instruction], "instruction")
    queries = _capped(model, job.queries, cuts.max_query_tokens, cuts.side)
    documents = _capped(model, job.documents, cuts.max_doc_tokens, cuts.side, whole)
    layout = pair_layout(model, template=False)
    most, what = cuts.limit or (model.max_model_len, "max_model_len")
    budget = (most if cuts.keep is None else cuts.keep) - len(layout)
    texts = [render(model, template, job, queries[q], documents[d]) for q, d in job.pairs]
    prompts = []
    for (query, document), ids in zip(job.pairs, _encode(model, texts), strict=True):
        if document in whole:
            prompts.append(layout.join(ids, []))
            continue
        if len(ids) > budget and cuts.keep is None:
            raise InputTooLongError(
                f"{_name(job.document_field, document, len(job.documents))} with its "
                f"{job.query_field} makes {len(ids) + len(layout)} tokens in the score template, "
                f"more than {what} ({most}). Please reduce the length of the input prompt, or set "
                "truncate_prompt_tokens",
                job.document_field,
            )
        if len(ids) > budget:
            ids = _fit(model, template, job, queries[query], documents[document], ids, budget, cuts)
        prompts.append(layout.join(ids, []))
    return prompts


def render(
    model: ModelHandle, template: ScoreTemplate, job: ScoreJob, query: str, document: str
) -> str:
    """One pair's prompt text, with the job's instruction and template arguments."""
    return render_pair(
        model.tokenizer, template, query, document, job.instruction, job.template_kwargs
    )


def _fit(
    model: ModelHandle,
    template: ScoreTemplate,
    job: ScoreJob,
    query: str,
    document: str,
    ids: list[int],
    budget: int,
    cuts: PairTruncation,
) -> list[int]:
    """The pair's prompt with its document cut until the prompt has `budget` tokens at most."""
    doc_ids = _encode(model, [document])[0]
    keep = len(doc_ids)
    for _ in range(FIT_ROUNDS):
        keep -= max(len(ids) - budget, 1)
        if keep < 1:
            break
        text = _decode(model, _cut(doc_ids, keep, cuts.side))
        ids = _encode(model, [render(model, template, job, query, text)])[0]
        if len(ids) <= budget:
            return ids
    raise InvalidRequestError(
        f"truncate_prompt_tokens leaves no room for the {job.document_field}: the score template "
        f"and the {job.query_field} alone take more than {budget} tokens",
        "truncate_prompt_tokens",
    )


def _capped(
    model: ModelHandle,
    texts: Sequence[str],
    cap: int | None,
    side: TruncationSide,
    whole: frozenset[int] = frozenset(),
) -> list[str]:
    """Each text, cut to `cap` tokens at the kept side (None: as sent); those in `whole` as
    sent."""
    if cap is None:
        return list(texts)
    cut = [index for index in range(len(texts)) if index not in whole]
    encoded = dict(zip(cut, _encode(model, [texts[i] for i in cut]), strict=True))
    return [
        text
        if index not in encoded or len(encoded[index]) <= cap
        else _decode(model, _cut(encoded[index], cap, side))
        for index, text in enumerate(texts)
    ]


def _encode(model: ModelHandle, texts: Sequence[str]) -> list[list[int]]:
    """Content tokens of each text, without the tokenizer's special tokens."""
    if not texts:  # transformers' tokenizer refuses an empty batch
        return []
    encoded = model.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [list(ids) for ids in encoded]


def _decode(model: ModelHandle, ids: list[int]) -> str:
    """The text of content tokens, as written (no cleanup of spaces)."""
    return str(model.tokenizer.decode(ids, clean_up_tokenization_spaces=False))


def _cut(ids: list[int], keep: int, side: TruncationSide) -> list[int]:
    """At most `keep` tokens: the start when truncation keeps the right side off, else the end."""
    if len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[len(ids) - keep :]


def _name(field: str, index: int, count: int) -> str:
    """How a message names one item of a field: `documents`, or `documents 3` among several."""
    return field if count == 1 else f"{field} {index}"

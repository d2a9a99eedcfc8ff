"""A job checked before any work and how it becomes prompts: one planner per job kind.

A `Plan` holds what `submit_job` checks before admission (the parameters, the prompt count) and
the tokenization to run once admitted, which yields a `Batch` of token ids: one prompt per text
input or conversation (a sentence-transformers prompt prepended; late chunking's spans in the
parameters), or one per pair (laid out as the model was trained) or per text to compare.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from poolserve.frontend.adapters import choose_adapter
from poolserve.frontend.chat import render_conversations
from poolserve.frontend.client import EngineClient
from poolserve.frontend.images import pixel_values
from poolserve.frontend.inline_images import check_request, dual_item, image_refs, inline_prompts
from poolserve.frontend.jobs import MediaJob, Requested, ScoreJob, TextJob, merge
from poolserve.frontend.joined import join_inputs, with_ends
from poolserve.frontend.media import Budgets, MediaLimits, load_image
from poolserve.frontend.pairs import (
    PairTruncation,
    PromptMode,
    check_pairs,
    check_texts,
    tokenize_job,
)
from poolserve.frontend.prompt_images import InlinePrompts, check_image_count
from poolserve.frontend.prompts import prepend, prompt_length
from poolserve.frontend.score_images import check_image_pairs, image_pair_prompts
from poolserve.frontend.score_prompts import tokenize_templated
from poolserve.frontend.spans import CharSpans, LatePlan, check_late, late_prompts
from poolserve.frontend.state import ModelHandle, ServiceState
from poolserve.frontend.texts import (
    RawInputs,
    check_batch_size,
    check_encodable,
    check_prompt,
    run_budgeted,
    split_input,
    tokenize,
    truncation_for,
)
from poolserve.types.errors import InvalidRequestError
from poolserve.types.images import ImageInputs
from poolserve.types.params import PoolingParams
from poolserve.types.scoring import PairMode, job_scorer
from poolserve.types.tasks import PoolingTask
from poolserve.types.validation import check_public
from poolserve.types.vision import InlineImages, PromptImages, RetrievalForms

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    """A job's prompts as token ids, with the parameters they run under."""

    params: PoolingParams
    token_ids: list[list[int]]
    token_type_ids: Sequence[Sequence[int] | None] | None = None  # None: no prompt has types
    char_spans: CharSpans | None = None  # late chunking: each prompt's spans, in characters
    # per prompt, an image's pixel values (its token ids then placeholders) or None; None: texts
    pixels: Sequence[np.ndarray | None] | None = None
    # per prompt of a vision-language model, the images its placeholder runs stand for, in
    # order, or None; None: no prompt holds one
    media: Sequence[PromptImages | None] | None = None
    # gives back what the prompts hold of a process budget (images' patches) once submitted
    release: Callable[[], None] | None = None

    def released(self) -> None:
        """What the prompts hold given back (their images' patches are sent)."""
        if self.release is not None:
            self.release()


@dataclass(frozen=True)
class Plan:
    """A job checked before any work: its parameters, its prompt count, how to tokenize it."""

    params: PoolingParams
    num_prompts: int
    tokenize: Callable[[], Awaitable[Batch]]

    def through(self, adapter: str) -> Plan:
        """The plan with every prompt run through LoRA adapter `adapter` (the request's model);
        a job that chose another adapter (a jina-v3 task) is refused: one adapter per prompt."""
        if self.params.adapter is not None:
            raise InvalidRequestError(
                f"model {adapter!r} is a LoRA adapter: it cannot also run the model's task "
                f"adapter {self.params.adapter!r}",
                "task",
            )
        tokenize = self.tokenize

        async def adapted() -> Batch:
            batch = await tokenize()
            return replace(batch, params=replace(batch.params, adapter=adapter))

        return Plan(replace(self.params, adapter=adapter), self.num_prompts, adapted)


def plan_texts(job: TextJob, engine: EngineClient, model: ModelHandle, state: ServiceState) -> Plan:
    """One prompt per input (a sentence-transformers prompt prepended), or per conversation;
    with late chunking each input's spans ride in the parameters (spans.py)."""
    check_public(engine.pooling_info, job.task)  # a client never runs an internal task
    on_reject = state.metrics.model(model.model_name).on_reject
    chats = job.chats
    limit = model.settings.max_client_batch_size
    if chats is not None:
        check_batch_size(len(chats), limit, "messages")
    raw = None if chats is not None else split_input(job.inputs, limit)
    if job.late_chunking is not None and job.late_chunking.joined:
        raw, joined = join_inputs(raw)  # Jina's late_chunking: true, one document of them all
        job = replace(job, late_chunking=joined)
    if job.late_chunking is not None:
        check_late(job, raw, model, engine.max_model_len, limit)
    forms = _retrieval_forms(model)
    if raw is not None and raw.texts is not None and forms is not None:
        check_encodable(raw.texts, "input")  # the client's text, its positions its own
        # a retriever's text is a query, as its processor writes any text (ColQwen2)
        raw = RawInputs(tuple(forms.query(text) for text in raw.texts), None)
    prompt = None
    chosen = choose_adapter(job, model)
    if raw is not None:
        prompt = model.prompts.resolve(chosen.prompt_name, job.prompt, texts=raw.texts is not None)
    if raw is not None and prompt is not None:
        check_prompt(prompt, len(raw), model)
        raw = RawInputs(prepend(prompt, raw.texts or ()), None)
    params = replace(merge(job.task, job.requested, model.defaults), adapter=chosen.adapter)
    # vLLM's defaults: special tokens added to input, not on top of a chat template's
    specials = job.add_special_tokens if job.add_special_tokens is not None else chats is None
    if job.late_chunking is not None and raw is not None:
        late = LatePlan(job.late_chunking, raw.texts or (), len(prompt or ""), specials)
        return Plan(params, len(raw), lambda: _late_batch(late, params, engine, model, state))
    truncation = truncation_for(job.truncate, model)

    async def run() -> Batch:
        inputs = raw
        if chats is not None:  # vLLM's chat forms: their template adds the special tokens
            trusted = model.settings.trust_request_chat_template
            texts = await render_conversations(chats, model, trusted, on_reject)
            inputs = RawInputs(tuple(texts), None)
        assert inputs is not None
        pooled = params
        if prompt is not None:
            pooled = await _prompt_params(model, prompt, params, specials, on_reject)
        ids = await tokenize(inputs, model, truncation, on_reject, specials)
        if model.card.pad_texts_to is not None:
            ids = [padded(prompt, model) for prompt in ids]
        return Batch(pooled, ids)

    return Plan(params, len(chats) if chats is not None else len(raw or ()), run)


async def _late_batch(
    plan: LatePlan,
    params: PoolingParams,
    engine: EngineClient,
    model: ModelHandle,
    state: ServiceState,
) -> Batch:
    """Each text whole, its spans as token ranges in the parameters (one entry per prompt)."""
    limit = model.settings.max_client_batch_size
    on_reject = state.metrics.model(model.model_name).on_reject
    ids, spans, chars = await late_prompts(plan, model, engine.max_model_len, limit, on_reject)
    if plan.late.joined:
        # Jina's reference pools the document's special tokens and instruction too
        pairs = zip(spans, ids, strict=True)
        spans = tuple(with_ends(ranges, len(prompt)) for ranges, prompt in pairs)
    return Batch(replace(params, token_spans=spans), ids, char_spans=chars)


async def _prompt_params(
    model: ModelHandle,
    prompt: str,
    params: PoolingParams,
    add_special_tokens: bool,
    on_reject: Callable[[str], None],
) -> PoolingParams:
    """With include_prompt: false, an embedding pools past the prompt's tokens."""
    if model.prompts.include_prompt or params.task is not PoolingTask.EMBED:
        return params
    count = await run_budgeted(
        model,
        len(prompt),
        on_reject,
        prompt_length,
        model.tokenizer,
        prompt,
        add_special_tokens,
        inline=True,
    )
    return replace(params, prompt_tokens=count)


def _retrieval_forms(model: ModelHandle) -> RetrievalForms | None:
    """A late-interaction retriever's prompt forms (ColQwen2's processor); None for others."""
    inline = model.card.inline_images
    return None if inline is None else inline.retrieval


def plan_pairs(
    job: ScoreJob, engine: EngineClient, model: ModelHandle, state: ServiceState
) -> Plan:
    """One prompt per pair (laid out as the model was trained), or one per text to compare."""
    check_pairs(job, model.settings.max_client_batch_size)
    task, joint = job.task, True
    if task is PoolingTask.SCORE:
        scorer = job_scorer(engine.pooling_info, job.mode_weights)
        task, joint = scorer.task, scorer.mode is PairMode.JOINT
    if not joint and job.use_activation is not None:
        logger.debug("use_activation ignored: %s compares embeddings", model.served_name)
    requested = Requested(use_activation=job.use_activation if joint else None)
    params = merge(task, requested, model.defaults)
    truncation = truncation_for(job.truncate, model)
    cuts = PairTruncation(
        truncation.keep,
        truncation.side,
        job.max_tokens_per_doc,
        job.max_tokens_per_query,
        truncation.most(model),
    )
    forms = _retrieval_forms(model)
    if forms is not None and not job.document_items:
        # the client's texts checked as any model's (empty, too long, not Unicode), then
        # written as queries, as the retriever's processor writes every text (image
        # documents: score_images.py)
        check_texts(job, model, cuts)
        check_encodable(job.queries, job.query_field)
        check_encodable(job.documents, job.document_field)
        job = replace(
            job,
            queries=tuple(forms.query(text) for text in job.queries),
            documents=tuple(forms.query(text) for text in job.documents),
        )
    mode = _joint_mode(model, engine.pooling_info.is_decoder) if joint else PromptMode.SEPARATE
    # a yes/no LLM (or a model declaring one) renders each pair by its score template
    templated = joint and model.score_template is not None
    if job.instruction is not None and not (templated and _takes_instruction(model)):
        logger.debug("instruction ignored: %s has no instruction slot", model.served_name)
    # decoders take no token type ids, whatever the tokenizer's pair template gives
    typed_model = model.card.num_token_types > 0
    # image documents: read inside the score template's prompt, checked before any work
    inline = check_image_pairs(job, model, joint) if job.document_items else None

    async def run() -> Batch:
        on_reject = state.metrics.model(model.model_name).on_reject
        if inline is not None:
            limits, budgets = MediaLimits.from_settings(model.settings), state.media_budgets
            made = await image_pair_prompts(job, model, inline, cuts, limits, budgets, on_reject)
            return _inline_batch(params, made)
        if templated:
            prompts = await tokenize_templated(job, model, cuts, on_reject)
        else:
            prompts = await tokenize_job(job, model, mode, cuts, on_reject)
        types = [p.token_type_ids for p in prompts]
        typed = typed_model and any(t is not None for t in types)
        ids = [p.token_ids for p in prompts]
        if not joint and model.card.pad_texts_to is not None:  # each text as the model embeds it
            ids = [padded(list(prompt), model) for prompt in ids]
        return Batch(params, ids, types if typed else None)

    count = len(job.pairs) if joint else len(job.queries) + len(job.documents)
    return Plan(params, count, run)


def _takes_instruction(model: ModelHandle) -> bool:
    """Whether the model's score template has an instruction slot."""
    return model.score_template is not None and model.score_template.has_instruction


def _joint_mode(model: ModelHandle, is_decoder: bool) -> PromptMode:
    """vLLM's layout of a pair (use_sep_token): the tokenizer's pair template, or, for an LLM
    read through LM-head rows, the two texts as one; a decoder tokenizer without a pair
    template joins the two texts too, as tokenizer(query, document) then does."""
    if not model.card.pair_separator:
        return PromptMode.CONCATENATE
    if is_decoder and model.pair_template is None:
        return PromptMode.CONCATENATE
    return PromptMode.TEMPLATE


def plan_media(
    job: MediaJob, engine: EngineClient, model: ModelHandle, state: ServiceState
) -> Plan:
    """One prompt per item, refused before any work unless the model takes images: for a
    vision-language model each image inside its conversation (inline_images.py); for a dual
    encoder an image loaded and turned into the model's pixel values, or a text tokenized,
    where the task gives one vector per input."""
    images, inline = model.card.images, model.card.inline_images
    if images is None and inline is None:
        where = next((r.where for item in job.items for r in image_refs(item)), "input")
        raise InvalidRequestError(
            f"model {model.served_name!r} takes no images: send text", where.split("[")[0]
        )
    if inline is not None:
        return _plan_inline(job, engine, model, state, inline)
    assert images is not None
    if job.task is not PoolingTask.EMBED:
        raise InvalidRequestError(
            f"task {job.task.value!r} does not take images: an image gives one embedding "
            "(task 'embed')",
            "task",
        )
    check_batch_size(len(job.items), model.settings.max_client_batch_size, "input")
    _check_image_count(job, model.settings.max_images_per_request)
    items = tuple(dual_item(item) for item in job.items)
    params = merge(job.task, job.requested, model.defaults)
    truncation = truncation_for(job.truncate, model)
    limits = MediaLimits.from_settings(model.settings)

    async def run() -> Batch:
        on_reject = state.metrics.model(model.model_name).on_reject
        texts = tuple(item.text or "" for item in items if item.image is None)
        for item in items:
            if item.image is None and not item.text:
                raise InvalidRequestError(f"{item.where} is empty", item.where)
        ids_of_texts = (
            await tokenize(RawInputs(texts, None), model, truncation, on_reject) if texts else []
        )
        tokenized = iter(ids_of_texts)
        pixels = await asyncio.gather(
            *(
                _pixels(item.image, item.where, images, limits, state.media_budgets)
                for item in items
                if item.image
            )
        )
        loaded = iter(pixels)
        ids: list[list[int]] = []
        per_prompt: list[np.ndarray | None] = []
        for item in items:
            if item.image is None:
                ids.append(padded(next(tokenized), model))
                per_prompt.append(None)
            else:
                ids.append([0] * images.num_tokens)  # its placeholder: the tokens it costs
                per_prompt.append(next(loaded))
        return Batch(params, ids, pixels=per_prompt)

    return Plan(params, len(items), run)


def _plan_inline(
    job: MediaJob,
    engine: EngineClient,
    model: ModelHandle,
    state: ServiceState,
    inline: InlineImages,
) -> Plan:
    """A vision-language model's prompts: each conversation (a bare image: one of its own)
    rendered with its images inside, each text a text; any task the model serves."""
    check_public(engine.pooling_info, job.task)
    check_batch_size(len(job.items), model.settings.max_client_batch_size, "input")
    _check_image_count(job, model.settings.max_images_per_request)
    params = merge(job.task, job.requested, model.defaults)
    trusted = model.settings.trust_request_chat_template
    request = check_request(job.items, model, job.truncate, trusted)
    limits = MediaLimits.from_settings(model.settings)

    async def run() -> Batch:
        on_reject = state.metrics.model(model.model_name).on_reject
        made = await inline_prompts(request, model, inline, limits, state.media_budgets, on_reject)
        return _inline_batch(params, made)

    return Plan(params, len(job.items), run)


def _inline_batch(params: PoolingParams, made: InlinePrompts) -> Batch:
    """A vision-language model's prompts with their images (given back once sent); of texts
    alone, nothing is held and they take the text path."""
    if all(m is None for m in made.media):
        made.release()
        return Batch(params, made.token_ids)
    return Batch(params, made.token_ids, media=made.media, release=made.release)


def _check_image_count(job: MediaJob, limit: int) -> None:
    """400 before any image is loaded when the request holds more than `limit` images."""
    check_image_count([ref for item in job.items for ref in image_refs(item)], limit)


async def _pixels(
    ref: str, where: str, images: ImageInputs, limits: MediaLimits, budgets: Budgets
) -> np.ndarray:
    """An image reference as the model's pixel values (decoding and processing off the loop)."""
    image = await load_image(ref, limits, budgets, what=where)
    return await asyncio.to_thread(pixel_values, image, images.processing)


def padded(ids: list[int], model: ModelHandle) -> list[int]:
    """A text's ids padded with the pad token to the length the model was trained on (SigLIP's
    texts; `pad_texts_to`); longer prompts are left for the length check to refuse."""
    length = model.card.pad_texts_to
    pad = model.tokenizer.pad_token_id
    if length is None or len(ids) >= length or pad is None:
        return ids
    return ids + [pad] * (length - len(ids))


# job kind -> how it is checked and tokenized; everything else is the same for every job
PLANNERS: dict[type, Callable[..., Plan]] = {
    TextJob: plan_texts,
    ScoreJob: plan_pairs,
    MediaJob: plan_media,
}

"""vLLM's multimodal documents scored by a vision-language reranker through its score template
(Qwen3-VL-Reranker: `--hf-overrides` reading its LM head's "no" and "yes" rows, and
`--score-template`).

vLLM renders such a pair with the document's content the model's image text (its vision
start, placeholder and vision end tokens: `<|vision_start|><|image_pad|><|vision_end|>`) and
tokenizes the rendered prompt whole; so does this module, and the image is then placed as
inside a conversation (prompt_images.py): the checks before any patch is cut, the placeholder
repeated for the image's grid, the patch budget. An image's pair is never cut (its
placeholder must match its image); a text document of the same request stays a text,
rendered and cut as score_prompts.py does. A dual encoder or a vision-language embedder
compares embeddings instead (the route's MediaJob), as vLLM scores an embedding model's pairs.

A late-interaction retriever (ColQwen2) takes the same job but embeds each query and each
document on its own, as its processor writes them (inline_images.py: a text a query, an image
the visual prompt), and scores each pair by MaxSim of their token vectors, as vLLM scores a
late-interaction model's multimodal documents.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from poolserve.frontend.client import EngineClient
from poolserve.frontend.inline_images import (
    Conversation,
    InlineRequest,
    inline_prompts,
    retrieval_document,
)
from poolserve.frontend.jobs import MediaItem, ScoreJob
from poolserve.frontend.media import Budgets, MediaLimits
from poolserve.frontend.pairs import PairTruncation
from poolserve.frontend.prompt_images import (
    ImageRef,
    InlinePrompts,
    LengthBound,
    check_image_count,
    place_images,
)
from poolserve.frontend.score_prompts import tokenize_templated
from poolserve.frontend.state import ModelHandle
from poolserve.frontend.texts import Truncation, check_encodable
from poolserve.types.errors import InvalidRequestError
from poolserve.types.scoring import PairMode, scorer_plan
from poolserve.types.vision import InlineImages


@dataclass(frozen=True)
class PairImages:
    """One pair's image (none for a text document) and where the body holds its document."""

    images: tuple[ImageRef, ...]
    where: str


def reads_images_in_pairs(engine: EngineClient, model: ModelHandle) -> bool:
    """Whether the model scores image documents as a scoring job (a vision-language model read
    as a reranker, inside each pair's prompt; a retriever, by MaxSim of each query's and
    document's own token vectors), rather than by the cosine of two embeddings."""
    if model.card.inline_images is None:
        return False
    if model.card.inline_images.retrieval is not None:
        return True
    return scorer_plan(engine.pooling_info).mode is PairMode.JOINT


def check_image_pairs(job: ScoreJob, model: ModelHandle, joint: bool) -> InlineImages:
    """400 before any work unless the model reads images inside its score template's prompt
    (`joint`: it scores each pair as one prompt), and for more images than
    --max-images-per-request; the model's image facts."""
    inline = model.card.inline_images
    field = job.document_field
    if inline is None:
        raise InvalidRequestError(f"model {model.served_name!r} takes no images: send text", field)
    if inline.retrieval is not None:  # each text and image embedded on its own
        check_image_count(
            [ref for item in job.document_items for ref in _item_images(item)],
            model.settings.max_images_per_request,
        )
        return inline
    if not joint:
        raise InvalidRequestError(
            f"model {model.served_name!r} compares embeddings: an image document is embedded "
            "on its own, not read inside a pair's prompt",
            field,
        )
    if model.score_template is None:
        raise InvalidRequestError(
            f"model {model.served_name!r} reads an image document only inside a score "
            "template's prompt, and it has none: serve it with --score-template (vLLM's "
            "qwen3_vl_reranker.jinja for Qwen3-VL-Reranker)",
            field,
        )
    check_image_count(
        [ref for pair in _pair_images(job) for ref in pair.images],
        model.settings.max_images_per_request,
    )
    return inline


async def image_pair_prompts(
    job: ScoreJob,
    model: ModelHandle,
    inline: InlineImages,
    cuts: PairTruncation,
    limits: MediaLimits,
    budgets: Budgets,
    on_reject: Callable[[str], None],
) -> InlinePrompts:
    """Each pair's prompt, an image document rendered as the model's image text, tokenized
    whole (score_prompts.py), then its image placed (prompt_images.py). A retriever's prompts
    are each query's, then each document's, on its own."""
    if inline.retrieval is not None:
        return await _retrieval_prompts(job, model, inline, cuts, limits, budgets, on_reject)
    items = job.document_items
    images = frozenset(i for i, item in enumerate(items) if item.image is not None)
    texts = tuple(
        inline.placeholder if i in images else document for i, document in enumerate(job.documents)
    )
    rendered = await tokenize_templated(
        replace(job, documents=texts), model, cuts, on_reject, whole=images
    )
    most, limit_name = cuts.limit or (model.max_model_len, "max_model_len")
    keep = most if cuts.keep is None else min(cuts.keep, most)
    bound = LengthBound(keep, most, limit_name, "score template")
    ids = [prompt.token_ids for prompt in rendered]
    return await place_images(_pair_images(job), ids, inline, bound, limits, budgets)


def _pair_images(job: ScoreJob) -> list[PairImages]:
    """Each pair's image, in pair order (none for a text document)."""
    pairs = []
    for _, document in job.pairs:
        item = job.document_items[document]
        pairs.append(PairImages(_item_images(item), item.where))
    return pairs


def _item_images(item: MediaItem) -> tuple[ImageRef, ...]:
    """A document's image (none for a text)."""
    return () if item.image is None else (ImageRef(item.image, item.where),)


async def _retrieval_prompts(
    job: ScoreJob,
    model: ModelHandle,
    inline: InlineImages,
    cuts: PairTruncation,
    limits: MediaLimits,
    budgets: Budgets,
    on_reject: Callable[[str], None],
) -> InlinePrompts:
    """A retriever's prompts, the queries' then the documents', each on its own: a text (query
    or document) in the processor's query form, an image in its visual prompt, never cut."""
    forms = inline.retrieval
    assert forms is not None
    prompts: list[str | Conversation] = list(job.queries)
    for item, text in zip(job.document_items, job.documents, strict=True):
        prompts.append(text if item.image is None else retrieval_document(item, forms))
    for where, prompt in zip(_wheres(job), prompts, strict=True):
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequestError(f"{where} is empty", where)
        if isinstance(prompt, str):
            check_encodable((prompt,), where)  # before its query form shifts its positions
    most, _ = cuts.limit or (model.max_model_len, "max_model_len")
    keep = most if cuts.keep is None else min(cuts.keep, most)
    request = InlineRequest(
        tuple(prompts),
        sum(p.num_chars for p in prompts if isinstance(p, Conversation)),
        Truncation(cuts.keep, cuts.side, None if cuts.limit is None else cuts.limit[0]),
        keep,
    )
    return await inline_prompts(request, model, inline, limits, budgets, on_reject)


def _wheres(job: ScoreJob) -> list[str]:
    """Where each query and document is in the body."""
    queries = [f"{job.query_field}[{i}]" for i in range(len(job.queries))]
    return queries + [item.where for item in job.document_items]

"""vLLM's /score and vLLM/Jina/Cohere /rerank: bodies into scoring jobs, scores into answers.

`POST /rerank` is shared with TEI's and Infinity's bodies: `service/dispatch.py` picks by shape.
Shapes and rules follow vLLM 0.33's scoring protocol (`ScoringRequestMixin`, `ScoreRequest`,
`RerankRequest`, `ServingScores`); `/v2/rerank` applies Cohere's document truncation default.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from poolserve.frontend.encoding import dumps
from poolserve.frontend.jobs import MediaItem, MediaJob, Requested, ScoreJob, Truncate
from poolserve.frontend.pipeline import check_serving, gather
from poolserve.frontend.score_images import reads_images_in_pairs
from poolserve.frontend.scoring import Scored, best_first
from poolserve.http.api.schemas import (
    Documents,
    MultiModalDocuments,
    RerankRequestBody,
    ScoreRequestBody,
)
from poolserve.http.bodies import ContentPart, ImageUrlPart, TextPart
from poolserve.http.calls import answer, score, service_state, submit
from poolserve.http.routing import StrictJSONRoute
from poolserve.types.errors import InvalidRequestError, RouteNotServedError, UnsupportedTaskError
from poolserve.types.scoring import cosine_score, scorer_plan
from poolserve.types.tasks import PoolingTask

logger = logging.getLogger(__name__)
router = APIRouter(route_class=StrictJSONRoute)


@dataclass(frozen=True)
class Defaults:
    """What a rerank route assumes for the fields a client left out."""

    max_tokens_per_doc: int  # 0: documents are not cut on their own
    truncate_prompt_tokens: int | None  # None: a pair longer than the model is a 400


# vLLM: nothing is cut unless asked. Cohere cuts each document to 4096 tokens by default and
# scores what fits the model; its SDK cannot send vLLM's truncation fields, so /v2/rerank does so.
VLLM = Defaults(max_tokens_per_doc=0, truncate_prompt_tokens=None)
COHERE = Defaults(max_tokens_per_doc=4096, truncate_prompt_tokens=-1)


def _as_tuple(texts: str | list[str]) -> tuple[str, ...]:
    """vLLM takes one text or a list wherever it takes texts."""
    return (texts,) if isinstance(texts, str) else tuple(texts)


def _options(
    body: ScoreRequestBody | RerankRequestBody, request: Request, defaults: Defaults
) -> dict[str, Any]:
    """The scoring job's options, after vLLM's checks of its per-text token limits."""
    engine, model = check_serving(service_state(request), body.model)
    try:
        scorer_plan(engine.pooling_info)
    except UnsupportedTaskError as exc:  # vLLM serves no score route for it: 404
        raise RouteNotServedError(str(exc)) from None
    doc_cap = body.max_tokens_per_doc
    if doc_cap is not None and doc_cap <= 0:  # vLLM's words
        raise InvalidRequestError(
            "max_tokens_per_doc must be a positive integer", "max_tokens_per_doc"
        )
    limits = (("max_tokens_per_query", body.max_tokens_per_query), ("max_tokens_per_doc", doc_cap))
    for name, value in limits:
        # vLLM's rule; Cohere's own default and larger caps simply give way to the model's length
        if value and defaults is VLLM and value >= model.max_model_len:
            raise InvalidRequestError(
                f"{name} ({value}) must be less than max_model_len ({model.max_model_len})", name
            )
    if doc_cap is None:
        doc_cap = defaults.max_tokens_per_doc
    tokens = body.truncate_prompt_tokens
    return {
        "model": body.model,
        "truncate": Truncate(
            defaults.truncate_prompt_tokens if tokens is None else tokens, body.truncation_side
        ),
        "use_activation": body.use_activation,
        "priority": body.priority,
        "max_tokens_per_doc": doc_cap or None,
        "max_tokens_per_query": body.max_tokens_per_query or None,
        "instruction": body.instruction,
        "template_kwargs": body.chat_template_kwargs,
        "mode_weights": _weights(body.weights_for_different_modes),
    }


def _weights(weights: list[float] | None) -> tuple[float, ...] | None:
    """FlagEmbedding's weights_for_different_modes as the job carries them."""
    return None if weights is None else tuple(weights)


def _response_id(request: Request, body: ScoreRequestBody | RerankRequestBody) -> str:
    """vLLM's id for both scoring routes: score-, then x-request-id, the body's, or a new one."""
    state = request.state
    if body.request_id is not None and not getattr(state, "request_id_given", False):
        state.request_id = body.request_id  # the edge echoes it in x-request-id
    return f"score-{getattr(state, 'request_id', None) or uuid.uuid4().hex}"


def _prompt_tokens(job: ScoreJob, scored: Scored, request: Request) -> int:
    """vLLM's count: each pair's prompt; a compared pair counts both texts and one pad token."""
    if len(scored.outputs) == len(job.pairs):  # one prompt per pair
        return scored.num_prompt_tokens
    model = service_state(request).served[scored.model_name].handle  # the model that scored
    pad = int(model.tokenizer.pad_token_id is not None)
    queries, documents = scored.outputs[: len(job.queries)], scored.outputs[len(job.queries) :]
    return sum(
        queries[q].num_prompt_tokens + pad + documents[d].num_prompt_tokens for q, d in job.pairs
    )


def _has_images(documents: Documents) -> bool:
    """Whether vLLM's multimodal documents hold an image (text parts alone are texts)."""
    return isinstance(documents, MultiModalDocuments) and any(
        isinstance(part, ImageUrlPart) for part in documents.content
    )


def _texts(documents: Documents) -> tuple[str, ...]:
    """Texts, or multimodal documents of text parts only as their texts."""
    if isinstance(documents, MultiModalDocuments):
        return tuple(part.text for part in documents.content if isinstance(part, TextPart))
    return _as_tuple(documents)


def _media_items(documents: MultiModalDocuments, field: str) -> tuple[MediaItem, ...]:
    """vLLM's multimodal documents: each content part one document, a text or an image."""
    return tuple(
        MediaItem(image=part.image_url.url, where=f"{field}.content[{i}]")
        if isinstance(part, ImageUrlPart)
        else MediaItem(text=part.text, where=f"{field}.content[{i}]")
        for i, part in enumerate(documents.content)
    )


async def _media_scores(
    request: Request,
    body: ScoreRequestBody | RerankRequestBody,
    queries: tuple[str, ...],
    documents: tuple[MediaItem, ...],
    defaults: Defaults,
    fields: tuple[str, str],
) -> Scored:
    """Each document against its query (one query: all of them): inside each pair's prompt,
    rendered by its score template, for a vision-language reranker (Qwen3-VL-Reranker), as
    vLLM scores it; else by the cosine of their embeddings, texts and images in one job (a
    dual encoder: CLIP, SigLIP, SigLIP 2; a vision-language embedder, each image document a
    one-message conversation of it)."""
    options = _options(body, request, defaults)
    if reads_images_in_pairs(*check_serving(service_state(request), body.model)):
        return await score(request, ScoreJob.of_items(queries, documents, fields, **options))
    items = (*(MediaItem(text=q, where=f"query[{i}]") for i, q in enumerate(queries)), *documents)
    job = MediaJob(
        PoolingTask.EMBED,
        items,
        Requested(normalize=False),
        options["model"],
        options["truncate"],
        options["priority"],
    )
    run = await submit(request, job)
    outputs = await gather(run)
    firsts, seconds = outputs[: len(queries)], outputs[len(queries) :]
    scores = tuple(
        cosine_score(firsts[0 if len(firsts) == 1 else i].data, second.data)
        for i, second in enumerate(seconds)
    )
    return Scored(scores, tuple(outputs), run.num_prompt_tokens, run.model.served_name)


@router.post("/score")
@router.post("/v1/score")
async def score_texts(body: ScoreRequestBody, request: Request) -> Response:
    """vLLM's score API: each query with its document, one score per pair."""
    form = body.form
    assert form is not None  # the schema refuses a body without one
    first_field, second_field = form
    firsts = _as_tuple(getattr(body, first_field))
    second = getattr(body, second_field)
    if _has_images(second):
        return await _score_media(body, request, firsts, _media_items(second, second_field), form)
    seconds = _texts(second)
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise InvalidRequestError(
            f"{first_field} has {len(firsts)} texts and {second_field} {len(seconds)}: pair "
            "them 1:1, 1:N or N:N",
            second_field,
        )
    pairs = tuple((0 if len(firsts) == 1 else i, i) for i in range(len(seconds)))
    options = _options(body, request, VLLM)
    job = ScoreJob(firsts, seconds, pairs, first_field, second_field, **options)
    scored = await score(request, job)
    tokens = _prompt_tokens(job, scored, request)
    reply = {
        "id": _response_id(request, body),
        "object": "list",
        "created": int(time.time()),
        "model": scored.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scored.scores)],
        # vLLM's UsageInfo, as it serializes it
        "usage": {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }
    return await answer(request, scored.outputs, lambda: dumps(reply))


async def _score_media(
    body: ScoreRequestBody,
    request: Request,
    firsts: tuple[str, ...],
    seconds: tuple[MediaItem, ...],
    fields: tuple[str, str],
) -> Response:
    """/score with vLLM's multimodal documents, answered as for texts."""
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise InvalidRequestError("pair the queries with the documents 1:1, 1:N or N:N", "queries")
    scored = await _media_scores(request, body, firsts, seconds, VLLM, fields)
    tokens = scored.num_prompt_tokens
    reply = {
        "id": _response_id(request, body),
        "object": "list",
        "created": int(time.time()),
        "model": scored.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scored.scores)],
        "usage": {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }
    return await answer(request, scored.outputs, lambda: dumps(reply))


@router.post("/v1/rerank")
async def rerank(body: RerankRequestBody, request: Request) -> Response:
    """vLLM's (and Jina's) rerank: results best first, top_n of them (0: all)."""
    return await _rerank(body, request, VLLM)


@router.post("/v2/rerank")
async def rerank_v2(body: RerankRequestBody, request: Request) -> Response:
    """Cohere's rerank as vLLM answers it, with Cohere's document truncation by default."""
    return await _rerank(body, request, COHERE)


async def _rerank(body: RerankRequestBody, request: Request, defaults: Defaults) -> Response:
    """The body as one scoring job, then its results best first."""
    if body.relevant_spans is not None:
        logger.debug("relevant_spans ignored: no spans are computed")
    if isinstance(body.documents, MultiModalDocuments) and _has_images(body.documents):
        return await _rerank_media(body, request, defaults, body.documents)
    documents = _texts(body.documents)
    options = _options(body, request, defaults)
    job = ScoreJob.one_query(body.query, documents, "documents", **options)
    scored = await score(request, job)
    order = best_first(scored.scores, body.top_n)
    results = [
        {"index": i, "document": {"text": documents[i]}, "relevance_score": scored.scores[i]}
        if body.return_documents
        else {"index": i, "relevance_score": scored.scores[i]}
        for i in order
    ]
    tokens = _prompt_tokens(job, scored, request)
    reply = {
        "id": _response_id(request, body),
        "model": scored.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},  # vLLM's RerankUsage
        "results": results,
    }
    return await answer(request, scored.outputs, lambda: dumps(reply))


async def _rerank_media(
    body: RerankRequestBody,
    request: Request,
    defaults: Defaults,
    documents: MultiModalDocuments,
) -> Response:
    """Rerank of vLLM's multimodal documents; a returned document is its content part."""
    items = _media_items(documents, "documents")
    fields = ("query", "documents")
    scored = await _media_scores(request, body, (body.query,), items, defaults, fields)
    scores, parts = scored.scores, documents.content
    results = [
        {"index": i, "relevance_score": scores[i]}
        | ({"document": _document(parts[i])} if body.return_documents else {})
        for i in best_first(scores, body.top_n)
    ]
    tokens = scored.num_prompt_tokens
    reply = {
        "id": _response_id(request, body),
        "model": scored.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }
    return await answer(request, scored.outputs, lambda: dumps(reply))


def _document(part: ContentPart) -> dict[str, Any]:
    """vLLM's RerankDocument of one content part: its text, or the part itself."""
    if isinstance(part, ImageUrlPart):
        return {"multi_modal": part.model_dump(exclude_none=True)}
    return {"text": part.text}

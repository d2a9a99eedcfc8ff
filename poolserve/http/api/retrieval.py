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
from poolserve.frontend.jobs import ScoreJob, Truncate
from poolserve.frontend.pipeline import check_serving
from poolserve.frontend.scoring import Scored, best_first
from poolserve.http.api.schemas import RerankRequestBody, ScoreRequestBody
from poolserve.http.calls import answer, score, service_state
from poolserve.http.routing import StrictJSONRoute
from poolserve.types.errors import InvalidRequestError, RouteNotServedError, UnsupportedTaskError
from poolserve.types.scoring import scorer_plan

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


@router.post("/score")
@router.post("/v1/score")
async def score_texts(body: ScoreRequestBody, request: Request) -> Response:
    """vLLM's score API: each query with its document, one score per pair."""
    form = body.form
    assert form is not None  # the schema refuses a body without one
    first_field, second_field = form
    firsts = _as_tuple(getattr(body, first_field))
    seconds = _as_tuple(getattr(body, second_field))
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
    documents = _as_tuple(body.documents)
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

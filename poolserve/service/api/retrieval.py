"""vLLM's /score and vLLM/Jina/Cohere /rerank: bodies into scoring jobs, scores into answers.

`POST /rerank` is shared with TEI's and Infinity's bodies: `service/dispatch.py` picks by shape.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from poolserve.service.api.schemas import RerankRequestBody, ScoreRequestBody
from poolserve.service.errors import InvalidRequestError
from poolserve.service.frontend.encoding import StrictJSONRoute, answer, dumps
from poolserve.service.frontend.jobs import ScoreJob, Truncate
from poolserve.service.frontend.scoring import score

logger = logging.getLogger(__name__)
router = APIRouter(route_class=StrictJSONRoute)


def _options(body: ScoreRequestBody | RerankRequestBody) -> dict[str, Any]:
    """The scoring options both vLLM shapes share."""
    return {
        "model": body.model,
        "truncate": Truncate(body.truncate_prompt_tokens, body.truncation_side),
        "use_activation": body.use_activation,
        "priority": body.priority,
    }


@router.post("/score")
@router.post("/v1/score")
async def score_texts(body: ScoreRequestBody, request: Request) -> Response:
    """vLLM's score API: text_1 against text_2, one score per pair."""
    firsts = (body.text_1,) if isinstance(body.text_1, str) else tuple(body.text_1)
    seconds = (body.text_2,) if isinstance(body.text_2, str) else tuple(body.text_2)
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise InvalidRequestError(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: pair them 1:1, 1:N or N:N",
            "text_2",
        )
    pairs = tuple((0 if len(firsts) == 1 else i, i) for i in range(len(seconds)))
    scored = await score(
        request, ScoreJob(firsts, seconds, pairs, "text_1", "text_2", **_options(body))
    )
    usage = {"prompt_tokens": scored.num_prompt_tokens, "total_tokens": scored.num_prompt_tokens}
    reply = {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": scored.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scored.scores)],
        # vLLM's UsageInfo, as it serializes it
        "usage": {**usage, "completion_tokens": 0, "prompt_tokens_details": None},
    }
    return await answer(request, scored.outputs, lambda: dumps(reply))


@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequestBody, request: Request) -> Response:
    """Jina's and Cohere's rerank as vLLM serves it: results best first, top_n of them."""
    if body.relevant_spans is not None:
        logger.debug("relevant_spans ignored: no spans are computed")
    documents = tuple(body.documents)
    job = ScoreJob.one_query(
        body.query,
        documents,
        "documents",
        **_options(body),
        max_tokens_per_doc=body.max_tokens_per_doc,
    )
    scored = await score(request, job)
    # a stable sort: equal scores keep their input order, as vLLM's does
    order = sorted(range(len(documents)), key=lambda i: -scored.scores[i])[: body.top_n]
    results = [
        {"index": i, "document": {"text": documents[i]}, "relevance_score": scored.scores[i]}
        if body.return_documents
        else {"index": i, "relevance_score": scored.scores[i]}
        for i in order
    ]
    reply = {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": scored.model_name,
        "usage": {
            "prompt_tokens": scored.num_prompt_tokens,
            "total_tokens": scored.num_prompt_tokens,
        },
        "results": results,
    }
    return await answer(request, scored.outputs, lambda: dumps(reply))

"""Retrieval routes: vLLM's /score, vLLM/Jina/Cohere /rerank (and TEI's on the same path)."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from poolserve.pooling.params import PoolingParams, PoolingTask
from poolserve.pooling.scorers import PairMode, ScorerPlan, scorer_plan
from poolserve.scheduler.request import PoolingOutput
from poolserve.service.compat import infinity, tei
from poolserve.service.encoding import StrictJSONRoute, dumps
from poolserve.service.errors import InvalidRequestError
from poolserve.service.inputs import truncation_for
from poolserve.service.pairs import PairTruncation, PromptMode, ScoreJob, tokenize_job
from poolserve.service.runs import (
    Submitted,
    admitted,
    check_serving,
    encoded,
    gather,
    service_state,
    timing_headers,
    tokenized,
)
from poolserve.service.schemas import RerankRequestBody, ScoreRequestBody, TEIRerankRequest

logger = logging.getLogger(__name__)
router = APIRouter(route_class=StrictJSONRoute)
B = TypeVar("B", bound=BaseModel)


def _body_schema(*models: type[BaseModel]) -> dict[str, Any]:
    """An OpenAPI request body that is any one of the models (none of them nests another)."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"anyOf": [m.model_json_schema() for m in models]}}
            },
        }
    }


@dataclass(frozen=True)
class Scored:
    """A job's scores in pair order, with what the answer reports about the run."""

    scores: tuple[float, ...]
    outputs: tuple[PoolingOutput, ...]
    num_prompt_tokens: int
    model_name: str


async def run_job(request: Request, job: ScoreJob) -> Scored:
    """Admission, tokenization off the loop, all-or-nothing submission, then the scores."""
    state = service_state(request)
    request.state.task = PoolingTask.SCORE.value
    engine, model = check_serving(state, job.model)
    plan = scorer_plan(engine.pooling_info)
    joint = plan.mode is PairMode.JOINT
    _check_sizes(job, state.settings.max_client_batch_size)
    if not joint and job.use_activation is not None:
        logger.debug(
            "use_activation ignored: %s scores pairs by comparing embeddings", model.served_name
        )
    params = PoolingParams(task=plan.task, use_activation=job.use_activation if joint else None)
    engine.check_params(params)
    engine.precheck(len(job.pairs) if joint else len(job.queries) + len(job.documents))
    truncation = truncation_for(
        job.truncate_prompt_tokens, job.truncation_side, model, truncate=job.truncate
    )
    cuts = PairTruncation(truncation.keep, truncation.side, job.max_tokens_per_doc)
    started = time.monotonic()
    mode = _prompt_mode(joint, engine.pooling_info.is_decoder)
    prompts = await tokenize_job(job, model, mode, cuts, state.metrics.on_reject)
    num_tokens = sum(len(p.token_ids) for p in prompts)
    tokenized(request, started, len(prompts), num_tokens)
    types = [p.token_type_ids for p in prompts]
    futures = engine.submit_many(
        [p.token_ids for p in prompts],
        params,
        job.priority,
        types if any(t is not None for t in types) else None,
    )
    admitted(request, num_tokens)
    outputs = await gather(request, Submitted(engine, model, tuple(futures), num_tokens))
    return Scored(_scores(job, outputs, plan), tuple(outputs), num_tokens, model.served_name)


def _prompt_mode(joint: bool, is_decoder: bool) -> PromptMode:
    """Encoders lay a pair out as their tokenizer does; decoders score the concatenation."""
    if not joint:
        return PromptMode.SEPARATE
    # vLLM scores causal LM rerankers on the plain concatenation, without separator tokens
    return PromptMode.CONCATENATE if is_decoder else PromptMode.TEMPLATE


def _check_sizes(job: ScoreJob, max_batch: int) -> None:
    """400 for an empty side or more pairs than one request may score."""
    for field, texts in ((job.query_field, job.queries), (job.document_field, job.documents)):
        if not texts:
            raise InvalidRequestError(f"{field} must not be empty", field)
    if len(job.pairs) > max_batch:
        raise InvalidRequestError(
            f"{job.document_field} makes {len(job.pairs)} pairs, more than the limit of "
            f"{max_batch} (--max-client-batch-size)",
            job.document_field,
        )


def _scores(job: ScoreJob, outputs: list[PoolingOutput], plan: ScorerPlan) -> tuple[float, ...]:
    """One score per pair: the head's, or the plan's comparison (cosine, MaxSim) of two outputs."""
    if plan.compare is None:
        return tuple(float(o.data.reshape(-1)[0]) for o in outputs)
    compare = plan.compare
    queries, documents = outputs[: len(job.queries)], outputs[len(job.queries) :]
    return tuple(compare(queries[q].data, documents[d].data) for q, d in job.pairs)


async def _answer(
    request: Request, document: object, outputs: tuple[PoolingOutput, ...]
) -> Response:
    """The JSON answer with the timing headers; its bytes are counted."""
    body = await encoded(request, dumps, document)
    service_state(request).metrics.output_bytes.inc(len(body))
    return Response(body, media_type="application/json", headers=timing_headers(outputs))


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequestBody, request: Request) -> Response:
    """vLLM's score API: text_1 against text_2, one score per pair."""
    firsts = (body.text_1,) if isinstance(body.text_1, str) else tuple(body.text_1)
    seconds = (body.text_2,) if isinstance(body.text_2, str) else tuple(body.text_2)
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise InvalidRequestError(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: pair them 1:1, 1:N or N:N",
            "text_2",
        )
    pairs = tuple((0 if len(firsts) == 1 else i, i) for i in range(len(seconds)))
    job = ScoreJob(
        firsts, seconds, pairs, "text_1", "text_2", **_options(body), priority=body.priority
    )
    scored = await run_job(request, job)
    usage = {"prompt_tokens": scored.num_prompt_tokens, "total_tokens": scored.num_prompt_tokens}
    answer = {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": scored.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scored.scores)],
        # vLLM's UsageInfo, as it serializes it
        "usage": {**usage, "completion_tokens": 0, "prompt_tokens_details": None},
    }
    return await _answer(request, answer, scored.outputs)


def _options(body: ScoreRequestBody | RerankRequestBody) -> dict[str, Any]:
    """The scoring options both vLLM shapes share."""
    return {
        "model": body.model,
        "truncate_prompt_tokens": body.truncate_prompt_tokens,
        "truncation_side": body.truncation_side,
        "use_activation": body.use_activation,
    }


RERANK_BODIES = (RerankRequestBody, TEIRerankRequest, infinity.InfinityRerankRequest)


@router.post("/rerank", openapi_extra=_body_schema(*RERANK_BODIES))
async def rerank_any(payload: Annotated[dict[str, Any], Body()], request: Request) -> Response:
    """vLLM/Jina/Cohere rerank; TEI's when the body has `texts`, Infinity's with `raw_scores`."""
    if "texts" in payload and "documents" not in payload:
        tei_body = _validated(TEIRerankRequest, payload)
        scored = await run_job(request, tei.to_job(tei_body))
        return await _answer(request, tei.ranks(tei_body, scored.scores), scored.outputs)
    if "raw_scores" in payload:  # Infinity's clients always send it; vLLM's body has no such field
        ours = _validated(infinity.InfinityRerankRequest, payload)
        scored = await run_job(request, infinity.to_job(ours))
        answer = infinity.rerank_answer(
            ours, scored.scores, scored.model_name, scored.num_prompt_tokens
        )
        return await _answer(request, answer, scored.outputs)
    return await rerank(_validated(RerankRequestBody, payload), request)


def _validated(model: type[B], payload: dict[str, Any]) -> B:
    """The body as `model`; its problems answer 400 through the usual validation handler."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False), body=payload) from None


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
        priority=body.priority,
    )
    scored = await run_job(request, job)
    # a stable sort: equal scores keep their input order, as vLLM's does
    order = sorted(range(len(documents)), key=lambda i: -scored.scores[i])[: body.top_n]
    results = [
        {"index": i, "document": {"text": documents[i]}, "relevance_score": scored.scores[i]}
        if body.return_documents
        else {"index": i, "relevance_score": scored.scores[i]}
        for i in order
    ]
    answer = {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": scored.model_name,
        "usage": {
            "prompt_tokens": scored.num_prompt_tokens,
            "total_tokens": scored.num_prompt_tokens,
        },
        "results": results,
    }
    return await _answer(request, answer, scored.outputs)

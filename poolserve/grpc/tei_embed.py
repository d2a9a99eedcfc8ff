"""tei.v1's Embed, Predict and Rerank services: each message built into the jobs TEI's HTTP
routes build (poolserve/http/compat/tei_*.py) and answered in TEI's messages."""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import numpy as np

from poolserve.frontend.encoding import sparse_parts
from poolserve.frontend.jobs import Requested, ScoreJob, TextJob
from poolserve.frontend.pipeline import submit_job
from poolserve.frontend.scoring import scores_of
from poolserve.frontend.texts import check_batch_size
from poolserve.grpc import tei_pb2 as pb
from poolserve.grpc import tei_pb2_grpc as pb_grpc
from poolserve.grpc.calls import GrpcCall
from poolserve.grpc.handling import (
    Calls,
    Context,
    metadata,
    model_of,
    prompt_of,
    run,
    truncate_of,
)
from poolserve.http.compat.tei_common import Ran, best_first, empty
from poolserve.http.compat.tei_embed import matryoshka_cut
from poolserve.http.compat.tei_predict import labels_best_first
from poolserve.types.errors import InvalidRequestError
from poolserve.types.tasks import PoolingTask

EMBED = "/tei.v1.Embed/"
PREDICT = "/tei.v1.Predict/"
RERANK = "/tei.v1.Rerank/"


async def _text_job(
    calls: Calls,
    call: GrpcCall,
    task: PoolingTask,
    request: pb.EmbedRequest | pb.EmbedSparseRequest | pb.EmbedAllRequest,
    requested: Requested,
) -> Ran:
    """One text as TEI's /embed* routes run it: the prompt rule, truncation, one job."""
    model = model_of(calls.state, call)
    if not request.inputs:
        raise empty("inputs")
    asked = request.prompt_name if request.HasField("prompt_name") else None
    name, prompt = prompt_of(model, asked)
    job = TextJob(
        task,
        [request.inputs],
        requested=requested,
        model=call.model_name,
        prompt_name=name,
        prompt=prompt,
        truncate=truncate_of(request.truncate, request.truncation_direction),
    )
    return await run(calls.state, call, job, len(request.inputs))


class EmbedService(pb_grpc.EmbedServicer):
    """Embed, EmbedSparse, EmbedAll and their streams."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    async def _embed(self, call: GrpcCall, request: pb.EmbedRequest) -> pb.EmbedResponse:
        started = time.monotonic()
        dimensions = request.dimensions if request.HasField("dimensions") else None
        normalize = request.normalize if request.HasField("normalize") else True
        if dimensions is not None and dimensions <= 0:
            raise InvalidRequestError("`dimensions` should be positive", "dimensions")
        # with `dimensions`, TEI cuts the full embedding, then normalizes the cut itself
        requested = Requested(normalize=normalize if dimensions is None else False)
        ran = await _text_job(self.calls, call, PoolingTask.EMBED, request, requested)
        vector = ran.outputs[0].data
        if dimensions is not None:
            vector = matryoshka_cut(vector, dimensions, normalize)
        embeddings = np.asarray(vector, dtype=np.float32).tolist()
        return pb.EmbedResponse(embeddings=embeddings, metadata=metadata(started, ran))

    async def _sparse(
        self, call: GrpcCall, request: pb.EmbedSparseRequest
    ) -> pb.EmbedSparseResponse:
        started = time.monotonic()
        ran = await _text_job(self.calls, call, PoolingTask.EMBED_SPARSE, request, Requested())
        ids, weights = sparse_parts(ran.outputs[0].data)
        values = [
            pb.SparseValue(index=i, value=w)
            for i, w in zip(ids.tolist(), weights.tolist(), strict=True)
        ]
        return pb.EmbedSparseResponse(sparse_embeddings=values, metadata=metadata(started, ran))

    async def _all(self, call: GrpcCall, request: pb.EmbedAllRequest) -> pb.EmbedAllResponse:
        started = time.monotonic()
        requested = Requested(normalize=False)
        ran = await _text_job(self.calls, call, PoolingTask.TOKEN_EMBED, request, requested)
        rows = np.asarray(ran.outputs[0].data, dtype=np.float32).tolist()  # [tokens, hidden]
        tokens = [pb.TokenEmbedding(embeddings=row) for row in rows]
        return pb.EmbedAllResponse(token_embeddings=tokens, metadata=metadata(started, ran))

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:
        """One pooled embedding."""
        return await self.calls.unary(context, EMBED + "Embed", lambda c: self._embed(c, request))

    async def EmbedStream(
        self, request_iterator: AsyncIterable[pb.EmbedRequest], context: Context
    ) -> AsyncIterator[pb.EmbedResponse]:
        """One pooled embedding per message, in order."""
        async for reply in self.calls.stream(
            request_iterator, context, EMBED + "EmbedStream", self._embed
        ):
            yield reply

    async def EmbedSparse(
        self, request: pb.EmbedSparseRequest, context: Context
    ) -> pb.EmbedSparseResponse:
        """The non-zero sparse weights, ascending by vocabulary id."""
        method = EMBED + "EmbedSparse"
        return await self.calls.unary(context, method, lambda c: self._sparse(c, request))

    async def EmbedSparseStream(
        self, request_iterator: AsyncIterable[pb.EmbedSparseRequest], context: Context
    ) -> AsyncIterator[pb.EmbedSparseResponse]:
        """Sparse weights per message, in order."""
        method = EMBED + "EmbedSparseStream"
        async for reply in self.calls.stream(request_iterator, context, method, self._sparse):
            yield reply

    async def EmbedAll(self, request: pb.EmbedAllRequest, context: Context) -> pb.EmbedAllResponse:
        """Every token's final hidden state."""
        method = EMBED + "EmbedAll"
        return await self.calls.unary(context, method, lambda c: self._all(c, request))

    async def EmbedAllStream(
        self, request_iterator: AsyncIterable[pb.EmbedAllRequest], context: Context
    ) -> AsyncIterator[pb.EmbedAllResponse]:
        """Every token's hidden state per message, in order."""
        method = EMBED + "EmbedAllStream"
        async for reply in self.calls.stream(request_iterator, context, method, self._all):
            yield reply


class PredictService(pb_grpc.PredictServicer):
    """Predict and PredictPair (a text, or a pair laid out as one prompt) and their streams."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    async def _one(
        self, call: GrpcCall, texts: list[str], truncate: bool, direction: int, raw: bool
    ) -> pb.PredictResponse:
        """TEI's /predict of one text or one pair: every label with its score, best first."""
        started = time.monotonic()
        state = self.calls.state
        model = model_of(state, call)
        if len(texts) not in (1, 2):
            raise InvalidRequestError("inputs must be a text or a pair of two texts", "inputs")
        if not "".join(texts):
            raise empty("inputs")
        cut = truncate_of(truncate, direction)
        job: TextJob | ScoreJob
        if len(texts) == 1:  # TEI's default prompt goes before single texts, never pairs
            name, prompt = prompt_of(model, None)
            requested = Requested(use_activation=not raw)
            job = TextJob(
                PoolingTask.CLASSIFY,
                texts,
                requested=requested,
                model=call.model_name,
                prompt_name=name,
                prompt=prompt,
                truncate=cut,
            )
        else:
            job = ScoreJob(
                queries=(texts[0],),
                documents=(texts[1],),
                pairs=((0, 0),),
                query_field="inputs",
                document_field="inputs",
                model=call.model_name,
                truncate=cut,
                use_activation=not raw,
                task=PoolingTask.CLASSIFY,
            )
        ran = await run(state, call, job, sum(len(t) for t in texts))
        found: list[dict[str, Any]] = labels_best_first(ran.outputs[0], model.card.labels)
        predictions = [pb.Prediction(score=p["score"], label=p["label"]) for p in found]
        return pb.PredictResponse(predictions=predictions, metadata=metadata(started, ran))

    async def _predict(self, call: GrpcCall, request: pb.PredictRequest) -> pb.PredictResponse:
        texts = [request.inputs]
        direction = request.truncation_direction
        return await self._one(call, texts, request.truncate, direction, request.raw_scores)

    async def _pair(self, call: GrpcCall, request: pb.PredictPairRequest) -> pb.PredictResponse:
        texts = list(request.inputs)
        direction = request.truncation_direction
        return await self._one(call, texts, request.truncate, direction, request.raw_scores)

    async def Predict(self, request: pb.PredictRequest, context: Context) -> pb.PredictResponse:
        """One text's labels."""
        method = PREDICT + "Predict"
        return await self.calls.unary(context, method, lambda c: self._predict(c, request))

    async def PredictPair(
        self, request: pb.PredictPairRequest, context: Context
    ) -> pb.PredictResponse:
        """One pair's labels (or one text's, sent alone)."""
        method = PREDICT + "PredictPair"
        return await self.calls.unary(context, method, lambda c: self._pair(c, request))

    async def PredictStream(
        self, request_iterator: AsyncIterable[pb.PredictRequest], context: Context
    ) -> AsyncIterator[pb.PredictResponse]:
        """One text's labels per message, in order."""
        method = PREDICT + "PredictStream"
        async for reply in self.calls.stream(request_iterator, context, method, self._predict):
            yield reply

    async def PredictPairStream(
        self, request_iterator: AsyncIterable[pb.PredictPairRequest], context: Context
    ) -> AsyncIterator[pb.PredictResponse]:
        """One pair's labels per message, in order."""
        method = PREDICT + "PredictPairStream"
        async for reply in self.calls.stream(request_iterator, context, method, self._pair):
            yield reply


class RerankService(pb_grpc.RerankServicer):
    """Rerank, and RerankStream: one (query, text) per message, ranked together at the end."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    async def _rank(
        self,
        call: GrpcCall,
        query: str,
        texts: list[str],
        request: pb.RerankRequest | pb.RerankStreamRequest,
    ) -> pb.RerankResponse:
        """TEI's /rerank: the query paired with each text, ranks best first."""
        started = time.monotonic()
        if not texts:
            raise empty("texts")
        job = ScoreJob.one_query(
            query,
            texts,
            "texts",
            model=call.model_name,
            truncate=truncate_of(request.truncate, request.truncation_direction),
            use_activation=not request.raw_scores,
        )
        scored = await scores_of(job, await submit_job(self.calls.state, job, call))
        chars = len(query) * len(texts) + sum(len(text) for text in texts)
        ran = Ran.of(scored.outputs, time.monotonic() - started, chars)
        scores = scored.scores
        ranks = [
            pb.Rank(index=i, score=scores[i], text=texts[i] if request.return_text else None)
            for i in best_first(scores)
        ]
        return pb.RerankResponse(ranks=ranks, metadata=metadata(started, ran))

    async def Rerank(self, request: pb.RerankRequest, context: Context) -> pb.RerankResponse:
        """The texts ranked against the query."""

        async def work(call: GrpcCall) -> pb.RerankResponse:
            return await self._rank(call, request.query, list(request.texts), request)

        return await self.calls.unary(context, RERANK + "Rerank", work)

    async def RerankStream(
        self, request_iterator: AsyncIterable[pb.RerankStreamRequest], context: Context
    ) -> pb.RerankResponse:
        """Every message's (query, text) ranked together; the first message's raw_scores,
        return_text and truncation hold for all (TEI reads only the first's two flags)."""

        async def work(call: GrpcCall) -> pb.RerankResponse:
            first: pb.RerankStreamRequest | None = None
            queries: list[str] = []
            texts: list[str] = []
            limit = model_of(self.calls.state, call).settings.max_client_batch_size
            async for message in request_iterator:
                first = first or message
                queries.append(message.query)
                texts.append(message.text)
                check_batch_size(len(texts), limit, "texts")  # bounded before it grows on
            if first is None:
                raise empty("texts")
            if len(set(queries)) == 1:
                return await self._rank(call, queries[0], texts, first)
            return await self._pairs(call, queries, texts, first)

        return await self.calls.unary(context, RERANK + "RerankStream", work)

    async def _pairs(
        self, call: GrpcCall, queries: list[str], texts: list[str], first: pb.RerankStreamRequest
    ) -> pb.RerankResponse:
        """Messages with different queries: each pair scored as sent, ranked together."""
        started = time.monotonic()
        job = ScoreJob(
            queries=tuple(queries),
            documents=tuple(texts),
            pairs=tuple((i, i) for i in range(len(texts))),
            query_field="query",
            document_field="text",
            model=call.model_name,
            truncate=truncate_of(first.truncate, first.truncation_direction),
            use_activation=not first.raw_scores,
        )
        scored = await scores_of(job, await submit_job(self.calls.state, job, call))
        chars = sum(len(q) + len(t) for q, t in zip(queries, texts, strict=True))
        ran = Ran.of(scored.outputs, time.monotonic() - started, chars)
        scores = scored.scores
        ranks = [
            pb.Rank(index=i, score=scores[i], text=texts[i] if first.return_text else None)
            for i in best_first(scores)
        ]
        return pb.RerankResponse(ranks=ranks, metadata=metadata(started, ran))

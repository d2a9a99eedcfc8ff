"""tei.v1's Tokenize service (Tokenize, Decode and their streams) and Info, answered as TEI's
HTTP /tokenize, /decode and /info answer (poolserve/http/compat/tei_tokens.py, api/admin.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from importlib.metadata import version
from typing import Any

from poolserve.frontend.texts import InputTooLongError, run_budgeted
from poolserve.grpc import tei_pb2 as pb
from poolserve.grpc import tei_pb2_grpc as pb_grpc
from poolserve.grpc.calls import GrpcCall
from poolserve.grpc.handling import Calls, Context, model_of, prompt_of
from poolserve.http.api.admin import tei_info
from poolserve.http.compat.tei_common import empty
from poolserve.http.compat.tei_tokens import token_lists
from poolserve.http.visible import described
from poolserve.types.errors import InvalidRequestError

TOKENIZE = "/tei.v1.Tokenize/"
MODEL_TYPES = {
    "embedding": pb.MODEL_TYPE_EMBEDDING,
    "classifier": pb.MODEL_TYPE_CLASSIFIER,
    "reranker": pb.MODEL_TYPE_RERANKER,
}


class TokenizeService(pb_grpc.TokenizeServicer):
    """Tokenize and Decode, with the model's own tokenizer."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    async def _tokenize(self, call: GrpcCall, request: pb.EncodeRequest) -> pb.EncodeResponse:
        """The text's tokens, byte offsets, TEI's prompt rule applied first."""
        state = self.calls.state
        model = model_of(state, call)
        call.routed(model.model_name, model.lora_name)
        if not request.inputs:
            raise empty("inputs")
        asked = request.prompt_name if request.HasField("prompt_name") else None
        texts = list(model.prompts.apply([request.inputs], *prompt_of(model, asked)))
        if len(texts[0]) > model.limits.max_input_chars:
            raise InputTooLongError(
                f"inputs has {len(texts[0])} characters, more than the limit of "
                f"{model.limits.max_input_chars} (--max-input-chars)",
                "inputs",
            )
        on_reject = state.metrics.model(model.served_name).on_reject
        found: list[list[dict[str, Any]]] = await run_budgeted(
            model, len(texts[0]), on_reject, token_lists, model, texts, request.add_special_tokens
        )
        tokens = [
            pb.SimpleToken(
                id=t["id"], text=t["text"], special=t["special"], start=t["start"], stop=t["stop"]
            )
            for t in found[0]
        ]
        return pb.EncodeResponse(tokens=tokens)

    async def _decode(self, call: GrpcCall, request: pb.DecodeRequest) -> pb.DecodeResponse:
        """The ids' text (the tokenizers library's decode, as TEI's)."""
        model = model_of(self.calls.state, call)
        call.routed(model.model_name, model.lora_name)
        ids = list(request.ids)
        if not ids:
            raise empty("ids")
        vocab_size = model.card.vocab_size
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", "ids"
            )
        backend = model.tokenizer.backend_tokenizer
        skip = request.skip_special_tokens
        text = await asyncio.to_thread(backend.decode, ids, skip_special_tokens=skip)
        return pb.DecodeResponse(text=text)

    async def Tokenize(self, request: pb.EncodeRequest, context: Context) -> pb.EncodeResponse:
        """One text's tokens."""
        method = TOKENIZE + "Tokenize"
        return await self.calls.unary(context, method, lambda c: self._tokenize(c, request))

    async def TokenizeStream(
        self, request_iterator: AsyncIterable[pb.EncodeRequest], context: Context
    ) -> AsyncIterator[pb.EncodeResponse]:
        """One text's tokens per message, in order."""
        method = TOKENIZE + "TokenizeStream"
        async for reply in self.calls.stream(request_iterator, context, method, self._tokenize):
            yield reply

    async def Decode(self, request: pb.DecodeRequest, context: Context) -> pb.DecodeResponse:
        """One id list's text."""
        method = TOKENIZE + "Decode"
        return await self.calls.unary(context, method, lambda c: self._decode(c, request))

    async def DecodeStream(
        self, request_iterator: AsyncIterable[pb.DecodeRequest], context: Context
    ) -> AsyncIterator[pb.DecodeResponse]:
        """One id list's text per message, in order."""
        method = TOKENIZE + "DecodeStream"
        async for reply in self.calls.stream(request_iterator, context, method, self._decode):
            yield reply


class InfoService(pb_grpc.InfoServicer):
    """TEI's Info: the served model's facts, as /info reports them (the `model` metadata's
    model, else the default)."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    async def _info(self, call: GrpcCall) -> pb.InfoResponse:
        # NOT_FOUND for a model the call's key may not use, as /info's 404
        model = described(self.calls.state, call.tenant, call.model_name)
        call.routed(model.model_name, model.lora_name)
        info: dict[str, Any] = tei_info(model)
        kind = next(iter(info["model_type"]))
        return pb.InfoResponse(
            version=version("poolserve"),
            model_id=str(info["model_id"]),
            model_sha=info["model_sha"],
            model_dtype=str(info["model_dtype"]),
            model_type=MODEL_TYPES.get(kind, pb.MODEL_TYPE_EMBEDDING),
            max_concurrent_requests=info["max_concurrent_requests"],
            max_input_length=info["max_input_length"],
            max_batch_tokens=info["max_batch_tokens"],
            max_batch_requests=info["max_batch_requests"],
            max_client_batch_size=model.settings.max_client_batch_size,
            tokenization_workers=info["tokenization_workers"],
        )

    async def Info(self, request: pb.InfoRequest, context: Context) -> pb.InfoResponse:
        """The served model's facts."""
        return await self.calls.unary(context, "/tei.v1.Info/Info", self._info)

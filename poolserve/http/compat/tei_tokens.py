"""TEI's `POST /tokenize` (token objects with byte offsets) and `POST /decode`."""

from __future__ import annotations

import asyncio
import copy

from fastapi import APIRouter, Request
from pydantic import StrictStr
from starlette.responses import Response

from poolserve.frontend.encoding import dumps
from poolserve.frontend.pipeline import check_serving
from poolserve.frontend.state import ModelHandle
from poolserve.frontend.texts import (
    InputTooLongError,
    check_batch_size,
    check_encodable,
    run_budgeted,
)
from poolserve.http.bodies import TokenIds
from poolserve.http.calls import HTTPCaller, service_state
from poolserve.http.compat.tei_common import TEIBody, TEIRoute, empty, mark, prompt_for
from poolserve.types.errors import InvalidRequestError

router = APIRouter(route_class=TEIRoute)


class TokenizeRequest(TEIBody):
    """TEI's `TokenizeRequest` (told apart from vLLM's `prompt` body by `inputs`)."""

    inputs: StrictStr | list[StrictStr]
    add_special_tokens: bool = True
    prompt_name: StrictStr | None = None


class DecodeRequest(TEIBody):
    """TEI's `DecodeRequest`."""

    ids: TokenIds | list[TokenIds]
    skip_special_tokens: bool = True


def _json(document: object) -> Response:
    return Response(dumps(document), media_type="application/json")


def _batch(model: ModelHandle, items: list[str] | list[list[int]], field: str) -> None:
    """400 (TEI's `Empty`) for an empty batch or item; 422 above --max-client-batch-size."""
    limit = model.settings.max_client_batch_size
    if not items or any(len(item) == 0 for item in items):
        raise empty(field)
    check_batch_size(len(items), limit, field)


async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    """Each text's tokens: `[[{"id", "text", "special", "start", "stop"}]]`, byte offsets."""
    mark(request)
    state = service_state(request)
    _, model = check_serving(state, None)  # TEI's routes: the default model
    HTTPCaller(request).routed(model.model_name, model.lora_name)
    texts = [body.inputs] if isinstance(body.inputs, str) else list(body.inputs)
    _batch(model, texts, "inputs")
    # TEI's prompt rule: the request's prompt_name, else the server's --default-prompt-name
    texts = list(model.prompts.apply(texts, *prompt_for(request, body.prompt_name)))
    for index, text in enumerate(texts):
        if len(text) > model.limits.max_input_chars:
            raise InputTooLongError(
                f"inputs {index} has {len(text)} characters, more than the limit of "
                f"{model.limits.max_input_chars} (--max-input-chars)",
                "inputs",
            )
    num_chars = sum(len(t) for t in texts)
    on_reject = state.metrics.model(model.served_name).on_reject
    tokens = await run_budgeted(
        model, num_chars, on_reject, token_lists, model, texts, body.add_special_tokens
    )
    return _json(tokens)


def token_lists(
    model: ModelHandle, texts: list[str], add_special_tokens: bool
) -> list[list[dict[str, object]]]:
    """The tokenizer's own encodings, read as TEI reads them (offsets in UTF-8 bytes)."""
    check_encodable(texts, "inputs")
    backend = model.tokenizer.backend_tokenizer
    if backend.padding is not None or backend.truncation is not None:
        # a tokenizer.json may carry padding or truncation; TEI turns both off, so do we
        backend = copy.deepcopy(backend)
        backend.no_padding()
        backend.no_truncation()
    return [
        _token_objects(backend.encode(text, add_special_tokens=add_special_tokens), text)
        for text in texts
    ]


def _token_objects(encoding: object, text: str) -> list[dict[str, object]]:
    """Special tokens carry their token string and no offsets; others the text they cover."""
    data = text.encode("utf-8")
    # Python's tokenizers gives character offsets; TEI reports the Rust library's byte offsets
    byte_at = [0]
    for char in text:
        byte_at.append(byte_at[-1] + len(char.encode("utf-8")))
    objects: list[dict[str, object]] = []
    for id_, (start, stop), special, token in zip(
        encoding.ids,  # type: ignore[attr-defined]
        encoding.offsets,  # type: ignore[attr-defined]
        encoding.special_tokens_mask,  # type: ignore[attr-defined]
        encoding.tokens,  # type: ignore[attr-defined]
        strict=True,
    ):
        if special:
            objects.append({"id": id_, "text": token, "special": True, "start": None, "stop": None})
            continue
        first, last = byte_at[start], byte_at[stop]
        piece = data[first:last].decode("utf-8", errors="replace")
        objects.append({"id": id_, "text": piece, "special": False, "start": first, "stop": last})
    return objects


def _id_lists(ids: list[int] | list[list[int]]) -> list[list[int]]:
    """One id list or a batch of them (an empty list is one empty id list, as TEI reads it)."""
    if not ids or isinstance(ids[0], int):
        return [ids]  # type: ignore[list-item]
    return ids


@router.post("/decode")
async def decode(body: DecodeRequest, request: Request) -> Response:
    """The text of each id list: `["text", ...]`."""
    _, model = check_serving(service_state(request), None)
    HTTPCaller(request).routed(model.model_name, model.lora_name)
    batch = _id_lists(body.ids)
    _batch(model, batch, "ids")
    vocab_size = model.card.vocab_size
    for ids in batch:
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", "ids"
            )

    # the tokenizers library's decode, as TEI's (no transformers clean-up of spaces)
    backend = model.tokenizer.backend_tokenizer

    def decode_all() -> list[str]:
        return [backend.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in batch]

    return _json(await asyncio.to_thread(decode_all))

"""Ollama's embedding API: `POST /api/embed`, the older `POST /api/embeddings`, and the
`GET /api/tags`, `POST /api/show` and `GET /api/version` its clients call to find a model.

Shapes and rules read from Ollama's server (`server/routes.go`: `EmbedHandler`,
`EmbeddingsHandler`, `normalize`) and its Python client's types (`ollama._types`):

- `/api/embed` takes `input` (a text or a list of texts; "" is no input), cuts each text at the
  model's length unless `truncate` is false (then a longer one answers 400), L2-normalizes every
  embedding, and with `dimensions` below the embedding's size keeps the first N and normalizes
  again; `keep_alive` and `options` are accepted (a model here is always loaded);
- `/api/embeddings` embeds one `prompt` and answers the model's own embedding ("" answers []);
- texts are embedded as they are: no sentence-transformers prompt, as Ollama's runner does;
- errors are Ollama's `{"error": message}`; a model is named by any served name, `:latest`
  (Ollama's default tag) added or not.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from importlib.metadata import version
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from pydantic import StrictBool, StrictInt, StrictStr
from starlette.responses import Response

from poolserve.frontend.encoding import dumps
from poolserve.frontend.jobs import Requested, TextJob, Truncate
from poolserve.frontend.pipeline import check_serving, gather
from poolserve.frontend.state import ModelHandle, ServiceState
from poolserve.frontend.texts import check_batch_size
from poolserve.http.bodies import RequestBody
from poolserve.http.calls import answer, service_state, submit
from poolserve.http.errors import OLLAMA_FAMILY
from poolserve.http.routing import StrictJSONRoute
from poolserve.http.visible import may_see, seen_models, tenant_of
from poolserve.types.errors import InvalidRequestError, ModelNotFoundError
from poolserve.types.tasks import PoolingTask


class OllamaRoute(StrictJSONRoute):
    """A route only Ollama's clients call: every error answers `{"error": message}`."""

    error_family = OLLAMA_FAMILY


router = APIRouter(route_class=OllamaRoute)
# Ollama's default tag: `all-minilm` and `all-minilm:latest` name one model.
DEFAULT_TAG = ":latest"


class EmbedRequest(RequestBody):
    """Ollama's `/api/embed` body."""

    model: StrictStr
    input: StrictStr | list[StrictStr] | None = None
    truncate: StrictBool | None = None
    dimensions: StrictInt | None = None
    keep_alive: StrictStr | float | None = None
    options: dict[str, Any] | None = None


class EmbeddingsRequest(RequestBody):
    """Ollama's older `/api/embeddings` body."""

    model: StrictStr
    prompt: StrictStr | None = None
    keep_alive: StrictStr | float | None = None
    options: dict[str, Any] | None = None


class ShowRequest(RequestBody):
    """Ollama's `/api/show` body (`name` is its older spelling of `model`)."""

    model: StrictStr | None = None
    name: StrictStr | None = None


@router.post("/api/embed")
async def embed(body: EmbedRequest, request: Request) -> Response:
    """Each text's normalized embedding, cut to `dimensions` and normalized again."""
    started = time.monotonic_ns()
    name, model = _model(service_state(request), body.model)
    # "" is no input at all, as Ollama reads it
    texts = ([body.input] if body.input else []) if isinstance(body.input, str) else body.input
    texts = texts or []
    check_batch_size(len(texts), model.settings.max_client_batch_size, "input")
    if body.dimensions is not None and body.dimensions < 0:
        raise InvalidRequestError("dimensions must not be negative", "dimensions")
    fields = {"model": body.model, "embeddings": []}
    if not texts:
        return Response(dumps(fields), media_type="application/json")
    # truncate (default true) cuts at the model's length; false refuses a longer text
    truncate = Truncate(tokens=-1) if body.truncate is not False else Truncate(auto=False)
    job = TextJob(
        PoolingTask.EMBED,
        texts,
        requested=Requested(normalize=True),
        model=name,
        prompt="",
        truncate=truncate,
    )
    run = await submit(request, job)
    outputs = await gather(run)
    width = body.dimensions or 0

    def encode() -> bytes:
        vectors = [_cut(output.data, width) for output in outputs]
        return dumps(
            {
                **fields,
                "embeddings": vectors,
                "total_duration": time.monotonic_ns() - started,
                "load_duration": 0,
                "prompt_eval_count": run.num_prompt_tokens,
            }
        )

    return await answer(request, outputs, encode)


def _cut(vector: np.ndarray, width: int) -> np.ndarray:
    """Ollama's `dimensions`: the first N, normalized again (0, or N past the size: all)."""
    if not 0 < width < vector.shape[-1]:
        return vector
    kept = vector[:width].astype(np.float32)
    return kept / max(float(np.linalg.norm(kept)), 1e-12)


@router.post("/api/embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request) -> Response:
    """The prompt's embedding, as the model makes it."""
    name, _ = _model(service_state(request), body.model)
    if not body.prompt:
        return Response(dumps({"embedding": []}), media_type="application/json")
    job = TextJob(PoolingTask.EMBED, [body.prompt], model=name, prompt="")
    run = await submit(request, job)
    outputs = await gather(run)
    return await answer(request, outputs, lambda: dumps({"embedding": outputs[0].data}))


@router.get("/api/tags")
async def tags(request: Request) -> Response:
    """Every served name of every model the request's key may use, as Ollama lists its local
    models."""
    state = service_state(request)
    listed = [
        {"name": name, "model": name, **_facts(served.handle)}
        for served in seen_models(tenant_of(request), state)
        for name in served.handle.served_names
    ]
    return Response(dumps({"models": listed}), media_type="application/json")


@router.post("/api/show")
async def show(body: ShowRequest, request: Request) -> Response:
    """The model's details, enough for a client to see it embeds (Ollama's 404 for a model the
    request's key may not use, as for one not served)."""
    asked = body.model or body.name
    if not asked:
        raise InvalidRequestError("model is required", "model")
    _, model = _model(service_state(request), asked)
    if not may_see(tenant_of(request), model):
        raise _not_found(asked)
    card = model.card
    architecture = card.architecture
    info = {
        "general.architecture": architecture,
        f"{architecture}.context_length": model.max_model_len,
        f"{architecture}.embedding_length": card.pooling_info.embedding_size,
    }
    facts = _facts(model)
    document = {
        "modelfile": "",
        "parameters": "",
        "template": "",
        "details": facts["details"],
        "model_info": info,
        "capabilities": ["embedding"],
        "modified_at": facts["modified_at"],
    }
    return Response(dumps(document), media_type="application/json")


@router.get("/api/version")
async def ollama_version() -> Response:
    """This server's version where Ollama's clients look for it."""
    return Response(dumps({"version": version("poolserve")}), media_type="application/json")


def _facts(model: ModelHandle) -> dict[str, Any]:
    """What Ollama's listing says of a model: its family, format and precision."""
    card = model.card
    details = {
        "parent_model": "",
        "format": "safetensors",
        "family": card.architecture,
        "families": [card.architecture],
        "parameter_size": "",
        "quantization_level": model.dtype,
    }
    started = datetime.fromtimestamp(card.path.stat().st_mtime, UTC).isoformat()
    return {"modified_at": started, "size": 0, "digest": "", "details": details}


def _model(state: ServiceState, asked: str) -> tuple[str, ModelHandle]:
    """The served name a request names (with or without `:latest`) and its model; Ollama's 404
    `model 'NAME' not found` for another."""
    for name in (asked, asked.removesuffix(DEFAULT_TAG)):
        if state.find(name) is not None:
            return name, check_serving(state, name)[1]
    check_serving(state, None)  # not ready or draining: that answer first
    raise _not_found(asked)


def _not_found(asked: str) -> ModelNotFoundError:
    """Ollama's 404 for a model it does not have."""
    return ModelNotFoundError(f"model '{asked}' not found", "model")

"""vLLM's LoRA routes: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.

Their bodies and answers are vLLM's (vllm/entrypoints/openai/serving_models.py): a plain-text
"Success: ..." line; a name already loaded is a 400, an unload of a name not loaded a 404, an
adapter that does not fit the model a 400 naming why. The engine core loads the folder off its
loop and every front end hears the new set, so any of them routes the adapter's requests at
once. An unload answers once the adapter's admitted requests are done. Behind the API key, as
every route but the probes.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import Field, StrictBool, StrictInt, StrictStr
from starlette.responses import PlainTextResponse

from poolserve.frontend.pipeline import check_serving
from poolserve.frontend.texts import check_encodable
from poolserve.http.bodies import RequestBody
from poolserve.http.calls import service_state
from poolserve.http.routing import StrictJSONRoute
from poolserve.types.errors import InvalidRequestError, LoraAdapterNotFoundError

router = APIRouter(route_class=StrictJSONRoute)
# an adapter's name is a model name every front end keeps and lists; a path is a folder or Hub id
Name = Annotated[StrictStr, Field(max_length=256)]
Path = Annotated[StrictStr, Field(max_length=4096)]


class LoadLoRAAdapterRequest(RequestBody):
    """vLLM's body; `base_model_name` (its --lora-modules key) picks the served model the
    adapter runs on when the server serves several (default: the default model)."""

    lora_name: Name
    lora_path: Path
    load_inplace: StrictBool = False  # replace an adapter of the same name
    base_model_name: Name | None = None


class UnloadLoRAAdapterRequest(RequestBody):
    """vLLM's body (`lora_int_id` is accepted and not needed: names are unique)."""

    lora_name: Name
    lora_int_id: StrictInt | None = None


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Serve a PEFT adapter folder as a model named `lora_name`."""
    state = service_state(request)
    if not body.lora_name or not body.lora_path:
        raise InvalidRequestError("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    # they travel to the engine core and to every front end, which encode them as UTF-8
    check_encodable([body.lora_name], "lora_name")
    check_encodable([body.lora_path], "lora_path")
    engine, model = check_serving(state, body.base_model_name)
    if model.lora is not None:
        raise InvalidRequestError(
            f"base_model_name {body.base_model_name!r} is a LoRA adapter", "base_model_name"
        )
    if body.lora_name in state.served:
        raise InvalidRequestError(f"{body.lora_name!r} is a served model's name", "lora_name")
    loaded = state.find(body.lora_name)
    if body.load_inplace and loaded is not None:
        await loaded.engine.adapt(body.lora_name, None)
    await engine.adapt(body.lora_name, body.lora_path, body.base_model_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, request: Request
) -> PlainTextResponse:
    """Stop serving adapter `lora_name`, once the requests it admitted are done."""
    state = service_state(request)
    check_serving(state, None)  # 503 while not ready or draining
    loaded = state.find(body.lora_name)
    if loaded is None or loaded.handle.lora is None:
        raise LoraAdapterNotFoundError(body.lora_name)
    await loaded.engine.adapt(body.lora_name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

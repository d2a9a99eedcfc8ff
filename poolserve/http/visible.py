"""What a request's API key may see of the served models (--api-keys-file's `models`).

The listing routes (OpenAI's /v1/models, Ollama's /api/tags, Infinity's /models) list only the
models and LoRA adapters the key may use, and the routes that describe one model (OpenAI's
/v1/models/{id}, /info, Ollama's /api/show, gRPC's Info) answer a model it may not use as one
that is not served: a 404 in words that name no other model, so a tenant learns no model of
another from them. A key without `models`, and a server without a keys file, see every model.
The inference routes keep their 403 for such a model: there the request named it already.
"""

from __future__ import annotations

from starlette.requests import Request

from poolserve.frontend.pipeline import check_serving
from poolserve.frontend.state import ModelHandle, Served, ServiceState
from poolserve.http.tenants import TENANT_KEY, TenantKey
from poolserve.types.errors import ModelNotFoundError, clip


def tenant_of(request: Request) -> TenantKey | None:
    """The request's --api-keys-file key (None without a keys file)."""
    tenant: TenantKey | None = request.scope.get("state", {}).get(TENANT_KEY)
    return tenant


def restricts(tenant: TenantKey | None) -> bool:
    """Whether the key may use some models only."""
    return tenant is not None and tenant.spec.models is not None


def may_see(tenant: TenantKey | None, model: ModelHandle) -> bool:
    """Whether the key may use the model (an adapter: by its own name)."""
    return tenant is None or tenant.may_use(model.served_names)


def seen_models(tenant: TenantKey | None, state: ServiceState) -> tuple[Served, ...]:
    """The served models the key may use, in the settings' order."""
    if not restricts(tenant):
        return state.models
    return tuple(served for served in state.models if may_see(tenant, served.handle))


def seen_adapters(tenant: TenantKey | None, state: ServiceState) -> tuple[Served, ...]:
    """The LoRA adapters served now that the key may use."""
    return tuple(served for served in state.adapters if may_see(tenant, served.handle))


def described(state: ServiceState, tenant: TenantKey | None, asked: str | None) -> ModelHandle:
    """The model a describing route names (no name: the default): 503 unless serving; a 404
    for a model the key may not use, as for an unknown name (check_serving's own 404 lists
    every served name, so a restricted key never reaches it)."""
    if restricts(tenant):
        served = state.find(asked)
        if served is None or not may_see(tenant, served.handle):
            check_serving(state, None)  # not ready or draining: that answer first
            raise unseen(asked, tenant)
    return check_serving(state, asked)[1]


def unseen(asked: str | None, tenant: TenantKey | None) -> ModelNotFoundError:
    """The 404 of a name the key sees no model under: for a key that may use some models only,
    the same words whether a model is served under the name or not."""
    if asked is None:  # the default model, never named to a key that may not use it
        return ModelNotFoundError(
            "the default model is not one this API key may use: name one it may use", "model"
        )
    if restricts(tenant):
        return ModelNotFoundError(
            f"model {clip(asked)!r} does not exist or this API key may not use it", "model"
        )
    return ModelNotFoundError(f"model {clip(asked)!r} does not exist", "model")

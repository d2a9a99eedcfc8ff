"""Schemathesis against the served OpenAPI schema: no 5xx, and every 4xx as documented."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app

# The schema does not depend on the model (it loads in the lifespan), so operations are listed at
# collection from an app that never starts, and each (operation, mode) is its own test.
SCHEMA = create_app(ServerSettings()).openapi()


def _may_be_invalid(operation: dict[str, Any]) -> bool:
    """Whether a request can break the operation's schema: not when its only inputs are free
    strings in the path (`/v1/models/{model_id}`: any string names a model, or none)."""
    free = {"type", "title"}
    return "requestBody" in operation or any(
        parameter["in"] != "path" or set(parameter["schema"]) - free
        for parameter in operation.get("parameters", ())
    )


CASES = [
    (method.upper(), path, mode)
    for path, item in SCHEMA["paths"].items()
    for method, operation in item.items()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    # an operation without inputs that may be invalid has no invalid request to generate
    if mode is GenerationMode.POSITIVE or _may_be_invalid(operation)
    # /invocations takes any of five bodies that accept unknown fields: schemathesis finds no
    # object none of them takes (tests/http/compat/test_sagemaker.py sends one)
    if (path, mode) != ("/invocations", GenerationMode.NEGATIVE)
]
# where the schema documents TEI's error body beside the OpenAI one
TEI_PATHS = {
    path
    for path, item in SCHEMA["paths"].items()
    for operation in item.values()
    if "TEIErrorBody" in str(operation.get("responses", {}))
}
# where it documents Ollama's
OLLAMA_PATHS = {
    path
    for path, item in SCHEMA["paths"].items()
    for operation in item.values()
    if "OllamaErrorBody" in str(operation.get("responses", {}))
}
VOYAGE_PATHS = {
    path
    for path, item in SCHEMA["paths"].items()
    for operation in item.values()
    if "VoyageErrorBody" in str(operation.get("responses", {}))
}
EXAMPLES = 12  # per operation and mode: the whole file runs in seconds
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def client(
    make_client: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    limits = {"max_model_len": 64, "max_client_batch_size": 8, "payload_limit": 64 * 1024}
    batches = str(tmp_path_factory.mktemp("batches"))  # the Batch API's routes served
    with make_client("llama", batch_dir=batches, **limits) as c:
        yield c


def _call(client: Any, case: Any) -> Any:
    """Send a case through the app's own test client (its lifespan is already running)."""
    kwargs = case.as_transport_kwargs(base_url=str(client.base_url))
    body = {"json": kwargs["json"]} if "json" in kwargs else {"content": kwargs.get("data")}
    return client.request(
        kwargs["method"],
        kwargs["url"],
        headers=kwargs.get("headers"),
        params=kwargs.get("params"),
        **body,
    )


def _check_error_body(response: Any) -> None:
    """Every 4xx: `{"error": {message, type, param, code}}` with string message, type and code,
    or, on paths that serve TEI's bodies, TEI's `{"error", "error_type"}` (both strings), on
    Ollama's, its `{"error": message}`, on Voyage's, its `{"detail": message}`."""
    if 400 <= response.status_code < 500:
        document = response.json()
        if set(document) == {"error", "error_type"}:
            assert response.request.url.path in TEI_PATHS, document
            assert all(isinstance(value, str) for value in document.values()), document
            return
        if set(document) == {"error"} and isinstance(document["error"], str):
            assert response.request.url.path in OLLAMA_PATHS, document
            return
        if set(document) == {"detail"}:  # Voyage's body, to a request in Voyage's shape
            assert response.request.url.path in VOYAGE_PATHS, document
            assert isinstance(document["detail"], str), document
            return
        error = document["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert all(isinstance(error[k], str) for k in ("message", "type", "code")), error
        assert error["param"] is None or isinstance(error["param"], str), error


@pytest.mark.parametrize("method,path,mode", CASES)
def test_operation(client: Any, method: str, path: str, mode: GenerationMode) -> None:
    operation = schemathesis.openapi.from_dict(SCHEMA)[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,  # the same examples on every run: CI stays deterministic
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        response = _call(client, case)
        case.validate_response(response, checks=CHECKS)
        _check_error_body(response)

    run()

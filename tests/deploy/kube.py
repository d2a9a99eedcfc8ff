"""Renders of deploy/kubernetes and what the Kubernetes tests read from them."""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from poolserve.config.settings import ServerSettings
from poolserve.http.api import admin as routes_admin
from tests.deploy.tools import (
    DEPLOY_DIR,
    TOOL_TIMEOUT_S,
    in_ci,
)

pytestmark = pytest.mark.slow

KUBE_DIR = DEPLOY_DIR / "kubernetes"
KUSTOMIZATIONS = ("base", "gpu", "cpu", "several-models")
OVERLAYS = ("gpu", "cpu")
DEVICE_OF_OVERLAY = {"gpu": "cuda", "cpu": "cpu"}
GPU_RESOURCE = "nvidia.com/gpu"
# Oldest Kubernetes minor the manifests target, and the newest the pinned validator ships.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.latest_version())
CRD_SCHEMA_FILES = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): KUBE_DIR
    / "schemas"
    / "servicemonitors.monitoring.coreos.com-v1.json",
}
DOWNLOAD_JOB = KUBE_DIR / "jobs" / "download-model.yaml"
ADAPTER_VALUES = KUBE_DIR / "prometheus-adapter" / "values.yaml"
# After its drain budget the server needs up to this long to exit (docs/deploy.md).
SERVER_EXIT_MARGIN_S = 2.0
# A generated ConfigMap's name ends in a content hash; kustomize v2 and v5 compute it differently.
GENERATED_SUFFIX = re.compile(r"-[a-z0-9]{10}$")
SECOND_KUBECTL_VARIABLE = "KUBECTL_OTHER"
Obj = dict[str, Any]


def kustomize(kubectl: str, name: str) -> list[Obj]:
    """The objects `kubectl kustomize` renders for one kustomization (stdout only: v5 warns)."""
    completed = subprocess.run(
        [kubectl, "kustomize", str(KUBE_DIR / name)],
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
        check=False,
    )
    assert completed.returncode == 0, f"{kubectl} kustomize {name}:\n{completed.stderr}"
    return [o for o in yaml.safe_load_all(completed.stdout) if o]


@functools.cache
def render(name: str) -> tuple[Obj, ...]:
    """One kustomization as the kubectl on PATH renders it; shared, read-only."""
    return tuple(kustomize(kubectl_path(), name))


def kubectl_path() -> str:
    """kubectl (Debian's kubernetes-client in CI); skips saying what to install if missing."""
    found = shutil.which("kubectl")
    if found is None:
        message = (
            "kubectl is not installed: install Debian's `kubernetes-client` package "
            "(`bash scripts/install-test-tools.sh` does as root or with sudo)"
        )
        if in_ci():
            pytest.fail(f"{message} (CI is set: a missing tool is a failure)", pytrace=False)
        pytest.skip(message)
    return found


def only(objects: tuple[Obj, ...] | list[Obj], kind: str) -> Obj:
    """The single object of a kind."""
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def container(objects: tuple[Obj, ...]) -> Obj:
    """The poolserve container of the Deployment."""
    containers = only(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    (found,) = [c for c in containers if c["name"] == "poolserve"]
    return dict(found)


def config_data(objects: tuple[Obj, ...]) -> dict[str, str]:
    """The POOLSERVE_* variables of the ConfigMap the container reads."""
    (ref,) = [s["configMapRef"]["name"] for s in container(objects)["envFrom"]]
    (config,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == ref]
    return dict(config["data"])


def effective_settings(objects: tuple[Obj, ...]) -> ServerSettings:
    """The settings a pod starts with: the ConfigMap's values over the server's defaults."""
    fields = {k.removeprefix("POOLSERVE_").lower(): v for k, v in config_data(objects).items()}
    return ServerSettings.model_validate(fields)


def crd_schema(api_version: str, kind: str) -> Obj:
    """A vendored CRD schema made strict: unknown fields, which an API server drops, fail."""
    document = json.loads(CRD_SCHEMA_FILES[(api_version, kind)].read_text())
    schema: Obj = copy.deepcopy(document["openAPIV3Schema"])
    _forbid_unknown(schema)
    return schema


def _forbid_unknown(node: object) -> None:
    """additionalProperties: false on every object schema that lists its properties."""
    if isinstance(node, dict):
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node.setdefault("additionalProperties", False)
        for value in node.values():
            _forbid_unknown(value)
    elif isinstance(node, list):
        for item in node:
            _forbid_unknown(item)


def validate(obj: Obj, version: str) -> None:
    """Raise unless the object is valid: core kinds by kubernetes-validate, CRDs by their schema."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMA_FILES:
        jsonschema.Draft202012Validator(crd_schema(*key)).validate(obj)
    else:
        kubernetes_validate.validate(obj, version, strict=True)


def normalized(objects: list[Obj]) -> dict[tuple[str, str], Obj]:
    """Objects by (kind, name) without generated-name hashes and empty annotation maps."""
    text = json.dumps(objects)
    for obj in objects:
        name = obj["metadata"]["name"]
        if obj["kind"] == "ConfigMap" and GENERATED_SUFFIX.search(name):
            text = text.replace(f'"{name}"', f'"{GENERATED_SUFFIX.sub("", name)}"')
    result = {}
    for obj in json.loads(text):
        if obj["metadata"].get("annotations") == {}:
            del obj["metadata"]["annotations"]
        result[(obj["kind"], obj["metadata"]["name"])] = obj
    return result


def port_number(ports: list[Obj], port: int | str) -> int:
    """A port given by number or by name, as a number."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in ports if p["name"] == port]
    return int(number)


def route_of(endpoint: Callable[..., Any]) -> str:
    """The path the app serves a GET handler of service/routes_admin.py on."""
    routes = routes_admin.router.routes
    (path,) = [getattr(r, "path", None) for r in routes if getattr(r, "endpoint", None) is endpoint]
    return str(path)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether a matchLabels selector matches a label set."""
    return bool(selector) and selector.items() <= labels.items()

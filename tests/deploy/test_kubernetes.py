"""deploy/kubernetes renders with kubectl and validates against published schemas."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import jsonschema
import pytest
import yaml

from tests.deploy.kube import (
    DOWNLOAD_JOB,
    KUBERNETES_VERSIONS,
    KUSTOMIZATIONS,
    SECOND_KUBECTL_VARIABLE,
    Obj,
    kustomize,
    normalized,
    only,
    render,
    validate,
)

pytestmark = pytest.mark.slow

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_object_validates(name: str, version: str) -> None:
    objects = render(name)
    assert {o["kind"] for o in objects} >= {
        "Deployment",
        "Service",
        "ConfigMap",
        "PodDisruptionBudget",
        "PersistentVolumeClaim",
        "ServiceMonitor",
        "HorizontalPodAutoscaler",
    }
    for obj in objects:
        validate(obj, version)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_download_job_validates(version: str) -> None:
    validate(yaml.safe_load(DOWNLOAD_JOB.read_text()), version)


# Edits each validator must refuse, applied to a rendered gpu overlay: proof that it checks.
BROKEN_EDITS: dict[str, tuple[str, Callable[[Obj], None]]] = {
    "probe field typo": (
        "Deployment",
        lambda o: o["spec"]["template"]["spec"]["containers"][0]["readinessProbe"][
            "httpGet"
        ].update(paht="/ready"),
    ),
    "port as text": ("Service", lambda o: o["spec"]["ports"][0].update(port="8000")),
    "hpa metric typo": (
        "HorizontalPodAutoscaler",
        lambda o: o["spec"]["metrics"][0].update(pod=o["spec"]["metrics"][0].pop("pods")),
    ),
    "scrape interval": (
        "ServiceMonitor",
        lambda o: o["spec"]["endpoints"][0].update(interval="15 seconds"),
    ),
    "servicemonitor field typo": (
        "ServiceMonitor",
        lambda o: o["spec"]["endpoints"][0].update(paht="/metrics"),
    ),
}


@pytest.mark.parametrize("edit", sorted(BROKEN_EDITS))
def test_validators_refuse_broken_objects(edit: str) -> None:
    kind, mutate = BROKEN_EDITS[edit]
    obj = copy.deepcopy(only(render("gpu"), kind))
    validate(obj, KUBERNETES_VERSIONS[-1])
    mutate(obj)
    with pytest.raises(jsonschema.ValidationError):
        validate(obj, KUBERNETES_VERSIONS[-1])


def test_old_and_current_kustomize_render_the_same() -> None:
    """CI has Debian's kubectl 1.20 (kustomize v2.0.3); users have current ones."""
    other = os.environ.get(SECOND_KUBECTL_VARIABLE)
    if not other:
        pytest.skip(
            f"set {SECOND_KUBECTL_VARIABLE} to a second kubectl (e.g. Debian's 1.20 "
            "unpacked with dpkg -x) to compare its renders with the kubectl on PATH"
        )
    for name in KUSTOMIZATIONS:
        assert normalized(kustomize(other, name)) == normalized(list(render(name))), name

"""deploy/kubernetes renders with kubectl, validates against published schemas, fits the server."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from scheduler.stats import EngineSnapshot
from service import routes_admin
from service.metrics import ServiceMetrics
from service.settings import ServerSettings
from tests.deploy.tools import (
    DEPLOY_DIR,
    REPO_ROOT,
    TOOL_TIMEOUT_S,
    exposition_families,
    in_ci,
    require_tool,
    run_tool,
)

pytestmark = pytest.mark.slow

KUBE_DIR = DEPLOY_DIR / "kubernetes"
KUSTOMIZATIONS = ("base", "gpu", "cpu")
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
        capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False,
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
        message = ("kubectl is not installed: install Debian's `kubernetes-client` package "
                   "(`bash scripts/install-test-tools.sh` does as root or with sudo)")
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


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_object_validates(name: str, version: str) -> None:
    objects = render(name)
    assert {o["kind"] for o in objects} >= {
        "Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "PersistentVolumeClaim",
        "ServiceMonitor", "HorizontalPodAutoscaler",
    }
    for obj in objects:
        validate(obj, version)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_download_job_validates(version: str) -> None:
    validate(yaml.safe_load(DOWNLOAD_JOB.read_text()), version)


# Edits each validator must refuse, applied to a rendered gpu overlay: proof that it checks.
BROKEN_EDITS: dict[str, tuple[str, Callable[[Obj], None]]] = {
    "probe field typo": ("Deployment", lambda o: o["spec"]["template"]["spec"]["containers"][0][
        "readinessProbe"]["httpGet"].update(paht="/ready")),
    "port as text": ("Service", lambda o: o["spec"]["ports"][0].update(port="8000")),
    "hpa metric typo": ("HorizontalPodAutoscaler", lambda o: o["spec"]["metrics"][0].update(
        pod=o["spec"]["metrics"][0].pop("pods"))),
    "scrape interval": ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(
        interval="15 seconds")),
    "servicemonitor field typo": ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(
        paht="/metrics")),
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
        pytest.skip(f"set {SECOND_KUBECTL_VARIABLE} to a second kubectl (e.g. Debian's 1.20 "
                    "unpacked with dpkg -x) to compare its renders with the kubectl on PATH")
    for name in KUSTOMIZATIONS:
        assert normalized(kustomize(other, name)) == normalized(list(render(name))), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_the_apps_health_routes(overlay: str) -> None:
    main = container(render(overlay))
    paths = {probe: main[probe]["httpGet"]["path"]
             for probe in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert paths == {
        "startupProbe": route_of(routes_admin.health),
        "livenessProbe": route_of(routes_admin.health),
        "readinessProbe": route_of(routes_admin.ready),
    }
    startup = main["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "too short for a load"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_line_up(overlay: str) -> None:
    objects = render(overlay)
    main = container(objects)
    port = effective_settings(objects).port
    assert effective_settings(objects).host == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert port_number(main["ports"], main[probe]["httpGet"]["port"]) == port, probe
    service = only(objects, "Service")
    (service_port,) = service["spec"]["ports"]
    assert port_number(main["ports"], service_port["targetPort"]) == port
    monitor = only(objects, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"]
    assert endpoint["path"] == route_of(routes_admin.metrics)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_prestop_and_drain(overlay: str) -> None:
    objects = render(overlay)
    pod = only(objects, "Deployment")["spec"]["template"]["spec"]
    command = container(objects)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    needed = float(command[1]) + effective_settings(objects).shutdown_timeout + SERVER_EXIT_MARGIN_S
    assert pod["terminationGracePeriodSeconds"] > needed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_environment_holds_only_real_settings(overlay: str) -> None:
    objects = render(overlay)
    env_names = {e["name"] for e in container(objects)["env"]}
    names = set(config_data(objects)) | {n for n in env_names if n.startswith("POOLSERVE_")}
    real = {f"POOLSERVE_{field.upper()}" for field in ServerSettings.model_fields}
    assert names <= real, f"not server settings: {sorted(names - real)}"
    effective_settings(objects)  # every value parses as its setting
    assert effective_settings(objects).device == DEVICE_OF_OVERLAY[overlay]
    pod = only(objects, "Deployment")["spec"]["template"]["spec"]
    # a Service named poolserve would inject POOLSERVE_PORT=tcp://... otherwise
    assert pod["enableServiceLinks"] is False


def test_kustomization_lists_every_setting() -> None:
    listed = set(re.findall(r"^#\s+(POOLSERVE_[A-Z_]+)", (KUBE_DIR / "base" / "kustomization.yaml")
                            .read_text(), re.MULTILINE))
    real = {f"POOLSERVE_{field.upper()}" for field in ServerSettings.model_fields}
    assert listed == real, (
        f"add to base/kustomization.yaml's list: {sorted(real - listed)}; "
        f"remove: {sorted(listed - real)}"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_runs_as_the_images_user_on_a_read_only_root(overlay: str) -> None:
    objects = render(overlay)
    match = re.search(r"^USER (\d+):(\d+)$", (REPO_ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert match is not None
    pod = only(objects, "Deployment")["spec"]["template"]["spec"]
    main = container(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (
        int(match.group(1)), int(match.group(2)))
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert main["securityContext"]["allowPrivilegeEscalation"] is False
    assert main["securityContext"]["capabilities"]["drop"] == ["ALL"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in main["env"]}
    for variable in ("HF_HOME", "HOME", "TMPDIR"):  # where the libraries write
        mount = mounts[env[variable]]
        assert "emptyDir" in volumes[mount["name"]] and not mount.get("readOnly"), variable
    models = next(m for path, m in mounts.items() if env["HF_HUB_CACHE"].startswith(path + "/"))
    claim = volumes[models["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim == only(objects, "PersistentVolumeClaim")["metadata"]["name"]
    assert env["HF_HUB_OFFLINE"] == "1"


def test_only_the_gpu_overlay_asks_for_a_gpu() -> None:
    gpu = container(render("gpu"))["resources"]
    assert int(gpu["limits"][GPU_RESOURCE]) == 1
    for name in ("base", "cpu"):
        assert GPU_RESOURCE not in json.dumps(render(name)), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_the_pods(overlay: str) -> None:
    objects = render(overlay)
    deployment = only(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    assert selects(only(objects, "Service")["spec"]["selector"], pod_labels)
    assert selects(only(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
                   pod_labels)
    service_labels = only(objects, "Service")["metadata"]["labels"]
    assert selects(only(objects, "ServiceMonitor")["spec"]["selector"]["matchLabels"],
                   service_labels)
    target = only(objects, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])


def exported_gauges() -> set[str]:
    """Gauge families the server's /metrics exposes once an engine is bound."""
    metrics = ServiceMetrics()
    zeros: dict[str, Any] = {f.name: 0 for f in dataclasses.fields(EngineSnapshot)}
    zeros["rejected"] = {}
    metrics.bind_engine(lambda: EngineSnapshot(**zeros), lambda: True)
    text = metrics.render().decode()
    assert exposition_families(text)
    return {line.split()[2] for line in text.splitlines()
            if line.startswith("# TYPE ") and line.split()[3] == "gauge"}


def adapter_rule(metric: str) -> Obj:
    """The prometheus-adapter rule that exposes a metric name."""
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    found = [r for r in rules if r["name"]["as"] == metric]
    assert len(found) == 1, f"{len(found)} adapter rules expose {metric}"
    return dict(found[0])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaler_reads_queued_tokens_through_the_adapter(overlay: str) -> None:
    objects = render(overlay)
    (metric,) = only(objects, "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    rule = adapter_rule(name)
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"])
    assert series is not None and re.fullmatch(rule["name"]["matches"], series.group(0))
    assert series.group(0) == "poolserve_queued_tokens"
    assert series.group(0) in exported_gauges()
    assert set(rule["resources"]["overrides"]) >= {"namespace", "pod"}
    settings = effective_settings(objects)
    target = float(metric["pods"]["target"]["averageValue"])
    # above one step's budget (a replica below it is not saturated), under the 429 bound
    assert settings.max_num_batched_tokens < target < settings.max_num_queued_tokens


def test_adapter_query_is_valid_promql(tmp_path: Path) -> None:
    rule = adapter_rule("poolserve_queued_tokens")
    expr = (rule["metricsQuery"].replace("<<.Series>>", "poolserve_queued_tokens")
            .replace("<<.LabelMatchers>>", 'namespace="default",pod=~"poolserve-a|poolserve-b"')
            .replace("<<.GroupBy>>", "pod"))
    assert "<<" not in expr, expr
    rule_file = tmp_path / "adapter_rules.yml"
    rule_file.write_text(yaml.safe_dump(
        {"groups": [{"name": "adapter", "rules": [{"record": "adapter:query", "expr": expr}]}]}))
    result = run_tool([require_tool("promtool"), "check", "rules", str(rule_file)])
    assert result.returncode == 0, result.describe()


def test_download_job_fills_the_deployments_cache() -> None:
    job = yaml.safe_load(DOWNLOAD_JOB.read_text())
    pod = job["spec"]["template"]["spec"]
    (download,) = pod["containers"]
    deployment_env = {e["name"]: e.get("value") for e in container(render("gpu"))["env"]}
    job_env = {e["name"]: e.get("value") for e in download["env"]}
    assert job_env["HF_HUB_CACHE"] == deployment_env["HF_HUB_CACHE"]
    assert "HF_HUB_OFFLINE" not in job_env
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims == {only(render("gpu"), "PersistentVolumeClaim")["metadata"]["name"]}
    assert "from models.resolve import resolve_model_path" in download["command"][-1]

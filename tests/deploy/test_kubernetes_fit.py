"""deploy/kubernetes fits the server: probes, ports, drain, settings, user, GPU, autoscaling."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from poolserve.config.models_file import served_models
from poolserve.config.settings import ServerSettings
from poolserve.http.api import admin as routes_admin
from poolserve.observability.metrics import ServiceMetrics
from poolserve.types.stats import EngineSnapshot
from tests.deploy.kube import (
    ADAPTER_VALUES,
    DEVICE_OF_OVERLAY,
    DOWNLOAD_JOB,
    GPU_RESOURCE,
    KUBE_DIR,
    OVERLAYS,
    SERVER_EXIT_MARGIN_S,
    Obj,
    config_data,
    container,
    effective_settings,
    only,
    port_number,
    render,
    route_of,
    selects,
)
from tests.deploy.tools import (
    REPO_ROOT,
    exposition_families,
    require_tool,
    run_tool,
)

pytestmark = pytest.mark.slow

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_the_apps_health_routes(overlay: str) -> None:
    main = container(render(overlay))
    paths = {
        probe: main[probe]["httpGet"]["path"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe")
    }
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
    listed = set(
        re.findall(
            r"^#\s+(POOLSERVE_[A-Z_]+)",
            (KUBE_DIR / "base" / "kustomization.yaml").read_text(),
            re.MULTILINE,
        )
    )
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
        int(match.group(1)),
        int(match.group(2)),
    )
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
    assert selects(
        only(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels
    )
    service_labels = only(objects, "Service")["metadata"]["labels"]
    assert selects(
        only(objects, "ServiceMonitor")["spec"]["selector"]["matchLabels"], service_labels
    )
    target = only(objects, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])


def exported_gauges() -> set[str]:
    """Gauge families the server's /metrics exposes once an engine is bound."""
    metrics = ServiceMetrics()
    zeros: dict[str, Any] = {f.name: 0 for f in dataclasses.fields(EngineSnapshot)}
    zeros["rejected"] = {}
    metrics.bind_engines({"model": lambda: EngineSnapshot(**zeros)}, lambda: True)
    text = metrics.render().decode()
    assert exposition_families(text)
    return {
        line.split()[2]
        for line in text.splitlines()
        if line.startswith("# TYPE ") and line.split()[3] == "gauge"
    }


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
    expr = (
        rule["metricsQuery"]
        .replace("<<.Series>>", "poolserve_queued_tokens")
        .replace("<<.LabelMatchers>>", 'namespace="default",pod=~"poolserve-a|poolserve-b"')
        .replace("<<.GroupBy>>", "pod")
    )
    assert "<<" not in expr, expr
    rule_file = tmp_path / "adapter_rules.yml"
    rule_file.write_text(
        yaml.safe_dump(
            {"groups": [{"name": "adapter", "rules": [{"record": "adapter:query", "expr": expr}]}]}
        )
    )
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
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert claims == {only(render("gpu"), "PersistentVolumeClaim")["metadata"]["name"]}
    assert "from poolserve.config.model_path import resolve_model_path" in download["command"][-1]


def test_several_models_overlay_mounts_the_models_file_the_settings_name(
    tmp_path: Path,
) -> None:
    objects = render("several-models")
    settings = effective_settings(objects)
    assert settings.models_config is not None and settings.model is None
    mounts = {m["name"]: m["mountPath"] for m in container(objects)["volumeMounts"]}
    volumes = only(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in volumes if "configMap" in v and v["name"] in mounts]
    folder = Path(mounts[volume["name"]])
    assert Path(settings.models_config).parent == folder
    (config,) = [o for o in objects if o["metadata"]["name"] == volume["configMap"]["name"]]
    copy = tmp_path / Path(settings.models_config).name
    copy.write_text(config["data"][copy.name])
    served = served_models(settings.model_copy(update={"models_config": str(copy)}))
    assert len(served.models) == 2

"""docker-compose.yml validates with a real Compose implementation and wires what the docs say."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.tools import REPO_ROOT, StubServer, free_port, require_tool, run_tool

pytestmark = pytest.mark.slow

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
SERVER_DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# After its drain budget the server needs up to this long to exit (engine stop, uvicorn shutdown).
SERVER_EXIT_MARGIN_S = 2.0
DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
SECONDS_PER_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
# Edits that a schema-checking implementation must refuse: each breaks a section the docs rely on.
BROKEN_EDITS = {
    "gpu reservation key": ("reservations:", "reservation:"),
    "profiles type": ("profiles: [cpu]", "profiles: cpu"),
    "healthcheck key": ("start_period:", "start_periodd:"),
    "grace period type": ("stop_grace_period: 45s", "stop_grace_period: [45s]"),
}


def compose(*args: str, file: Path = COMPOSE_FILE) -> tuple[int, str]:
    """Run docker-compose (no engine needed for `config`) on a compose file."""
    result = run_tool([require_tool("docker-compose"), "-f", str(file), *args], cwd=file.parent)
    return result.returncode, result.output


@functools.cache
def normalized(profile: str | None = None) -> dict[str, Any]:
    """The configuration as docker-compose resolves it (anchors merged); shared, read-only."""
    profile_args = ("--profile", profile) if profile else ()
    code, output = compose(*profile_args, "config")
    assert code == 0, output
    config: dict[str, Any] = yaml.safe_load(output)
    return config


def seconds(duration: str) -> float:
    """Compose duration ("1m30s", "45s") in seconds."""
    parts = DURATION_PART.findall(duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * SECONDS_PER_UNIT[u] for n, u in parts)


@pytest.mark.parametrize("profile", [None, "cpu"])
def test_compose_config_is_valid(profile: str | None) -> None:
    profile_args = ("--profile", profile) if profile else ()
    code, output = compose(*profile_args, "config", "-q")
    assert code == 0, output


@pytest.mark.parametrize("edit", sorted(BROKEN_EDITS))
def test_validator_refuses_broken_sections(edit: str, tmp_path: Path) -> None:
    old, new = BROKEN_EDITS[edit]
    text = COMPOSE_FILE.read_text()
    assert old in text, f"{old!r} no longer in docker-compose.yml; update BROKEN_EDITS"
    shutil.copytree(REPO_ROOT / "deploy", tmp_path / "deploy")
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new))
    code, output = compose("config", "-q", file=broken)
    assert code != 0, f"docker-compose accepted a broken {edit}:\n{output}"


def test_gpu_service_reserves_an_nvidia_gpu() -> None:
    service = normalized()["services"]["poolserve"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert service["environment"]["POOLSERVE_DEVICE"] == "cuda"
    assert "profiles" not in service


def test_cpu_profile_runs_without_a_gpu() -> None:
    service = normalized("cpu")["services"]["poolserve-cpu"]
    assert service["profiles"] == ["cpu"]
    assert "deploy" not in service
    assert service["environment"]["POOLSERVE_DEVICE"] == "cpu"
    assert service["build"]["args"]["VARIANT"] == "cpu"
    # Prometheus scrapes poolserve:8000 whichever variant runs.
    assert "poolserve" in service["networks"]["default"]["aliases"]


@pytest.mark.parametrize("name", ["poolserve", "poolserve-cpu"])
def test_server_service_settings(name: str) -> None:
    service = normalized("cpu")["services"][name]
    env = service["environment"]
    assert env["POOLSERVE_HOST"] == "0.0.0.0"
    assert env["HF_HOME"] == "/data"
    assert any(v.endswith(":/data:rw") for v in service["volumes"]), service["volumes"]
    assert service["healthcheck"]["test"][0] == "CMD"
    shutdown_s = float(env.get("POOLSERVE_SHUTDOWN_TIMEOUT") or SERVER_DEFAULT_SHUTDOWN_TIMEOUT_S)
    assert seconds(service["stop_grace_period"]) > shutdown_s + SERVER_EXIT_MARGIN_S
    assert service["stop_signal"] == "SIGTERM"
    # Unset options must stay unset (an empty string would be an invalid model name or API key).
    for option in ("POOLSERVE_MODEL", "POOLSERVE_API_KEY"):
        assert env.get(option) is None


def test_monitoring_mounts_exist() -> None:
    services = normalized()["services"]
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("/"):
                assert Path(source).exists(), f"{name} mounts missing {source}"
    command = services["prometheus"]["command"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in command


def compose_healthcheck_returncode(port: int) -> int:
    """Run the compose healthcheck command (with this python) against a loopback port."""
    command = normalized()["services"]["poolserve"]["healthcheck"]["test"]
    assert command[:2] == ["CMD", "python3"]
    script = command[3].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=30, check=False
    )
    return completed.returncode


def test_compose_healthcheck_follows_readiness(http_stub: StubServer) -> None:
    port = http_stub.server_address[1]
    http_stub.status_for.update({"/health": 200, "/ready": 503})
    assert compose_healthcheck_returncode(port) != 0
    http_stub.status_for["/ready"] = 200
    assert compose_healthcheck_returncode(port) == 0


def test_compose_healthcheck_fails_when_nothing_listens() -> None:
    assert compose_healthcheck_returncode(free_port()) != 0

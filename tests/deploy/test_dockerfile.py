"""The Dockerfile passes hadolint; its final stage runs `poolserve serve` as the docs say."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from poolserve.memory import MMAP_THRESHOLD_BYTES
from tests.deploy.tools import REPO_ROOT, StubServer, free_port, require_tool, run_tool

pytestmark = pytest.mark.slow

DOCKERFILE = REPO_ROOT / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction with its continuation lines joined."""

    keyword: str
    arguments: str


def parse_instructions() -> list[Instruction]:
    """All instructions of the Dockerfile, comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            keyword, _, arguments = pending.strip().partition(" ")
            instructions.append(Instruction(keyword.upper(), arguments.strip()))
            pending = ""
    return instructions


def final_stage() -> list[Instruction]:
    """Instructions after the last FROM: what the shipped image is made of."""
    instructions = parse_instructions()
    last_from = max(i for i, ins in enumerate(instructions) if ins.keyword == "FROM")
    return instructions[last_from:]


def only(stage: list[Instruction], keyword: str) -> str:
    """Arguments of the single `keyword` instruction in the stage."""
    found = [ins.arguments for ins in stage if ins.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword} in the final stage, found {found}"
    return found[0]


def test_hadolint_passes() -> None:
    result = run_tool([require_tool("hadolint"), "--no-color", str(DOCKERFILE)])
    assert result.returncode == 0, result.describe()


def test_every_ignored_rule_is_justified() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for index, line in enumerate(lines):
        if "hadolint ignore=" in line:
            previous = lines[index - 1].strip()
            assert previous.startswith("#") and "hadolint ignore=" not in previous, (
                f"line {index + 1}: `{line.strip()}` needs a comment saying why, on the line above"
            )


def test_entrypoint_is_exec_form_poolserve_serve() -> None:
    # Exec form: no shell between Docker and the server, so SIGTERM reaches it and it drains.
    assert json.loads(only(final_stage(), "ENTRYPOINT")) == ["poolserve", "serve"]
    assert not [ins for ins in final_stage() if ins.keyword == "CMD"]


def test_stop_signal_is_sigterm() -> None:
    # SIGTERM is what starts the drain; Docker sends STOPSIGNAL on `docker stop`.
    assert only(final_stage(), "STOPSIGNAL") == "SIGTERM"


def test_runtime_user_cache_and_port() -> None:
    stage = final_stage()
    user = only(stage, "USER").split(":")[0]
    assert user.isdigit() and int(user) != 0, f"runs as {user!r}, expected a numeric non-root uid"
    assert only(stage, "EXPOSE") == "8000"
    assert json.loads(only(stage, "VOLUME")) == ["/data"]
    env = " ".join(ins.arguments for ins in stage if ins.keyword == "ENV").split()
    for setting in ("HF_HOME=/data", "POOLSERVE_HOST=0.0.0.0", "POOLSERVE_PORT=8000"):
        assert setting in env
    # The allocator set-up of docs/benchmarks.md ("Memory under load"), as `make serve` sets it.
    assert f"GLIBC_TUNABLES=glibc.malloc.mmap_threshold={MMAP_THRESHOLD_BYTES}" in env


def test_cuda_and_cpu_variants() -> None:
    froms = [ins.arguments for ins in parse_instructions() if ins.keyword == "FROM"]
    assert "${CUDA_IMAGE} AS base-cuda" in froms
    assert "${CPU_IMAGE} AS base-cpu" in froms
    args = [ins.arguments for ins in parse_instructions() if ins.keyword == "ARG"]
    cuda_image = next(a for a in args if a.startswith("CUDA_IMAGE="))
    assert "nvidia/cuda:" in cuda_image and "runtime" in cuda_image
    assert "VARIANT=cuda" in args


def test_cpu_variant_takes_torch_from_the_cpu_index() -> None:
    # PyPI's Linux torch wheels are CUDA builds of several GB, pinned or not.
    instructions = parse_instructions()
    start = next(i for i, ins in enumerate(instructions) if ins.arguments.endswith("base-cpu"))
    stage = instructions[start + 1 :]
    stage = stage[: next(i for i, ins in enumerate(stage) if ins.keyword == "FROM")]
    env = " ".join(ins.arguments for ins in stage if ins.keyword == "ENV")
    assert "TORCH_INDEX_DEFAULT=https://download.pytorch.org/whl/cpu" in env


def test_installs_like_the_makefile_without_dev_extras() -> None:
    pip_runs = [ins.arguments for ins in parse_instructions() if "pip install" in ins.arguments]
    assert len(pip_runs) == 2, pip_runs
    torch_run, project_run = pip_runs
    assert "TORCH_SPEC" in torch_run and "TORCH_INDEX" in torch_run
    assert project_run.endswith('pip install --no-cache-dir -c constraints.txt ".[tracing]"')
    assert not any(" -e " in run or "[dev]" in run for run in pip_runs)


def healthcheck_returncode(port: int) -> int:
    """Run the Dockerfile's HEALTHCHECK command (with this python) against a port."""
    command = json.loads(only(final_stage(), "HEALTHCHECK").split(" CMD ", 1)[1])
    assert command[0] == "python3"
    env = {"POOLSERVE_PORT": str(port)}
    completed = subprocess.run(
        [sys.executable, *command[1:]], env=env, capture_output=True, timeout=30, check=False
    )
    return completed.returncode


def test_healthcheck_command_follows_health(http_stub: StubServer) -> None:
    port = http_stub.server_address[1]
    http_stub.status_for["/health"] = 200
    assert healthcheck_returncode(port) == 0
    http_stub.status_for["/health"] = 500
    assert healthcheck_returncode(port) != 0


def test_healthcheck_command_fails_when_nothing_listens() -> None:
    assert healthcheck_returncode(free_port()) != 0

"""Amazon SageMaker's image: its Dockerfile passes hadolint, its entry script shellcheck, and the
script starts `poolserve serve` as SageMaker needs it (the `serve` argument dropped, the model
from HF_MODEL_ID or the unpacked model_data, port 8080), checked with a stand-in `poolserve`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.deploy.tools import REPO_ROOT, require_tool, run_tool

pytestmark = pytest.mark.slow

SCRIPT = REPO_ROOT / "deploy" / "sagemaker" / "serve"
DOCKERFILE = REPO_ROOT / "deploy" / "sagemaker" / "Dockerfile"
# a stand-in for the server: writes its arguments and the settings it would read
STAND_IN = """#!/bin/sh
{ echo "args=$*"; env | grep '^POOLSERVE_' | sort; } > "$RECORD"
"""


def test_hadolint_and_shellcheck_pass() -> None:
    for tool, path in (("hadolint", DOCKERFILE), ("shellcheck", SCRIPT)):
        result = run_tool([require_tool(tool), str(path)])
        assert result.returncode == 0, result.describe()


def _start(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[int, str, dict[str, str]]:
    """The script run as SageMaker runs it: (exit status, stderr, what the stand-in recorded)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_in = bin_dir / "poolserve"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    record = tmp_path / "record"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("POOLSERVE_", "HF_", "SM_"))}
    full_env = {
        **base,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "RECORD": str(record),
        "SM_MODEL_DIR": str(tmp_path / "opt-ml-model"),
        **env,
    }
    done = subprocess.run(
        [str(SCRIPT), *args], env=full_env, capture_output=True, text=True, timeout=30
    )
    recorded: dict[str, str] = {}
    if record.exists():
        for line in record.read_text().splitlines():
            key, _, value = line.partition("=")
            recorded[key] = value
    return done.returncode, done.stderr, recorded


def test_a_hub_model_on_port_8080(tmp_path: Path) -> None:
    env = {"HF_MODEL_ID": "BAAI/bge-small-en-v1.5", "HF_MODEL_REVISION": "abc123"}
    status, _, recorded = _start(tmp_path, env, "serve", "--dtype", "float32")
    assert status == 0
    assert recorded == {
        "args": "serve --dtype float32",  # SageMaker's `serve` dropped, the flags kept
        "POOLSERVE_HOST": "0.0.0.0",
        "POOLSERVE_MODEL": "BAAI/bge-small-en-v1.5",
        "POOLSERVE_PORT": "8080",
        "POOLSERVE_REVISION": "abc123",
    }


def test_model_data_unpacked_by_sagemaker(tmp_path: Path) -> None:
    (tmp_path / "opt-ml-model").mkdir()
    (tmp_path / "opt-ml-model" / "config.json").write_text("{}")
    status, _, recorded = _start(tmp_path, {"SAGEMAKER_BIND_TO_PORT": "9090"}, "serve")
    assert status == 0
    assert recorded["POOLSERVE_MODEL"] == str(tmp_path / "opt-ml-model")
    assert recorded["POOLSERVE_PORT"] == "9090"  # an inference pipeline's port
    assert recorded["args"] == "serve"


def test_no_model_is_one_line_and_exit_1(tmp_path: Path) -> None:
    status, stderr, recorded = _start(tmp_path, {}, "serve")
    assert status == 1 and not recorded
    assert "HF_MODEL_ID" in stderr and len(stderr.strip().splitlines()) == 1

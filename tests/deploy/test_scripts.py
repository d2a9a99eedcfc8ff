"""The install and smoke scripts pass shellcheck; the installer is a no-op once the tools exist.

Without the rights to install, the installer says what to install and lets the tests skip, except
under CI, where a missing tool is a failure.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.tools import REPO_ROOT, require_tool, run_tool

pytestmark = pytest.mark.slow

SCRIPTS = ("scripts/install-test-tools.sh", "scripts/docker-smoke.sh", "scripts/gpu_check.sh")
INSTALLED_TOOLS = ("promtool", "prometheus", "docker-compose", "kubectl", "openssl", "haproxy")


@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck_passes(script: str) -> None:
    result = run_tool([require_tool("shellcheck"), str(REPO_ROOT / script)])
    assert result.returncode == 0, result.describe()


def test_install_script_does_nothing_when_tools_are_present() -> None:
    for tool in INSTALLED_TOOLS:
        require_tool(tool)
    result = run_tool(["bash", str(REPO_ROOT / "scripts/install-test-tools.sh")])
    assert (result.returncode, result.output) == (0, ""), result.describe()


def test_smoke_script_refuses_an_unknown_variant() -> None:
    result = run_tool(["bash", str(REPO_ROOT / "scripts/docker-smoke.sh"), "tpu"])
    assert result.returncode == 2, result.describe()
    assert "usage:" in result.output


def _run_installer_without_apt(tmp_path: Path, ci: str) -> subprocess.CompletedProcess[str]:
    """The installer on a PATH with neither the tools, nor apt-get, nor sudo."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for command in ("sort", "id"):
        found = shutil.which(command)
        assert found is not None
        (bin_dir / command).symlink_to(found)
    bash = shutil.which("bash")
    assert bash is not None
    return subprocess.run(
        [bash, str(REPO_ROOT / "scripts/install-test-tools.sh")],
        env={"PATH": str(bin_dir), "CI": ci},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(("ci", "returncode"), [("", 0), ("true", 1)])
def test_installer_without_rights_says_what_to_install(
    tmp_path: Path, ci: str, returncode: int
) -> None:
    result = _run_installer_without_apt(tmp_path, ci)
    assert result.returncode == returncode, result.stderr
    hint = "apt-get install --no-install-recommends "
    (line,) = [line for line in result.stderr.splitlines() if hint in line]
    packages = line.split(hint, 1)[1].split()
    assert packages == sorted(packages)
    wanted = {"docker-compose", "haproxy", "kubernetes-client", "openssl", "prometheus"}
    assert wanted <= set(packages), line


@pytest.mark.parametrize("ci", ["", "true"])
def test_a_missing_tool_skips_outside_ci_and_fails_under_ci(
    ci: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", ci)
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(outcome, match="promtool-that-does-not-exist is not installed"):
        require_tool("promtool-that-does-not-exist")

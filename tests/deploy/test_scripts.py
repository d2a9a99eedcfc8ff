"""The install and smoke scripts pass shellcheck; the installer is a no-op once the tools exist."""

from __future__ import annotations

import pytest

from tests.deploy.tools import REPO_ROOT, require_tool, run_tool

pytestmark = pytest.mark.slow

SCRIPTS = ("scripts/install-test-tools.sh", "scripts/docker-smoke.sh")
INSTALLED_TOOLS = ("promtool", "prometheus", "docker-compose")


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

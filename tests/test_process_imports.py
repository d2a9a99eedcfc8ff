"""What each process loads: a front end, the HTTP app, the supervisor and the CLI's argument
parsing load no torch and no engine or model code (only the engine core does)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Packages only the engine-core process may load.
ENGINE_ONLY = ("torch", "poolserve.engine", "poolserve.models", "poolserve.pooling")

PROBE = """
import json, sys
{body}
print(json.dumps(sorted(sys.modules)))
"""
CASES = {
    "front end (HTTP app, uvicorn runner, start-up)": (
        "import poolserve.http.app, poolserve.http.edge.server, poolserve.frontend.startup"
    ),
    "supervisor": "import poolserve.supervisor",
    "CLI argument parsing": (
        "import poolserve.cli\n"
        "poolserve.cli.build_parser().parse_args(['serve', '--port', '8123'])\n"
        "from poolserve.config.flags import parse_settings\n"
        "parse_settings(['serve', '--port', '8123', '--max-num-seqs', '8'])"
    ),
    "Python API (imported, not started)": "import poolserve.offline",
}


def _modules(body: str) -> list[str]:
    """The modules a fresh interpreter holds after running `body`."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(body=body)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    modules: list[str] = json.loads(result.stdout.strip().splitlines()[-1])
    return modules


@pytest.mark.parametrize("case", sorted(CASES))
def test_loads_no_engine_code(case: str) -> None:
    loaded = _modules(CASES[case])
    assert "poolserve" in loaded  # the probe ran
    assert [m for m in loaded if m.startswith(ENGINE_ONLY)] == []


def test_the_engine_core_does_load_them() -> None:
    """The probe can fail: the engine core's own entry loads the engine and torch."""
    loaded = _modules("import poolserve.engine.process")
    assert "torch" in loaded and "poolserve.engine.loop" in loaded

"""What each process loads: a front end, the HTTP app, the supervisor and the CLI's argument
parsing load no torch and no engine or model code (only the engine core does); the Python API,
started and serving, loads no web framework and no HTTP module (only its `request()` does)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

# Packages only the engine-core process may load.
ENGINE_ONLY = ("torch", "poolserve.engine", "poolserve.models", "poolserve.pooling")
# What the Python API's own calls never need: the web stack and the HTTP layer.
WEB = ("fastapi", "starlette", "uvicorn", "httpx", "poolserve.http")

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
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    modules: list[str] = json.loads(result.stdout.strip().splitlines()[-1])
    return modules


def _under(loaded: Iterable[str], packages: tuple[str, ...]) -> list[str]:
    """The loaded modules that are one of `packages` or inside one (`httpx2` is not `httpx`)."""
    return [m for m in loaded if any(m == p or m.startswith(f"{p}.") for p in packages)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_loads_no_engine_code(case: str) -> None:
    loaded = _modules(CASES[case])
    assert "poolserve" in loaded  # the probe ran
    assert [m for m in loaded if m.startswith(ENGINE_ONLY)] == []


def test_the_engine_core_does_load_them() -> None:
    """The probe can fail: the engine core's own entry loads the engine and torch."""
    loaded = _modules("import poolserve.engine.process")
    assert "torch" in loaded and "poolserve.engine.loop" in loaded


# Every call of both engines, each on a tiny model that serves it; `request()` is the one call
# that builds the HTTP app, so it is left out.
SERVING = """
import asyncio
from poolserve.offline import AsyncPoolingEngine, PoolingEngine

with PoolingEngine({embedder!r}) as engine:
    engine.embed_array(["a text"])
    engine.encode(["a text"], "token_embed")
    engine.score("a query", ["a text"])
    engine.rerank("a query", ["a text", "another"])
    engine.embed(["a long text"], late_chunking={{"chunk_size": 2}})

async def classify():
    async with AsyncPoolingEngine({classifier!r}) as engine:
        await engine.classify(["a text"])

asyncio.run(classify())
"""


def test_the_python_api_serves_without_the_web_stack(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    """Started, embedding, scoring and classifying, the Python API runs the front end alone."""
    body = SERVING.format(
        embedder=str(tiny_model_dir("bert")), classifier=str(tiny_model_dir("llama_cls3"))
    )
    loaded = _modules(body)
    assert "poolserve.engine.loop" in loaded  # the probe started an engine
    assert _under(loaded, WEB) == []

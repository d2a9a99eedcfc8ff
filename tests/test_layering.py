"""Imports point downstream only, all under poolserve, and the packages follow the processes.

`types` is the torch-free vocabulary every layer shares and imports nothing of the project;
`config` builds the settings on it. The engine-core process runs `engine` on `models` and
`pooling` (which never import each other). Front-end processes run `http` on `frontend`, which
import neither the engine nor the model code (tests/test_process_imports.py checks what a front
end actually loads). `offline` (the Python API) runs on `frontend`: only its `request()` builds
the app, imported there; `jobs` run on `offline`.
Inside http: api and compat never import each other; only the app factory imports dispatch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "poolserve"
TOP = {"cli", "supervisor", "memory", "__main__"}
PACKAGES = {
    "types",
    "config",
    "models",
    "pooling",
    "engine",
    "observability",
    "frontend",
    "http",
    "grpc",
    "offline",
    "jobs",
}
# package -> the project's packages and top-level modules it may import (itself always)
ALLOWED = {
    "types": set(),
    "config": {"types"},
    "models": {"types", "config"},
    "pooling": {"types"},
    "engine": {"types", "config", "models", "pooling"},
    "observability": {"types", "config"},
    "frontend": {"types", "config", "observability"},
    "http": {"types", "config", "observability", "frontend", "memory"},
    # TEI's gRPC API: beside http, on the same pipeline; it reuses the HTTP side's error table
    # and TEI translation helpers, and http never imports it (the process entries pass it in)
    "grpc": {"types", "config", "observability", "frontend", "http"},
    "offline": {"types", "config", "observability", "frontend"},
    "jobs": {"types", "config", "observability", "frontend", "offline", "http"},
}


def _imported_modules(path: Path, *, top_level_only: bool = False) -> set[str]:
    """Every absolute module name the file imports (at module level only, if asked)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _subpackages(path: Path, *, top_level_only: bool = False) -> set[str]:
    """The poolserve subpackages and top-level modules a file imports (poolserve.X -> X)."""
    return {
        name.split(".")[1]
        for name in _imported_modules(path, top_level_only=top_level_only)
        if name.startswith("poolserve.") and name.count(".") >= 1
    }


# (file, package) imports made inside a function, where the one process that needs them runs
LAZY = {
    # --api-server-count 0 and the Python API run the engine core on the front end's loop
    ("poolserve/frontend/startup.py", "engine"),
    ("poolserve/frontend/state.py", "engine"),  # its type only (TYPE_CHECKING)
    # --otlp-traces-endpoint: the OpenTelemetry extra is checked where the flags are parsed
    ("poolserve/config/flags.py", "observability"),
    # request() answers a raw HTTP request through the app (run-batch replays request bodies);
    # the Python API's other calls never load it
    ("poolserve/offline/app_client.py", "http"),
}


def test_every_package_has_its_rule() -> None:
    found = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert found == PACKAGES
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert modules == TOP


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_back_edges(package: str) -> None:
    allowed = ALLOWED[package] | {package}
    offenders = {}
    for path in (PACKAGE / package).rglob("*.py"):
        name = path.relative_to(ROOT).as_posix()
        eager = _subpackages(path, top_level_only=True) - allowed
        lazy = _subpackages(path) - allowed - {p for f, p in LAZY if f == name}
        if eager | lazy:
            offenders[name] = sorted(eager | lazy)
    assert offenders == {}


def test_lazy_imports_stay_inside_functions() -> None:
    for name, package in LAZY:
        assert package not in _subpackages(ROOT / name, top_level_only=True)
        assert package in _subpackages(ROOT / name)


def test_no_relative_or_bare_imports() -> None:
    """Every project import names the poolserve root (no `import http`, no relative ones)."""
    # stdlib and library names, imported as such
    bare = (PACKAGES | TOP | {"bench"}) - {"types", "http", "grpc"}
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        relative = any(isinstance(n, ast.ImportFrom) and n.level > 0 for n in ast.walk(tree))
        names = _imported_modules(path)
        if relative or {n.split(".")[0] for n in names} & bare:
            offenders[str(path.relative_to(ROOT))] = sorted(names)
    assert offenders == {}


# top-level module -> what it loads only inside the function that needs it (the CLI's commands
# add their parsers from jobs' light modules; tests/test_process_imports.py checks what loads)
LATE = {
    "supervisor.py": {"engine", "models", "pooling", "frontend", "http", "grpc", "offline", "jobs"},
    "cli.py": {"engine", "models", "pooling", "frontend", "http", "grpc", "offline"},
}


@pytest.mark.parametrize("module", sorted(LATE))
def test_process_code_loads_late(module: str) -> None:
    """The supervisor starts the engine core and the front ends; their code loads in them."""
    names = _imported_modules(PACKAGE / module, top_level_only=True)
    imported = {n.split(".")[1] for n in names if n.startswith("poolserve.")}
    assert imported & LATE[module] == set()


# http layer -> http layers it must never import
HTTP_FORBIDDEN = {
    "api": {"compat", "edge", "dispatch", "app"},
    "compat": {"api", "edge", "dispatch", "app"},
}
# modules that may import a layer nobody else may
ONLY_IMPORTED_BY = {"dispatch": {"app"}}


def _http_layers(path: Path) -> set[str]:
    """The http layers a file imports (poolserve.http.X -> X)."""
    return {
        name.split(".")[2]
        for name in _imported_modules(path)
        if name.startswith("poolserve.http.") and name.count(".") >= 2
    }


def _layer_of(path: Path) -> str:
    """An http file's layer: its folder under http/, else its module name."""
    return path.relative_to(PACKAGE / "http").with_suffix("").parts[0]


@pytest.mark.parametrize("layer", sorted(HTTP_FORBIDDEN))
def test_http_layers_point_one_way(layer: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(_http_layers(path) & HTTP_FORBIDDEN[layer])
        for path in (PACKAGE / "http" / layer).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize("layer", sorted(ONLY_IMPORTED_BY))
def test_dispatch_has_one_importer(layer: str) -> None:
    importers = {
        str(path.relative_to(ROOT))
        for path in (PACKAGE / "http").rglob("*.py")
        if layer in _http_layers(path) and _layer_of(path) not in ONLY_IMPORTED_BY[layer]
    }
    assert importers == set()


def test_planner_is_pure() -> None:
    path = PACKAGE / "engine" / "sched" / "planner.py"
    imported = {n.split(".")[0] for n in _imported_modules(path)}
    assert not imported & {"torch", "asyncio", "time"}


# The web stack and request validation: only the HTTP layer (and config, for pydantic) imports
# them; the front end works on frozen dataclasses.
WEB = {"fastapi", "starlette", "uvicorn", "h11", "httptools", "pydantic"}


def test_the_front_end_imports_no_web_framework() -> None:
    """Jobs, tokenization, the engine client and start-up run under the Python API as under the
    server: the request's HTTP side lives in http/calls.py, its bodies in http/bodies.py."""
    offenders = {}
    for path in (PACKAGE / "frontend").rglob("*.py"):
        web = {name.split(".")[0] for name in _imported_modules(path)} & WEB
        if web:
            offenders[str(path.relative_to(ROOT))] = sorted(web)
    assert offenders == {}

"""Imports point downstream only: cli -> jobs -> offline -> service -> core -> scheduler ->
(models, pooling), all under poolserve.

Inside service: api and compat -> frontend -> scheduler; compat and api never import each other;
only the app factory (and the CLI that starts the server) imports the edge; only the app factory
imports dispatch, the one module that picks a family's handler by body shape.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "poolserve"
# package -> packages it must never import
ABOVE_SERVICE = {"offline", "jobs", "cli"}
FORBIDDEN = {
    "models": {"pooling", "scheduler", "core", "service", *ABOVE_SERVICE},
    "pooling": {"models", "scheduler", "core", "service", *ABOVE_SERVICE},
    "scheduler": {"core", "service", *ABOVE_SERVICE},
    "core": {"service", *ABOVE_SERVICE},
    "service": ABOVE_SERVICE,
    "offline": {"jobs", "cli"},
    "jobs": {"cli"},
}


def _imported_modules(path: Path) -> set[str]:
    """Every absolute module name the file imports."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _subpackages(path: Path) -> set[str]:
    """The poolserve subpackages a file imports (poolserve.X -> X)."""
    return {
        name.split(".")[1]
        for name in _imported_modules(path)
        if name.startswith("poolserve.") and name.count(".") >= 1
    }


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_back_edges(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(_subpackages(path) & FORBIDDEN[package])
        for path in (PACKAGE / package).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_relative_or_bare_imports() -> None:
    """Every project import names the poolserve root (no `import service`, no relative ones)."""
    bare = {"models", "pooling", "scheduler", "core", "service", "offline", "jobs", "bench"}
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        relative = any(isinstance(n, ast.ImportFrom) and n.level > 0 for n in ast.walk(tree))
        names = _imported_modules(path)
        if relative or {n.split(".")[0] for n in names} & bare:
            offenders[str(path.relative_to(ROOT))] = sorted(names)
    assert offenders == {}


# service layer -> service layers it must never import
SERVICE_FORBIDDEN = {
    "api": {"compat", "edge", "dispatch", "app", "cli"},
    "compat": {"api", "edge", "dispatch", "app", "cli"},
    "frontend": {"api", "compat", "edge", "dispatch", "app", "cli"},
    "observability": {"api", "compat", "frontend", "edge", "dispatch", "app", "cli"},
}
# modules that may import a layer nobody else may
ONLY_IMPORTED_BY = {"edge": {"app", "cli", "edge"}, "dispatch": {"app"}}


def _service_layers(path: Path) -> set[str]:
    """The service layers a file imports (poolserve.service.X -> X)."""
    return {
        name.split(".")[2]
        for name in _imported_modules(path)
        if name.startswith("poolserve.service.") and name.count(".") >= 2
    }


def _layer_of(path: Path) -> str:
    """A service file's layer: its folder under service/, else its module name."""
    parts = path.relative_to(PACKAGE / "service").with_suffix("").parts
    return parts[0]


@pytest.mark.parametrize("layer", sorted(SERVICE_FORBIDDEN))
def test_service_layers_point_one_way(layer: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(_service_layers(path) & SERVICE_FORBIDDEN[layer])
        for path in (PACKAGE / "service" / layer).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize("layer", sorted(ONLY_IMPORTED_BY))
def test_edge_and_dispatch_have_one_importer(layer: str) -> None:
    importers = {
        str(path.relative_to(ROOT))
        for path in (PACKAGE / "service").rglob("*.py")
        if layer in _service_layers(path) and _layer_of(path) not in ONLY_IMPORTED_BY[layer]
    }
    assert importers == set()


def test_models_and_pooling_share_only_kinds() -> None:
    """The one module both may import holds plain enums and imports nothing of the project."""
    assert _subpackages(PACKAGE / "kinds.py") == set()


def test_planner_is_pure() -> None:
    imported = {n.split(".")[0] for n in _imported_modules(PACKAGE / "scheduler" / "planner.py")}
    assert not imported & {"torch", "asyncio", "time"}

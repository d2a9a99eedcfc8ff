"""Imports point downstream only: service -> scheduler -> (models, pooling), all under poolserve."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "poolserve"
# package -> packages it must never import
FORBIDDEN = {
    "models": {"pooling", "scheduler", "service"},
    "pooling": {"models", "scheduler", "service"},
    "scheduler": {"service"},
    "service": set(),
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
    bare = {"models", "pooling", "scheduler", "service", "bench"}
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        relative = any(isinstance(n, ast.ImportFrom) and n.level > 0 for n in ast.walk(tree))
        names = _imported_modules(path)
        if relative or {n.split(".")[0] for n in names} & bare:
            offenders[str(path.relative_to(ROOT))] = sorted(names)
    assert offenders == {}


def test_planner_is_pure() -> None:
    imported = {n.split(".")[0] for n in _imported_modules(PACKAGE / "scheduler" / "planner.py")}
    assert not imported & {"torch", "asyncio", "time"}

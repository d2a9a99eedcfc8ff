"""Imports point downstream only: service -> scheduler -> (models, pooling)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> packages it must never import
FORBIDDEN = {
    "models": {"pooling", "scheduler", "service"},
    "pooling": {"models", "scheduler", "service"},
    "scheduler": {"service"},
    "service": set(),
}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_back_edges(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imported_packages(path) & FORBIDDEN[package])
        for path in (ROOT / package).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_planner_is_pure() -> None:
    imported = _imported_packages(ROOT / "scheduler" / "planner.py")
    assert not imported & {"torch", "asyncio", "time"}

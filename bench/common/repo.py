"""The source tree the benchmarks run from: its root, where results go, the revision measured."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "bench" / "results"  # git-ignored
DOCS_DIR = ROOT / "docs"  # where full runs draw their plots


def source_revision() -> str:
    """The commit measured, and whether poolserve/ had uncommitted changes (read-only git)."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", "poolserve"],
        capture_output=True,
        text=True,
        check=False,
    )
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    extra = " + uncommitted changes under poolserve/" if dirty.stdout.strip() else ""
    return f"commit {head.stdout.strip()}{extra}"

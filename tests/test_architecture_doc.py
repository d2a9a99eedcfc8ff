"""docs/architecture.md lists every module once and names no module that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


def test_every_module_has_its_line_and_every_line_its_module() -> None:
    modules = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "poolserve").rglob("*.py")
        if path.name != "__init__.py"
    }
    listed = re.findall(r"^- `(poolserve/[\w/]+\.py)` — ", DOC.read_text(), flags=re.MULTILINE)
    assert sorted(modules - set(listed)) == []
    assert sorted(set(listed) - modules) == []
    assert len(listed) == len(set(listed))

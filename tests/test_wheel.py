"""The built wheel installs one top-level package, `poolserve`, and its console script."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_has_one_import_root(tmp_path: Path) -> None:
    # a copy of what the build reads, so the build leaves nothing in the work tree
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "poolserve", source / "poolserve", ignore=shutil.ignore_patterns("__pycache__")
    )
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("poolserve-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        tops = {name.split("/")[0] for name in names}
        (info,) = (top for top in tops if top.endswith(".dist-info"))
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert tops == {"poolserve", info}
    # every package of the source tree ships (a folder without __init__.py would be left out)
    packages = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "poolserve").rglob("*.py")}
    assert packages <= {name.rsplit("/", 1)[0] for name in names}
    assert "poolserve = poolserve.cli:main" in entry_points

"""One allocator set-up wherever the server starts: the image, `make serve`, service/memory.py."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from poolserve.memory import (
    ALLOCATOR_VARIABLES,
    MMAP_THRESHOLD_BYTES,
    fix_mmap_threshold,
)
from tests.deploy.tools import REPO_ROOT

TUNABLE = f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD_BYTES}"


def test_make_serve_sets_the_same_threshold() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert f"SERVE_GLIBC_TUNABLES := {TUNABLE}\n" in makefile
    serve = makefile.split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "GLIBC_TUNABLES=" in serve and "$(SERVE_GLIBC_TUNABLES)" in serve


@pytest.mark.parametrize("variable", ALLOCATOR_VARIABLES)
def test_an_allocator_set_by_the_environment_is_left_alone(variable: str) -> None:
    assert not fix_mmap_threshold({variable: ""})


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_threshold_is_fixed_in_process_without_such_variables() -> None:
    # In a child process: the setting would otherwise stay with the test process.
    code = "from poolserve.memory import fix_mmap_threshold; print(fix_mmap_threshold({}))"
    completed = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.stdout.strip() == "True", completed.stderr

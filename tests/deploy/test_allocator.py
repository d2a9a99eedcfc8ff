"""One allocator set-up wherever the server starts: the image, `make serve`, service/memory.py."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from poolserve.memory import (
    ALLOCATOR_VARIABLES,
    HUGE_PAGES_TUNABLE,
    MMAP_THRESHOLD_BYTES,
    MMAP_TUNABLE,
    core_environment,
    fix_mmap_threshold,
)
from tests.deploy.tools import REPO_ROOT, thp_mode

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


GLIBC = platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="the tunables are glibc's")
@pytest.mark.parametrize(
    ("given", "wanted"),
    [
        ({}, f"{MMAP_TUNABLE}:{HUGE_PAGES_TUNABLE}"),  # what fix_mmap_threshold sets, plus pages
        ({"GLIBC_TUNABLES": MMAP_TUNABLE}, f"{MMAP_TUNABLE}:{HUGE_PAGES_TUNABLE}"),  # the image's
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "glibc.malloc.hugetlb=0"),  # opted out
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, HUGE_PAGES_TUNABLE),  # their threshold stays theirs
        ({"LD_PRELOAD": "libjemalloc.so.2"}, None),  # not glibc's malloc: nothing to tune
    ],
)
def test_the_core_adds_huge_pages_to_what_the_operator_set(
    given: dict[str, str], wanted: str | None
) -> None:
    env = core_environment({"PATH": "/bin", **given})
    assert env.get("GLIBC_TUNABLES") == wanted and env["PATH"] == "/bin"


@pytest.mark.skipif(not GLIBC, reason="the tunables are glibc's")
@pytest.mark.skipif(thp_mode() != "madvise", reason="THP mode is not madvise: nothing to advise")
def test_the_cores_tunables_put_a_large_buffer_on_huge_pages() -> None:
    # a step-sized activation (64 MiB, its own mapping above the threshold) in a child process
    # started as the supervisor starts the core; without the tunable it gets 4 KiB pages
    code = (
        "import os, torch\n"
        "from tests.deploy.tools import huge_pages_mib\n"
        "x = torch.ones(16 << 20)\n"
        "print(huge_pages_mib(os.getpid()))"
    )

    def huge_mib(env: dict[str, str]) -> int:
        completed = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert completed.returncode == 0, completed.stderr
        return int(completed.stdout)

    base = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
    assert huge_mib(core_environment(base)) >= 32
    assert huge_mib({**base, "GLIBC_TUNABLES": MMAP_TUNABLE}) < 32

"""One allocator set-up wherever the server starts: the image, `make serve`, poolserve/memory.py;
the engine core's own (--core-malloc): glibc on huge pages, or tcmalloc."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from poolserve import memory
from poolserve.memory import (
    ALLOCATOR_VARIABLES,
    HUGE_PAGES_TUNABLE,
    MMAP_THRESHOLD_BYTES,
    MMAP_TUNABLE,
    TCMALLOC_PACKAGE,
    TCMALLOC_QUIET,
    core_environment,
    core_malloc_problem,
    fix_mmap_threshold,
    tcmalloc_missing,
)
from tests.deploy.tools import REPO_ROOT, maps_library, require_tcmalloc, thp_mode

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
def test_a_core_on_glibc_adds_huge_pages_to_what_the_operator_set(
    given: dict[str, str], wanted: str | None
) -> None:
    env, _ = core_environment({"PATH": "/bin", **given}, "glibc")
    assert env.get("GLIBC_TUNABLES") == wanted and env["PATH"] == "/bin"
    assert env.get("LD_PRELOAD") == given.get("LD_PRELOAD")


TCMALLOC = "libtcmalloc_minimal.so.4"


@pytest.mark.skipif(not GLIBC, reason="preloading replaces glibc's malloc")
def test_core_malloc_tcmalloc_preloads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "find_tcmalloc", lambda: TCMALLOC)
    given = {"PATH": "/bin", "GLIBC_TUNABLES": MMAP_TUNABLE}  # the image's, for the front ends
    env, said = core_environment(given, "tcmalloc")
    assert env == {**given, "LD_PRELOAD": TCMALLOC, **TCMALLOC_QUIET}
    assert said == f"tcmalloc ({TCMALLOC})"
    # an operator's tcmalloc setting stays theirs
    report = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"
    env, _ = core_environment({report: "1024"}, "tcmalloc")
    assert env[report] == "1024"
    # the default never preloads it, installed or not
    env, said = core_environment(given)
    assert "LD_PRELOAD" not in env and said.startswith("glibc malloc")


@pytest.mark.skipif(not GLIBC, reason="preloading replaces glibc's malloc")
def test_core_malloc_tcmalloc_without_the_library_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory, "find_tcmalloc", lambda: None)
    with pytest.raises(RuntimeError, match="--core-malloc tcmalloc: no tcmalloc library"):
        core_environment({}, "tcmalloc")


@pytest.mark.parametrize("malloc", ["tcmalloc", "glibc"])
def test_the_operators_preloaded_allocator_wins(
    malloc: memory.CoreMalloc, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "find_tcmalloc", lambda: TCMALLOC)
    given = {"LD_PRELOAD": "libjemalloc.so.2"}
    env, said = core_environment(given, malloc)
    assert env == given and "libjemalloc.so.2" in said


def test_tcmalloc_that_cannot_be_preloaded_is_refused_before_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory, "find_tcmalloc", lambda: None)
    assert core_malloc_problem("tcmalloc", 1) == tcmalloc_missing()
    assert f"apt-get install {TCMALLOC_PACKAGE}" in tcmalloc_missing()
    assert core_malloc_problem("glibc", 1) is None  # the default never refuses
    monkeypatch.setattr(memory, "find_tcmalloc", lambda: TCMALLOC)
    assert core_malloc_problem("tcmalloc", 1) is None  # found: nothing to say
    refusal = core_malloc_problem("tcmalloc", 0)  # no core process to preload it into
    assert refusal is not None and "--api-server-count 0" in refusal


@pytest.mark.skipif(not GLIBC, reason="preloading replaces glibc's malloc")
def test_a_child_started_the_cores_way_runs_on_tcmalloc() -> None:
    require_tcmalloc()
    # a torch buffer allocated, freed and allocated again in a child started as the supervisor
    # starts the core: the library is mapped, and the buffer is served by it
    code = (
        "import os, torch\n"
        "from tests.deploy.tools import maps_library\n"
        "x = torch.ones(16 << 20); del x; y = torch.ones(16 << 20)\n"
        "print(maps_library(os.getpid(), 'tcmalloc'), float(y.sum()))"
    )
    base = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
    for malloc, mapped in (("tcmalloc", "True"), ("glibc", "False")):
        completed = subprocess.run(
            [sys.executable, "-c", code],
            env=core_environment(base, malloc)[0],  # type: ignore[arg-type]
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert completed.returncode == 0, completed.stderr
        assert completed.stdout.split() == [mapped, str(float(16 << 20))], malloc
        assert completed.stderr == "", malloc
    assert not maps_library(os.getpid(), "tcmalloc")  # the test process itself is not on it


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
    assert huge_mib(core_environment(base, "glibc")[0]) >= 32
    assert huge_mib({**base, "GLIBC_TUNABLES": MMAP_TUNABLE}) < 32

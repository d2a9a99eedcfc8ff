"""Soak benchmark: one `poolserve serve` process at saturation for minutes; memory, errors, drift.

Run from the repository root: `python -m bench soak [--duration 600] [--model DIR_OR_HUB_ID]`.
Starts a real server on a free loopback port (the embedded all-MiniLM-L6-v2 unless --model),
drives it with `--clients` closed-loop clients sending a mix of tasks and formats (see
`bench.soak.load`) plus `--disconnecting` clients that go away mid-request, and samples the
server's resident memory (/proc/PID/status VmRSS) every `--sample-interval` seconds. The first
`--warmup` seconds of the drive are warm-up. Reports RSS after warm-up against the end, errors
other than 429, p50/p99 latency of the first and last minute after warm-up, and throughput;
prints markdown and writes bench/results/soak_<malloc>.json and .md. Asserts nothing.

`--malloc` picks the server's allocator setup: `default` is what `make serve` and the image start
the server with (a fixed glibc mmap threshold through GLIBC_TUNABLES, the engine core's large
buffers on huge pages); `core-tcmalloc` puts the core on tcmalloc (`--core-malloc tcmalloc`);
`small-pages` keeps the threshold but opts the core out of huge pages; `inproc` sets it from
inside one process (poolserve/memory.py); `glibc` (glibc's defaults), `arena2` (at most two
arenas) and `jemalloc` (Debian's libjemalloc2 preloaded) are the alternatives measured against
it in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from bench.common.loadgen import wait_ready
from bench.common.procs import free_port, spawn
from bench.common.repo import RESULTS_DIR, ROOT
from bench.soak import load as soak_load
from bench.soak import report as soak_report
from bench.soak.report import RssSample
from poolserve.memory import ALLOCATOR_VARIABLES, MMAP_THRESHOLD_BYTES

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
MAX_PROMPT_TOKENS = 4096  # cap on corpus prompt length for models with long limits
JEMALLOC_NAME = "libjemalloc.so.2"
# Variables beyond poolserve/memory.py's through which a parent environment could change malloc.
OTHER_MALLOC_VARIABLES = (
    "MALLOC_ARENA_MAX",
    "MALLOC_CONF",
    "MALLOC_TRIM_THRESHOLD_",
    "POOLSERVE_CORE_MALLOC",
    "TCMALLOC_RELEASE_RATE",
)


def jemalloc_path() -> str:
    """Where the system's jemalloc is (Debian/Ubuntu `libjemalloc2`), or an error saying so."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"  # /sbin is not on every user's PATH
    found = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, check=False)
    for line in found.stdout.splitlines():
        if JEMALLOC_NAME in line and "=>" in line:
            return line.split("=>", 1)[1].strip()
    raise SystemExit(f"{JEMALLOC_NAME} not found: apt-get install libjemalloc2")


# The environment `make serve` and the image give the server (the why: poolserve/memory.py).
PROJECT_MALLOC_ENV = {"GLIBC_TUNABLES": f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD_BYTES}"}
MMAP_TUNABLE = PROJECT_MALLOC_ENV["GLIBC_TUNABLES"]
NO_THP = "glibc.malloc.hugetlb=0"  # the core then keeps 4 KiB pages (poolserve/memory.py)
CORE_ON_TCMALLOC = {"POOLSERVE_CORE_MALLOC": "tcmalloc"}  # --core-malloc tcmalloc
# Starts the server the way `poolserve serve` runs when no allocator variable is set: it fixes
# the threshold itself before loading anything.
IN_PROCESS_PREFIX = (
    "-c",
    "from poolserve.memory import fix_mmap_threshold; fix_mmap_threshold(); "
    "from poolserve.config.flags import main; main()",
)


def malloc_env(variant: str) -> dict[str, str]:
    """The allocator variables of one variant (on top of an environment without any)."""
    return MALLOC_VARIANTS[variant]()


MALLOC_VARIANTS: dict[str, Callable[[], dict[str, str]]] = {
    "default": lambda: dict(PROJECT_MALLOC_ENV),
    "core-tcmalloc": lambda: {**PROJECT_MALLOC_ENV, **CORE_ON_TCMALLOC},
    "small-pages": lambda: {"GLIBC_TUNABLES": f"{MMAP_TUNABLE}:{NO_THP}"},
    "inproc": dict,
    # Set but empty: glibc's own defaults, which poolserve/memory.py leaves alone.
    "glibc": lambda: {"GLIBC_TUNABLES": ""},
    "arena2": lambda: {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
    "jemalloc": lambda: {"LD_PRELOAD": jemalloc_path()},
}


def _tree(pid: int) -> list[int]:
    """The server process and every process under it (the supervisor, the engine core, the
    front ends of `poolserve serve`), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, ()))
    return found


def cpu_seconds(pid: int) -> float:
    """utime + stime of the server's processes (fields 14 and 15 of /proc/PID/stat; a process
    gone counts 0)."""
    total = 0.0
    for member in _tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


# A process's role, from its command line (poolserve/supervisor.py's subcommands).
ROLES = {"supervise": "supervisor", "core": "engine core", "api": "front end"}


def _role(pid: int, server: int) -> str:
    """What a process of the server's tree is, read from /proc/PID/cmdline: a supervisor
    subcommand's role, else "server" (the root: an in-process server) or "other"."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        words = []
    if "poolserve.supervisor" in words[:-1]:
        return ROLES.get(words[words.index("poolserve.supervisor") + 1], "other")
    return "server" if pid == server else "other"


def rss_by_role(pid: int) -> dict[str, float]:
    """VmRSS of the server's processes in MiB, summed per role (empty once they are gone)."""
    totals: dict[str, float] = {}
    for member in _tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                role = _role(member, pid)
                totals[role] = totals.get(role, 0.0) + int(line.split()[1]) / 1024
    return totals


def rss_mib(pid: int) -> float:
    """VmRSS of the server's processes together, in MiB (0 once they are gone)."""
    return sum(rss_by_role(pid).values())


@contextlib.contextmanager
def server(args: argparse.Namespace, port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`poolserve serve` in its own session; SIGTERM (its drain), then SIGKILL if it hangs."""
    unset = (*ALLOCATOR_VARIABLES, *OTHER_MALLOC_VARIABLES)
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(malloc_env(args.malloc))
    env.update({"HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"), "PYTHONPATH": str(ROOT)})
    launcher = IN_PROCESS_PREFIX if args.malloc == "inproc" else ("-m", "poolserve")
    command = [
        sys.executable,
        *launcher,
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *shlex.split(args.server_args),
    ]
    if args.model:
        command += ["--model", args.model]
    logger.info("starting %s with %s", shlex.join(command), malloc_env(args.malloc))
    with spawn(command, log, env) as process:
        yield process


def sample_rss(
    pid: int, origin: float, interval_s: float, stop: threading.Event, samples: list[RssSample]
) -> None:
    """Append the server's RSS and CPU time every interval until stopped (runs in a thread)."""
    while not stop.is_set():
        roles = rss_by_role(pid)
        at = time.perf_counter() - origin
        samples.append(RssSample(at, sum(roles.values()), cpu_seconds(pid), tuple(roles.items())))
        stop.wait(interval_s)


async def model_info(url: str) -> dict[str, object]:
    """The server's /info: tasks and max_model_len."""
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
        info: dict[str, object] = (await client.get("/info")).json()
    return info


async def drive(
    args: argparse.Namespace, url: str, pid: int, rss: list[RssSample]
) -> tuple[list[soak_load.Outcome], dict[str, object]]:
    """All clients for --duration seconds while a thread samples RSS."""
    info = await model_info(url)
    max_len = min(int(str(info["max_model_len"])), MAX_PROMPT_TOKENS)
    prompts = soak_load.build_prompts(max_tokens=max_len - 2)
    kinds = tuple(soak_load.kinds_for([str(t) for t in info["tasks"]]))  # type: ignore[attr-defined]
    logger.info("model %s, tasks %s: %s", info["model"], info["tasks"], [k.name for k in kinds])
    clients = args.clients + args.disconnecting
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    timeout = httpx.Timeout(300.0, connect=30.0)
    outcomes: list[soak_load.Outcome] = []
    stop = threading.Event()
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        origin = time.perf_counter()
        sampler = threading.Thread(
            target=sample_rss, args=(pid, origin, args.sample_interval, stop, rss)
        )
        sampler.start()
        shared = soak_load.Drive(client, kinds, prompts, origin, origin + args.duration, outcomes)
        try:
            await asyncio.gather(
                *(soak_load.run_client(shared, seed, False) for seed in range(args.clients)),
                *(soak_load.run_client(shared, 1000 + i, True) for i in range(args.disconnecting)),
            )
        finally:
            stop.set()
            sampler.join()
    return outcomes, info


def run(args: argparse.Namespace) -> dict[str, object]:
    """Start the server, drive it, summarize."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    log = RESULTS_DIR / f"soak_{args.malloc}.server.log"
    log.write_bytes(b"")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rss: list[RssSample] = []
    started = time.gmtime()
    with server(args, port, log) as process:
        asyncio.run(wait_ready(url, "/ready", READY_TIMEOUT_S, lambda: process.poll() is None))
        loaded_mib = rss_mib(process.pid)
        outcomes, info = asyncio.run(drive(args, url, process.pid, rss))
        exit_code = None if process.poll() is None else process.returncode
    return soak_report.summarize(
        soak_report.RunFacts(
            malloc=args.malloc,
            env=malloc_env(args.malloc),
            model=str(info["model"]),
            date=time.strftime("%Y-%m-%d %H:%M UTC", started),
            duration_s=args.duration,
            warmup_s=args.warmup,
            clients=args.clients,
            disconnecting=args.disconnecting,
            loaded_rss_mib=loaded_mib,
            load=os.getloadavg(),
            server_died=exit_code is not None,
        ),
        rss,
        outcomes,
    )


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run, print and write the report."""
    parser = argparse.ArgumentParser(
        prog="python -m bench soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument(
        "--warmup",
        type=float,
        default=60.0,
        help="first seconds of the load that are warm-up (RSS baseline after)",
    )
    parser.add_argument("--model", default=None, help="directory or Hub id (default: MiniLM)")
    parser.add_argument("--clients", type=int, default=32, help="closed-loop clients")
    parser.add_argument(
        "--disconnecting", type=int, default=4, help="extra clients that go away mid-request"
    )
    parser.add_argument("--sample-interval", type=float, default=2.0, help="RSS sampling, s")
    parser.add_argument(
        "--malloc",
        default="default",
        choices=[*MALLOC_VARIANTS],
        help="server allocator setup (default: the project's)",
    )
    parser.add_argument("--server-args", default="", help="extra `poolserve serve` flags")
    parser.add_argument("--quick", action="store_true", help="--duration 120 --warmup 30")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.warmup = 120.0, 30.0
    if not 0 < args.warmup < args.duration:
        parser.error("--warmup must be between 0 and --duration")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request costs client CPU
    report = run(args)
    out = RESULTS_DIR / f"soak_{args.malloc}.json"
    out.write_text(json.dumps(report, indent=1))
    text = soak_report.markdown(report)
    out.with_suffix(".md").write_text(text)
    print(text)
    logger.info("wrote %s and %s", out, out.with_suffix(".md"))


if __name__ == "__main__":
    main()

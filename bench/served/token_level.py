"""Token-level workload: token_embed on long prompts as float JSON, base64 and streamed NDJSON.

Run from the repository root: `python -m bench token [--quick]`. Starts `poolserve serve` on
loopback once per response format (a fresh process each, so resident memory is comparable),
sends `embed` requests (the forward's own cost) and `token_embed` requests per prompt length
(a few repeats; the least CPU is kept), and reads the server's CPU time (/proc/PID/stat utime +
stime) and resident memory (/proc/PID/status VmRSS, sampled every 5 ms during each request).
Also times the response encoders in-process on outputs of the same shape (and their peak
allocation under tracemalloc). Prints markdown; asserts nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx
import numpy as np
import torch

from bench.common.corpus import token_stream
from bench.common.models import save_decoder
from bench.common.plotting import pyplot
from poolserve.frontend.encoding import encode_item, stream_item

logger = logging.getLogger(__name__)

HIDDEN = 1024  # the Qwen3-0.6B shape's hidden size: token_embed rows are this wide
FORMATS: dict[str, dict[str, object]] = {
    "float JSON": {"encoding_format": "float"},
    "base64": {"encoding_format": "base64"},
    "streamed NDJSON (float)": {"encoding_format": "float", "stream": True},
}


@dataclass(frozen=True)
class Mode:
    """Sizes of one run."""

    num_layers: int
    lengths: tuple[int, ...]
    encode_repeats: int
    request_repeats: int  # per request kind; the least CPU and RSS of the repeats is kept


MODES = {
    "quick": Mode(1, (256, 1024, 4096), 3, 2),
    "full": Mode(1, (256, 1024, 2048, 4096, 8192), 5, 3),
}


@dataclass(frozen=True)
class Sample:
    """One request as the server lived it."""

    wall_s: float
    num_bytes: int
    cpu_s: float
    rss_before_mib: float
    rss_peak_mib: float


class ServerProcess:
    """`poolserve serve` on a free loopback port; killed on exit whatever happens."""

    def __init__(self, model_dir: Path, max_model_len: int, ready_timeout_s: float = 300.0) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "poolserve",
                "serve",
                "--port",
                str(self.port),
                "--model",
                str(self.model_dir),
                "--max-model-len",
                str(self.max_model_len),
                "--log-level",
                "warning",
            ]
        )
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/ready", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError("poolserve did not become ready")

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    @property
    def pid(self) -> int:
        """The server's process id."""
        assert self.proc is not None
        return self.proc.pid


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    """VmRSS of a process in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def sample_request(server: ServerProcess, body: dict[str, object]) -> Sample:
    """POST /v1/pooling, read the whole body, sampling the server's RSS every 5 ms meanwhile."""
    peak = [rss_mib(server.pid)]
    before, cpu_before = peak[0], cpu_seconds(server.pid)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], rss_mib(server.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start, size = time.perf_counter(), 0
    try:
        with httpx.stream("POST", server.url + "/v1/pooling", json=body, timeout=600.0) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:500]!r}")
            for chunk in resp.iter_raw():
                size += len(chunk)
    finally:
        done.set()
        sampler.join()
    wall = time.perf_counter() - start
    return Sample(wall, size, cpu_seconds(server.pid) - cpu_before, before, peak[0])


@dataclass(frozen=True)
class Row:
    """One format at one prompt length, served."""

    fmt: str
    length: int
    embed_cpu_s: float  # server CPU of an `embed` request on the same prompt
    embed_rss_peak_mib: float  # server RSS peak during that embed request
    wall_s: float
    num_bytes: int
    cpu_s: float
    rss_before_mib: float
    rss_peak_mib: float

    @property
    def extra_cpu_us_per_token(self) -> float:
        """Server CPU per token beyond the embed request: the token-level output's cost."""
        return (self.cpu_s - self.embed_cpu_s) / self.length * 1e6


def _least(samples: list[Sample]) -> Sample:
    """The repeat with the least server CPU (the others lost time to neighbours)."""
    return min(samples, key=lambda x: x.cpu_s)


def serve_rows(model_dir: Path, fmt: str, mode: Mode, ids: list[int]) -> list[Row]:
    """One fresh server; per length, embed and token_embed requests (a list of one prompt)."""
    rows = []
    with ServerProcess(model_dir, 2 * max(mode.lengths)) as server:
        sample_request(server, {"input": [ids[:16]], "task": "token_embed", **FORMATS[fmt]})
        for length in mode.lengths:
            prompt = [ids[:length]]
            embeds, toks = [], []
            for _ in range(mode.request_repeats):
                embeds.append(sample_request(server, {"input": prompt, "task": "embed"}))
                toks.append(
                    sample_request(server, {"input": prompt, "task": "token_embed", **FORMATS[fmt]})
                )
            embed, tok = _least(embeds), _least(toks)
            rows.append(
                Row(
                    fmt,
                    length,
                    embed.cpu_s,
                    max(e.rss_peak_mib for e in embeds),
                    tok.wall_s,
                    tok.num_bytes,
                    tok.cpu_s,
                    tok.rss_before_mib,
                    max(t.rss_peak_mib for t in toks),
                )
            )
    return rows


def _time(fn: Callable[[np.ndarray], int], data: np.ndarray, repeats: int) -> tuple[float, int]:
    """Median seconds of fn(data) and the bytes it produced."""
    times, size = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        size = fn(data)
        times.append(time.perf_counter() - start)
    return statistics.median(times), size


def _held(fn: Callable[[np.ndarray], int], data: np.ndarray) -> float:
    """Peak MB that fn allocates while encoding (tracemalloc sees numpy and bytes buffers)."""
    tracemalloc.start()
    try:
        fn(data)
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def _stream(data: np.ndarray) -> int:
    """The streamed pieces consumed one at a time, as the route sends them."""
    return sum(len(p) for p in stream_item({"index": 0}, data))


ENCODERS: dict[str, Callable[[np.ndarray], int]] = {
    "float JSON": lambda d: len(encode_item({"index": 0}, "data", d, "float")),
    "base64": lambda d: len(encode_item({"index": 0}, "data", d, "base64")),
    "streamed NDJSON (float)": _stream,
}


def encode_table(lengths: tuple[int, ...], repeats: int) -> str:
    """In-process encoder cost per token for each format; ratio against base64."""
    gen = np.random.default_rng(0)
    lines = [
        "| prompt tokens | format | encode ms | us per token | bytes | x base64 time "
        "| peak MB allocated |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for length in lengths:
        data = gen.standard_normal((length, HIDDEN), dtype=np.float32)  # [L, hidden]
        timed = {name: _time(fn, data, repeats) for name, fn in ENCODERS.items()}
        base = timed["base64"][0]
        lines += [
            f"| {length} | {name} | {s * 1e3:.1f} | {s / length * 1e6:.1f} | {n} | "
            f"{s / base:.1f}x | {_held(ENCODERS[name], data):.1f} |"
            for name, (s, n) in timed.items()
        ]
    return "\n".join(lines)


def served_table(rows: list[Row]) -> str:
    """Markdown of the served requests."""
    lines = [
        "| prompt tokens | format | wall s | MB | payload MB/s | server CPU s | "
        "embed CPU s | extra CPU us/token | RSS peak, embed MiB | RSS peak MiB | "
        "over embed MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r.length, r.fmt)):
        lines.append(
            f"| {r.length} | {r.fmt} | {r.wall_s:.2f} | {r.num_bytes / 1e6:.1f} | "
            f"{r.num_bytes / 1e6 / r.wall_s:.1f} | {r.cpu_s:.2f} | {r.embed_cpu_s:.2f} | "
            f"{r.extra_cpu_us_per_token:.1f} | {r.embed_rss_peak_mib:.0f} | "
            f"{r.rss_peak_mib:.0f} | {r.rss_peak_mib - r.embed_rss_peak_mib:.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    """Server RSS growth during the request vs prompt length, one line per format."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for fmt in FORMATS:
        mine = sorted((r for r in rows if r.fmt == fmt), key=lambda r: r.length)
        ax.plot(
            [r.length for r in mine],
            [r.rss_peak_mib - r.embed_rss_peak_mib for r in mine],
            marker="o",
            label=fmt,
        )
    ax.set_xlabel("prompt tokens (token_embed, hidden 1024)")
    ax.set_ylabel("server RSS peak over an embed request's, MiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(mode: Mode, emit: Callable[[str], None], plot_path: Path | None) -> None:
    """Encoders in-process, then one server per format."""
    emit(f"encoders in-process, output [L, {HIDDEN}] float32, median of {mode.encode_repeats}:\n")
    emit(encode_table(mode.lengths, mode.encode_repeats) + "\n")
    ids = token_stream(max(mode.lengths))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_decoder(Path(tmp), mode.num_layers)
        for fmt in FORMATS:
            logger.info("serving %s", fmt)
            rows += serve_rows(model_dir, fmt, mode, ids)
    emit(served_table(rows) + "\n")
    if plot_path is not None:
        plot(rows, plot_path)


def main(argv: list[str] | None = None) -> None:
    """Parse flags and run."""
    parser = argparse.ArgumentParser(prog="python -m bench token", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="lengths 256, 1024, 4096")
    parser.add_argument("--plot", default="docs/bench_token_rss.png", help="PNG path ('' = none)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    mode = MODES["quick" if args.quick else "full"]
    logger.info("mode %s, torch threads %d, pid %d", mode, torch.get_num_threads(), os.getpid())
    run(mode, print, Path(args.plot) if args.plot else None)


if __name__ == "__main__":
    main()

"""Served images: poolserve against Infinity on one CLIP checkpoint, same images, same load.

Run from the repository root: `python -m bench images-served [--quick]`. Both servers run on
loopback at once, float32 on CPU, on one CLIP ViT-B/32-geometry checkpoint with random weights
(`bench/served/images_inputs.py`), and take turns: every round gives each row one point of the
same requests (the order reversed every other round), so the machine's drift lands on all rows
alike and each round gives same-moment ratios. Rows:
- images: requests of 8 JPEG data URLs through Infinity's `/embeddings` (`modality: "image"`)
  on both servers, and through vLLM's `/v1/embeddings` (`messages`, one image a conversation)
  on poolserve;
- mixed: the same image requests alternating with requests of 8 short captions (half the
  requests each), on the same routes.
Before the load, every image and caption is embedded once by each route and compared (cosine)
with each other and with transformers in this process (`get_image_features` on
`CLIPImageProcessorPil`'s pixels, `get_text_features`). Infinity needs its own environment with
the image packages (`bash bench/peers/infinity_env.sh`); without it only poolserve runs.
Prints markdown (`images_report.py`); writes bench/results/images_served_<mode>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import transformers

from bench.common.loadgen import LoadPoint, RequestBody, run_point, wait_ready
from bench.common.procs import free_port, spawn
from bench.common.repo import RESULTS_DIR, source_revision
from bench.served import images_inputs, images_report
from bench.served.embeddings import INFINITY_BIN, ModelCase, ServerCase
from poolserve.models.cpu_class import cpu_class

logger = logging.getLogger(__name__)

PER_REQUEST = 8
READY_TIMEOUT_S = 600.0
SERVERS = {
    "poolserve": ServerCase("poolserve", "/embeddings", "/ready"),
    "infinity": ServerCase("infinity", "/embeddings", "/health"),
}


@dataclass(frozen=True)
class Mode:
    """Sizes of one run."""

    name: str
    num_images: int  # distinct images (and as many captions)
    rounds: int
    requests: int  # per point: each row sends this many requests each round
    concurrency: int
    time_limit_s: float  # per point


MODES = {"quick": Mode("quick", 32, 2, 8, 4, 120.0), "full": Mode("full", 64, 3, 16, 4, 300.0)}


@dataclass(frozen=True)
class Row:
    """One measured line: a load on one server through one route."""

    load: str  # images | mixed (a RouteBodies attribute)
    label: str
    server: str
    route: str  # infinity (/embeddings) | vllm (/v1/embeddings)

    @property
    def path(self) -> str:
        """The route's path."""
        return {"infinity": "/embeddings", "vllm": "/v1/embeddings"}[self.route]


ROWS = (
    Row("images", "poolserve, Infinity's /embeddings", "poolserve", "infinity"),
    Row("images", "poolserve, vLLM's /v1/embeddings (messages)", "poolserve", "vllm"),
    Row("images", "Infinity, /embeddings", "infinity", "infinity"),
    Row("mixed", "poolserve, Infinity's /embeddings", "poolserve", "infinity"),
    Row("mixed", "poolserve, vLLM's /v1/embeddings (input, messages)", "poolserve", "vllm"),
    Row("mixed", "Infinity, /embeddings", "infinity", "infinity"),
)
# (left, right) sides whose embeddings of the same items are compared
PAIRS = (
    ("poolserve, Infinity's route", "Infinity"),
    ("poolserve, vLLM's route", "poolserve, Infinity's route"),
    ("poolserve, Infinity's route", "transformers"),
    ("Infinity", "transformers"),
)
SIDES = {
    ("poolserve", "infinity"): "poolserve, Infinity's route",
    ("poolserve", "vllm"): "poolserve, vLLM's route",
    ("infinity", "infinity"): "Infinity",
}
Embeddings = dict[str, np.ndarray]  # modality (images, texts) -> unit rows [items, dim]


def reference(directory: Path, jpegs: list[bytes], texts: list[str]) -> Embeddings:
    """transformers' embeddings in this process, on the PIL processor's pixels."""
    model = transformers.CLIPModel.from_pretrained(directory).eval()
    processor = transformers.CLIPImageProcessorPil.from_pretrained(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    pictures = [images_inputs.decoded(j) for j in jpegs]
    with torch.inference_mode():
        pixels = processor(images=pictures, return_tensors="pt")["pixel_values"]
        image_rows = model.get_image_features(pixel_values=pixels).pooler_output
        ids = tokenizer(texts, padding=True, return_tensors="pt")
        text_rows = model.get_text_features(**ids).pooler_output
    return {"images": _unit(image_rows.numpy()), "texts": _unit(text_rows.numpy())}


def _unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=-1, keepdims=True)


def embed(url: str, path: str, bodies: tuple[RequestBody, ...]) -> np.ndarray:
    """Every body's embeddings in order, unit length: [items, dim]."""
    rows = []
    with httpx.Client(base_url=url, timeout=300.0) as client:
        for body in bodies:
            answer = client.post(
                path, content=body.payload, headers={"content-type": "application/json"}
            )
            if answer.status_code != 200:
                raise RuntimeError(f"{url}{path}: {answer.status_code} {answer.text[:500]}")
            rows += [item["embedding"] for item in answer.json()["data"]]
    return _unit(np.asarray(rows, dtype=np.float64))


def agreement(
    urls: dict[str, str], routes: dict[str, images_inputs.RouteBodies], want: Embeddings
) -> list[dict[str, Any]]:
    """For each pair of sides: the least cosine and the largest |difference| of unit vectors."""
    got: dict[str, Embeddings] = {"transformers": want}
    for row in ROWS:
        side = SIDES[(row.server, row.route)]
        if row.server in urls and side not in got:
            bodies = routes[row.route]
            got[side] = {
                "images": embed(urls[row.server], row.path, bodies.images),
                "texts": embed(urls[row.server], row.path, bodies.texts),
            }
    table = []
    for left, right in (p for p in PAIRS if p[0] in got and p[1] in got):
        line: dict[str, Any] = {"compared": f"{left} vs {right}"}
        for modality in ("images", "texts"):
            a, b = got[left][modality], got[right][modality]
            line[f"{modality}_min_cosine"] = float(np.min(np.sum(a * b, axis=-1)))
            line[f"{modality}_max_abs_diff"] = float(np.abs(a - b).max())
        table.append(line)
    return table


async def take_turns(
    urls: dict[str, str], routes: dict[str, images_inputs.RouteBodies], mode: Mode
) -> dict[str, list[dict[str, Any]]]:
    """Every round, each row one point in turn (reversed every other round); row key -> points."""
    rows = [r for r in ROWS if r.server in urls]
    point = LoadPoint(mode.concurrency, mode.requests, mode.time_limit_s)
    for row in rows:  # warm-up: each route, each kind of request
        await run_point(
            urls[row.server],
            row.path,
            getattr(routes[row.route], row.load),
            LoadPoint(2, 4, mode.time_limit_s),
        )
    results: dict[str, list[dict[str, Any]]] = {_key(r): [] for r in rows}
    for round_index in range(mode.rounds):
        for row in rows if round_index % 2 == 0 else rows[::-1]:
            bodies = getattr(routes[row.route], row.load)
            result = await run_point(urls[row.server], row.path, bodies, point)
            logger.info(
                "round %d, %s, %s: %.2f req/s, p50 %.0f ms, %d errors",
                round_index,
                row.load,
                row.label,
                result.requests_per_s,
                result.p50_ms,
                result.errors,
            )
            results[_key(row)].append(asdict(result))
    return results


def _key(row: Row) -> str:
    return f"{row.load}: {row.label}"


async def start(
    directory: Path, log_dir: Path, stack: contextlib.ExitStack
) -> tuple[dict[str, str], dict[str, str]]:
    """Both servers up (Infinity where installed): name -> URL, and name -> why it is missing."""
    model = ModelCase("CLIP ViT-B/32 geometry", directory, 77, ())
    missing: dict[str, str] = {}
    started = {}
    for name, server in SERVERS.items():
        if name == "infinity" and not INFINITY_BIN.exists():
            missing[name] = "not installed (run bash bench/peers/infinity_env.sh)"
            continue
        port = free_port()
        command = server.command(model, port)
        process = stack.enter_context(spawn(command, log_dir / f"{name}.log"))
        started[name] = (f"http://127.0.0.1:{port}", process)
    urls = {}
    for name, (url, process) in started.items():
        try:
            await wait_ready(
                url,
                SERVERS[name].ready_path,
                READY_TIMEOUT_S,
                lambda p=process: p.poll() is None,  # type: ignore[misc]
            )
        except (RuntimeError, TimeoutError) as exc:
            tail = (log_dir / f"{name}.log").read_text(errors="replace")[-3000:]
            logger.error("%s failed to start: %s\n%s", name, exc, tail)
            missing[name] = f"failed to start: {exc}"
            continue
        urls[name] = url
    return urls, missing


async def run(mode: Mode) -> dict[str, Any]:
    """The checkpoint, the reference, both servers, agreement, then the turns."""
    jpegs = images_inputs.jpeg_images(mode.num_images)
    texts = images_inputs.captions(mode.num_images)
    routes = images_inputs.build_bodies(
        [images_inputs.data_url(j) for j in jpegs], texts, PER_REQUEST
    )
    report: dict[str, Any] = {
        "mode": asdict(mode),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "revision": source_revision(),
        "cpu_class": str(cpu_class()),
        "load_before": os.getloadavg(),
        "image_bytes_mean": statistics.mean(len(j) for j in jpegs),
        "per_request": PER_REQUEST,
        "rows": [{**asdict(r), "key": _key(r)} for r in ROWS],
    }
    with tempfile.TemporaryDirectory(prefix="bench-images-") as tmp:
        directory = images_inputs.save_clip(Path(tmp) / "clip")
        want = reference(directory, jpegs, texts)
        log_dir = Path(tmp) / "logs"
        log_dir.mkdir()
        try:
            with contextlib.ExitStack() as stack:
                urls, report["missing"] = await start(directory, log_dir, stack)
                report["agreement"] = await asyncio.to_thread(agreement, urls, routes, want)
                report["points"] = await take_turns(urls, routes, mode)
        finally:
            # the servers' logs outlive the temporary folder, for post-mortems
            shutil.copytree(log_dir, RESULTS_DIR / f"logs_images_{mode.name}", dirs_exist_ok=True)
    report["load_after"] = os.getloadavg()
    return report


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run, print the tables, write the results."""
    parser = argparse.ArgumentParser(prog="python -m bench images-served", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer images and rounds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    mode = MODES["quick" if args.quick else "full"]
    logger.info("mode %s, python %s", mode, sys.version.split()[0])
    report = asyncio.run(run(mode))
    print(images_report.markdown(report))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"images_served_{mode.name}.json"
    out.write_text(json.dumps(report, indent=1))
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()

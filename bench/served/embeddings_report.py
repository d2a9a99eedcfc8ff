"""Tables and plots of the served benchmark's results (the JSON `python -m bench served` writes)."""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from pathlib import Path
from typing import Any

from bench.common.plotting import pyplot
from bench.common.repo import DOCS_DIR

logger = logging.getLogger(__name__)

SERVER_ORDER = ("poolserve", "infinity", "fastapi+st")
PEERS = ("infinity", "fastapi+st")


def _models(report: dict[str, Any]) -> list[str]:
    return [k for k, v in report.items() if isinstance(v, dict) and "servers" in v]


def _points(run: Any) -> dict[tuple[int, int], dict[str, Any]]:
    """(inputs per request, concurrency) -> point, empty for a server that did not run."""
    if not isinstance(run, dict):
        return {}
    return {(p["inputs_per_request"], p["concurrency"]): p for p in run["points"]}


def _tps(point: dict[str, Any] | None) -> float:
    return point["tokens"] / point["wall_s"] if point else math.nan


def _rps(point: dict[str, Any]) -> float:
    return (point["sent"] - point["errors"]) / point["wall_s"]


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "n/a"


def _cell(point: dict[str, Any] | None) -> tuple[str, str, str]:
    """(tokens/s (req/s), p50 / p99 ms, errors/sent) of one server at one point."""
    if point is None:
        return ("-", "-", "-")
    return (
        f"{_tps(point):.0f} ({_rps(point):.1f})",
        f"{point['p50_ms']:.0f} / {point['p99_ms']:.0f}",
        f"{point['errors']}/{point['sent']}",
    )


def load_table(entry: dict[str, Any]) -> str:
    """Every server side by side per (inputs, concurrency), with poolserve's ratios."""
    runs = {name: _points(entry["servers"].get(name)) for name in SERVER_ORDER}
    servers = [s for s in SERVER_ORDER if runs[s]]
    keys = sorted({k for points in runs.values() for k in points})
    head = ["inputs/req", "conc."] + [f"{s} tok/s (req/s)" for s in servers]
    head += [f"poolserve / {p}" for p in PEERS if p in servers]
    head += [f"{s} p50 / p99 ms" for s in servers] + [f"{s} errors" for s in servers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for key in keys:
        cells = {s: _cell(runs[s].get(key)) for s in servers}
        row = [str(key[0]), str(key[1])] + [cells[s][0] for s in servers]
        row += [
            _ratio(_tps(runs["poolserve"].get(key)), _tps(runs[p].get(key)))
            for p in PEERS
            if p in servers
        ]
        row += [cells[s][1] for s in servers] + [cells[s][2] for s in servers]
        lines.append("| " + " | ".join(row) + " |")
    skipped = [f"{s}: {entry['servers'][s]}" for s in entry["servers"] if s not in servers]
    return "\n".join(lines + (["", f"Not run: {'; '.join(skipped)}"] if skipped else []))


def summary_table(entry: dict[str, Any]) -> str:
    """Served vs offline engine, and short-request p50 vs the bare forward."""
    offline = entry["offline"]
    poolserve = _points(entry["servers"].get("poolserve"))
    lines = [
        "| measure | value |",
        "|---|---:|",
        f"| offline engine, same single-input prompts ({offline['prompts']} prompts, "
        f"{offline['tokens']} tokens) | {offline['tokens_per_s']:.0f} tok/s |",
    ]
    for (inputs, conc), point in sorted(poolserve.items()):
        if conc >= 16:
            lines.append(
                f"| poolserve served / offline, {inputs} input(s), concurrency {conc} | "
                f"{_tps(point) / offline['tokens_per_s']:.0%} |"
            )
    least = offline.get("forward_min_ms")  # absent from results of older runs
    lines.append(
        f"| bare forward, short prompt ({offline['short_tokens']} tokens), p50 (min) | "
        f"{offline['forward_p50_ms']:.1f} ms "
        f"({'n/a' if least is None else f'{least:.1f}'}) |"
    )
    for name in SERVER_ORDER:
        run = entry["servers"].get(name)
        if isinstance(run, dict):
            p50 = run["short"]["p50_ms"]
            lines.append(
                f"| {name}: short single request p50 (p99), concurrency 1 | "
                f"{p50:.1f} ms ({run['short']['p99_ms']:.1f}); "
                f"{p50 - offline['forward_p50_ms']:+.1f} ms vs the forward p50 |"
            )
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    """All tables of a report."""
    parts = [f"mode {report['mode']}, {report['date']}"]
    for model in _models(report):
        entry = report[model]
        load = ", ".join(f"{x:.2f}" for x in entry["load"])
        parts += [
            f"### {model}",
            f"load average after the run: {load}",
            load_table(entry),
            summary_table(entry),
        ]
    return "\n\n".join(parts) + "\n"


def _slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")[:40]


def plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Per model: throughput vs concurrency, and p50/p99 latency vs concurrency (PNG)."""
    plt = pyplot()
    if plt is None:
        return []
    written = []
    for model in _models(report):
        runs = {s: _points(report[model]["servers"].get(s)) for s in SERVER_ORDER}
        for kind in ("throughput", "latency"):
            fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
            for ax, inputs in zip(axes, (1, 32), strict=True):
                for server, points in runs.items():
                    keys = sorted(k for k in points if k[0] == inputs)
                    xs = [k[1] for k in keys]
                    if not xs:
                        continue
                    if kind == "throughput":
                        ax.plot(xs, [_tps(points[k]) for k in keys], "o-", label=server)
                    else:
                        line = ax.plot(
                            xs, [points[k]["p50_ms"] for k in keys], "o-", label=f"{server} p50"
                        )[0]
                        ax.plot(
                            xs,
                            [points[k]["p99_ms"] for k in keys],
                            "s--",
                            color=line.get_color(),
                            label=f"{server} p99",
                        )
                ax.set_xscale("log", base=2)
                ax.set_xlabel("concurrency (requests in flight)")
                ax.set_ylabel("prompt tokens/s" if kind == "throughput" else "latency ms")
                if kind == "latency":
                    ax.set_yscale("log")
                ax.set_title(f"{model}: {inputs} input(s) per request", fontsize=9)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
            fig.tight_layout()
            path = out_dir / f"bench_served_{_slug(model)}_{kind}.png"
            fig.savefig(path, dpi=90)
            plt.close(fig)
            written.append(path)
    return written


def main() -> None:
    """Re-render tables and plots from a results JSON.

    `python -m bench.served.embeddings_report bench/results/served_quick.json`
    """
    report = json.loads(Path(sys.argv[1]).read_text())
    print(markdown(report))
    plots(report, DOCS_DIR)


if __name__ == "__main__":
    main()

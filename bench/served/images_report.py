"""The served images benchmark's tables, from its JSON report (bench/served/images.py)."""

from __future__ import annotations

import statistics
from typing import Any

PEER = "infinity"  # the ratios' denominator: Infinity, same load, same round


def _rate(point: dict[str, Any]) -> float:
    """Successful requests per second of one point."""
    return (point["sent"] - point["errors"]) / point["wall_s"]


def ratio(report: dict[str, Any], row: dict[str, Any]) -> str:
    """Median over the rounds of the row's requests/s over Infinity's in the same round."""
    peer = next(
        (r for r in report["rows"] if r["load"] == row["load"] and r["server"] == PEER), None
    )
    mine = report["points"].get(row["key"])
    theirs = report["points"].get(peer["key"]) if peer else None
    if not mine or not theirs:
        return ""
    rates = [_rate(m) / _rate(t) for m, t in zip(mine, theirs, strict=True) if _rate(t) > 0]
    return f"{statistics.median(rates):.2f}x" if rates else ""


def _header(report: dict[str, Any]) -> str:
    mode = report["mode"]
    return (
        f"{report['date']}, {report['revision']}, {report['cpu_class']}; load average "
        f"{report['load_before'][0]:.1f} before, {report['load_after'][0]:.1f} after; "
        f"{mode['rounds']} rounds x {mode['requests']} requests of {report['per_request']} "
        f"items per row, concurrency {mode['concurrency']}; {mode['num_images']} distinct "
        f"images (JPEG, {report['image_bytes_mean'] / 1024:.0f} KiB on average)"
    )


def load_table(report: dict[str, Any]) -> list[str]:
    """Each row's totals over the rounds and its same-round ratio to Infinity."""
    lines = [
        "| load | server, route | requests/s | items/s | p50 ms | p99 ms | vs Infinity "
        "(median of rounds) | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        points = report["points"].get(row["key"])
        if not points:
            why = report["missing"].get(row["server"], "not run")
            lines.append(f"| {row['load']} | {row['label']} | {why} | | | | | |")
            continue
        good = sum(p["sent"] - p["errors"] for p in points)
        wall = sum(p["wall_s"] for p in points)
        items = good * report["per_request"]
        lines.append(
            f"| {row['load']} | {row['label']} | {good / wall:.2f} | {items / wall:.1f} "
            f"| {statistics.median(p['p50_ms'] for p in points):.0f} "
            f"| {max(p['p99_ms'] for p in points):.0f} | {ratio(report, row)} "
            f"| {sum(p['errors'] for p in points)} |"
        )
    return lines


def agreement_table(report: dict[str, Any]) -> list[str]:
    """The least cosine and the largest |difference| of unit vectors, per pair of sides."""
    lines = [
        "| compared | images: min cosine | images: max abs diff | texts: min cosine "
        "| texts: max abs diff |",
        "|---|---:|---:|---:|---:|",
    ]
    for line in report["agreement"]:
        lines.append(
            f"| {line['compared']} | {line['images_min_cosine']:.6f} "
            f"| {line['images_max_abs_diff']:.1e} | {line['texts_min_cosine']:.6f} "
            f"| {line['texts_max_abs_diff']:.1e} |"
        )
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The run's header, the load table and the agreement table."""
    return "\n".join([_header(report), "", *load_table(report), "", *agreement_table(report)])

"""The soak benchmark's summary: RSS growth after warm-up, errors, latency drift, targets."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from bench.common.loadgen import percentile_ms
from bench.soak.load import Outcome, Status

RSS_GROWTH_TARGET_PCT = 10.0
P99_DRIFT_TARGET_PCT = 20.0
WINDOW_S = 60.0  # "first and last minute" after warm-up; shorter when the run is short
RSS_SMOOTHING_S = 10.0  # RSS at a time = median of the samples this close to it


TIMELINE_STEP_S = 30.0


@dataclass(frozen=True)
class RssSample:
    """The server's resident memory and CPU time used so far, at one time of the drive."""

    t_s: float
    rss_mib: float
    cpu_s: float
    # the same RSS per process role (engine core, front end, supervisor), which says who grows
    by_role: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class RunFacts:
    """How the run was set up."""

    malloc: str
    env: dict[str, str]
    model: str
    date: str
    duration_s: float
    warmup_s: float
    clients: int
    disconnecting: int
    loaded_rss_mib: float
    load: tuple[float, float, float]
    server_died: bool


def _rss_near(samples: Sequence[RssSample], t_s: float) -> float:
    """Median RSS of the samples within RSS_SMOOTHING_S / 2 of a time."""
    near = [s.rss_mib for s in samples if abs(s.t_s - t_s) <= RSS_SMOOTHING_S / 2]
    return statistics.median(near) if near else float("nan")


def _by_role(samples: Sequence[RssSample], warmup_s: float, end_s: float) -> dict[str, dict]:
    """Each process role's RSS after warm-up and at the end (medians as `_rss_near`), growth."""
    roles = sorted({role for s in samples for role, _ in s.by_role})
    table: dict[str, dict] = {}
    for role in roles:
        mine = [RssSample(s.t_s, dict(s.by_role).get(role, 0.0), s.cpu_s) for s in samples]
        warm, last = _rss_near(mine, warmup_s), _rss_near(mine, end_s - RSS_SMOOTHING_S / 2)
        growth = 100.0 * (last - warm) / warm if warm else float("nan")
        table[role] = {"after_warmup_mib": warm, "end_mib": last, "growth_pct": growth}
    return table


def _slope_mib_per_min(samples: Sequence[RssSample]) -> float:
    """Least-squares slope of RSS over time."""
    if len(samples) < 2:
        return float("nan")
    ts, ys = [s.t_s for s in samples], [s.rss_mib for s in samples]
    return float(statistics.linear_regression(ts, ys).slope) * 60.0


def _window(
    outcomes: Sequence[Outcome], rss: Sequence[RssSample], start: float, end: float
) -> dict[str, float]:
    """Latency and throughput of the successful requests that ended in [start, end)."""
    done = [o for o in outcomes if o.status is Status.OK and start <= o.end_s < end]
    latencies = [o.latency_s for o in done]
    span = max(end - start, 1e-9)
    return {
        "start_s": start,
        "end_s": end,
        "requests": len(done),
        "requests_per_s": len(done) / span,
        "tokens_per_s": sum(o.num_tokens for o in done) / span,
        "p50_ms": percentile_ms(latencies, 0.5),
        "p99_ms": percentile_ms(latencies, 0.99),
        "server_cores": _cores_busy(rss, start, end),
    }


def _per_kind(outcomes: Sequence[Outcome], start: float) -> dict[str, dict[str, float]]:
    """p50/p99 and counts per request kind after warm-up."""
    table: dict[str, dict[str, float]] = {}
    for kind in sorted({o.kind for o in outcomes}):
        mine = [o for o in outcomes if o.kind == kind and o.end_s >= start]
        ok = [o.latency_s for o in mine if o.status is Status.OK]
        table[kind] = {
            "ok": len(ok),
            "sent": len(mine),
            "p50_ms": percentile_ms(ok, 0.5),
            "p99_ms": percentile_ms(ok, 0.99),
        }
    return table


def _cores_busy(samples: Sequence[RssSample], start: float, end: float) -> float:
    """The server's CPU seconds per wall second between two times (nan without samples)."""
    inside = [s for s in samples if start <= s.t_s <= end]
    if len(inside) < 2 or inside[-1].t_s <= inside[0].t_s:
        return float("nan")
    return (inside[-1].cpu_s - inside[0].cpu_s) / (inside[-1].t_s - inside[0].t_s)


def _timeline(
    facts: RunFacts, rss: Sequence[RssSample], outcomes: Sequence[Outcome]
) -> list[dict[str, float]]:
    """Per TIMELINE_STEP_S after warm-up: throughput, latency, RSS and server CPU.

    A latency rise with the server's CPU share falling points at other work on the machine; with
    the share steady, at the server itself.
    """
    rows = []
    start = facts.warmup_s
    while start < facts.duration_s - 1e-9:
        end = min(start + TIMELINE_STEP_S, facts.duration_s)
        rows.append(
            {**_window(outcomes, rss, start, end), "rss_mib": _rss_near(rss, (start + end) / 2)}
        )
        start = end
    return rows


def summarize(
    facts: RunFacts, rss: Sequence[RssSample], outcomes: Sequence[Outcome]
) -> dict[str, object]:
    """Every figure of the report, JSON-ready."""
    end = facts.duration_s
    window = min(WINDOW_S, (end - facts.warmup_s) / 2)
    after = [s for s in rss if s.t_s >= facts.warmup_s]
    warm, last = _rss_near(rss, facts.warmup_s), _rss_near(rss, end - RSS_SMOOTHING_S / 2)
    errors = [o for o in outcomes if o.status is Status.ERROR]
    first = _window(outcomes, rss, facts.warmup_s, facts.warmup_s + window)
    final = _window(outcomes, rss, end - window, end)
    growth = 100.0 * (last - warm) / warm
    drift = 100.0 * (final["p99_ms"] - first["p99_ms"]) / first["p99_ms"]
    return {
        "facts": asdict(facts),
        "rss": {
            "after_load_mib": facts.loaded_rss_mib,
            "after_warmup_mib": warm,
            "end_mib": last,
            "peak_mib": max((s.rss_mib for s in rss), default=float("nan")),
            "growth_pct": growth,
            "slope_mib_per_min": _slope_mib_per_min(after),
            "by_role": _by_role(rss, facts.warmup_s, end),
            "samples": [
                [round(s.t_s, 1), round(s.rss_mib, 1), round(s.cpu_s, 2), dict(s.by_role)]
                for s in rss
            ],
        },
        "requests": dict(Counter(o.status.value for o in outcomes)),
        "errors": len(errors),
        "error_examples": dict(Counter(o.detail[:160] for o in errors).most_common(5)),
        "first_window": first,
        "last_window": final,
        "whole": _window(outcomes, rss, facts.warmup_s, end),
        "p99_drift_pct": drift,
        "per_kind": _per_kind(outcomes, facts.warmup_s),
        "timeline": _timeline(facts, rss, outcomes),
        "targets": {
            f"RSS growth after warm-up < {RSS_GROWTH_TARGET_PCT:.0f}%": growth
            < RSS_GROWTH_TARGET_PCT,
            "zero errors other than 429": not errors and not facts.server_died,
            f"last-minute p99 within {P99_DRIFT_TARGET_PCT:.0f}% of the first": drift
            <= P99_DRIFT_TARGET_PCT,
        },
    }


def markdown(report: dict[str, object]) -> str:
    """The report as a few markdown lines and tables."""
    facts, rss = report["facts"], report["rss"]
    first, last, whole = report["first_window"], report["last_window"], report["whole"]
    assert isinstance(facts, dict) and isinstance(rss, dict)
    assert isinstance(first, dict) and isinstance(last, dict) and isinstance(whole, dict)
    lines = [
        f"soak {facts['date']}: model {facts['model']}, malloc {facts['malloc']} "
        f"{facts['env'] or ''}, {facts['duration_s']:.0f} s ({facts['warmup_s']:.0f} s warm-up), "
        f"{facts['clients']} clients + {facts['disconnecting']} disconnecting, load at end "
        f"{facts['load'][0]:.1f}",
        "",
        "| RSS after load | after warm-up | end | peak | growth | slope after warm-up |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {rss['after_load_mib']:.0f} MiB | {rss['after_warmup_mib']:.0f} MiB "
        f"| {rss['end_mib']:.0f} MiB | {rss['peak_mib']:.0f} MiB | {rss['growth_pct']:+.1f}% "
        f"| {rss['slope_mib_per_min']:+.1f} MiB/min |",
        "",
    ]
    by_role = rss.get("by_role") or {}
    if by_role:
        lines += ["| process | RSS after warm-up | end | growth |", "|---|---:|---:|---:|"]
        lines += [
            f"| {role} | {r['after_warmup_mib']:.0f} MiB | {r['end_mib']:.0f} MiB "
            f"| {r['growth_pct']:+.1f}% |"
            for role, r in by_role.items()
        ]
        lines.append("")
    lines += [
        "| window | requests | req/s | tokens/s | p50 ms | p99 ms | server cores busy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    timeline = report["timeline"]
    assert isinstance(timeline, list)
    rows = [("first after warm-up", first), ("last", last), ("all after warm-up", whole)]
    rows += [("timeline", w) for w in timeline]
    for name, w in rows:
        lines.append(
            f"| {name} ({w['start_s']:.0f}-{w['end_s']:.0f} s) | {w['requests']} "
            f"| {w['requests_per_s']:.2f} | {w['tokens_per_s']:.0f} "
            f"| {w['p50_ms']:.0f} | {w['p99_ms']:.0f} | {w['server_cores']:.2f} |"
        )
    lines += [
        "",
        f"requests by outcome: {report['requests']}; errors other than 429: "
        f"{report['errors']} {report['error_examples'] or ''}; "
        f"p99 drift {report['p99_drift_pct']:+.1f}%",
        "",
    ]
    targets = report["targets"]
    assert isinstance(targets, dict)
    lines += [f"- {name}: {'met' if ok else 'NOT MET'}" for name, ok in targets.items()]
    return "\n".join(lines)

"""bench.served.models without servers: its flags, the commands it starts, what it reads, reports.

The server command is parsed by `poolserve serve`'s own parser and models-file reader; step
times are read from the exposition the server's own metrics render, against hand-computed
values (the mean, and Prometheus' histogram_quantile interpolation).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench.served import models, models_report
from poolserve.config.flags import parse_settings
from poolserve.config.models_file import served_models
from poolserve.observability.metrics import ServiceMetrics


def test_flags() -> None:
    mode, names = models.parse_args([])
    assert (mode.name, mode.rounds) == ("full", 2)
    assert names == list(models.ARRANGEMENTS)
    mode, names = models.parse_args(["--quick", "--rounds", "3", "--arrangements", "separate"])
    assert (mode.name, mode.rounds, names) == ("quick", 3, ["separate"])


@pytest.mark.parametrize("argv", [["--arrangements", "together,nope"], ["--rounds", "0"]])
def test_bad_flags_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        models.parse_args(argv)
    assert exited.value.code == 2


def test_server_commands_serve_the_named_models(tmp_path: Path) -> None:
    paths = {models.EMBEDDER: tmp_path / "e", models.RERANKER: tmp_path / "r"}
    for path in paths.values():
        path.mkdir()
    setup = models.Setup(paths, {}, tmp_path, tmp_path)
    for servers, _ in models.ARRANGEMENTS.values():
        for served in servers:
            command = models.server_command(setup, served, 8123)
            settings = parse_settings(command[command.index("serve") :])
            assert (settings.port, settings.device, settings.dtype) == (8123, "cpu", "float32")
            got = served_models(settings).models
            assert [m.name for m in got] == list(served)
            assert [m.settings.model for m in got] == [str(paths[n]) for n in served]


def test_step_times_from_the_servers_metrics() -> None:
    metrics = ServiceMetrics()
    embedder, reranker = metrics.model("embedder"), metrics.model("reranker")
    for _ in range(5):  # steps before the window: not counted
        embedder.on_step(100, 2.0)
    before = metrics.render().decode()
    steps = [0.02] * 22 + [0.04] * 16 + [0.08] * 6 + [0.2] * 31
    for duration in steps:
        embedder.on_step(100, duration)
    reranker.on_step(10, 0.03)
    after = metrics.render().decode()
    got = models_report.step_summary(before, after, "embedder")
    assert got["steps"] == 75
    assert got["mean_ms"] == pytest.approx(1e3 * sum(steps) / 75)
    # rank 0.99 * 75 = 74.25 in the (0.1, 0.25] bucket, which holds steps 45 to 75
    assert got["p99_ms"] == pytest.approx(1e3 * (0.1 + 0.15 * (74.25 - 44) / 31))
    assert models_report.step_summary(before, after, "reranker")["steps"] == 1
    assert math.isnan(models_report.step_summary(before, after, "absent")["mean_ms"])


def _window(rerank: tuple[float, float] | None, embed_rate: float | None, step: float) -> Any:
    return {
        "load_average": [1.5, 1.0, 1.0],
        "embed": None if embed_rate is None else {"requests_per_s": embed_rate},
        "rerank": None
        if rerank is None
        else {"requests_per_s": 10.0, "p50_ms": rerank[0], "p99_ms": rerank[1]},
        "steps": {"embedder": {"mean_ms": step, "p99_ms": 2 * step}},
    }


def _record(name: str, windows: dict[str, Any], rss: float) -> dict[str, Any]:
    memory = {"rss_mib": rss, "pss_mib": rss - 100, "processes": 3}
    return {
        "arrangement": name,
        "round": 1,
        "windows": windows,
        "memory": {"warm": memory, "loaded": memory},
    }


def test_report_tables() -> None:
    records = [
        _record("embedder-alone", {"embed": _window(None, 30.0, 40.0)}, 960.0),
        _record("reranker-alone", {"idle": _window((50.0, 90.0), None, math.nan)}, 970.0),
        _record(
            "together",
            {"idle": _window((50.0, 100.0), None, 0.0), "mixed": _window((80.0, 140.0), 30, 50.0)},
            1100.0,
        ),
        _record(
            "separate",
            {"idle": _window((50.0, 100.0), None, 0.0), "mixed": _window((90.0, 200.0), 33, 50.0)},
            1930.0,
        ),
    ]
    report = {
        "command": "python -m bench models --quick",
        "date": "2026-12-01 10:00 UTC to 10:02 UTC",
        "cpus": 2,
        "source": "commit abc",
        "rounds": 1,
        "load_before": [1.0, 1.0, 1.0],
        "load_after": [2.0, 1.0, 1.0],
        "load": {
            "texts_per_request": 4,
            "documents": 8,
            "embed_concurrency": 16,
            "rerank_concurrency": 1,
            "warmup_s": 2,
            "idle_s": 3,
            "mixed_s": 5,
        },
        "failures": ["separate (round 2): server at x exited before it was ready"],
        "records": records,
    }
    text = models_report.markdown(report)
    # together: 30 req/s x 4 texts; rerank p99 140 against idle 100 + one 50 ms step
    together = (
        "| 120 | 1.00x | 10.0 | 1.00x | 80 | 140 | 100 | 50, 100 | 150: within | 200: within |"
    )
    assert together in text
    assert "| 200 | 100 | 50, 100 | 150: **50 over** | 200: within |" in text
    assert "| sum of the two alone | 6 | 1,930 | 1,930 | 1,730 |" in text
    assert "| **together - sum of the two alone** | | -830 | -830 | -730 |" in text
    assert "failed: separate (round 2)" in text

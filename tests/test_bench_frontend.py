"""bench.common.wrk reads wrk's --latency output; bench.frontend.report turns points into tables.

The texts below are real `wrk -t1 --latency -s post.lua` runs, captured on this machine against
bench/frontend/floor.py: a normal run, one against a missing route (every answer a 404) and one
whose server was killed mid-run (socket errors).
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.common.wrk import WrkOutputError, parse_wrk
from bench.frontend import report as frontend_report
from bench.frontend.interleaved import Total, markdown, summary

Point = dict[str, Any]  # one measured point as bench.frontend.sequential records it

# wrk -t1 -c16 -d3s --latency -s post.lua http://127.0.0.1:18555/v1/embeddings
FLOOR_RUN = """\
Running 3s test @ http://127.0.0.1:18555/v1/embeddings
  1 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.82ms    1.29ms  31.13ms   86.44%
    Req/Sec     5.74k     1.68k    9.18k    80.00%
  Latency Distribution
     50%    2.83ms
     75%    3.59ms
     90%    3.79ms
     99%    5.95ms
  17142 requests in 3.01s, 6.60MB read
Requests/sec:   5704.39
Transfer/sec:      2.20MB
"""

# wrk -t1 -c4 -d1s --latency -s post.lua http://127.0.0.1:18555/nope
NOT_FOUND_RUN = """\
Running 1s test @ http://127.0.0.1:18555/nope
  1 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   399.29us  155.23us   3.41ms   87.71%
    Req/Sec    10.15k     1.38k   10.93k    81.82%
  Latency Distribution
     50%  359.00us
     75%  406.00us
     90%  513.00us
     99%  832.00us
  11095 requests in 1.10s, 1.45MB read
  Non-2xx or 3xx responses: 11095
Requests/sec:  10089.46
Transfer/sec:      1.32MB
"""

# wrk -t1 -c8 -d3s --timeout 5s --latency -s post.lua ... (the server killed after 1.5 s)
KILLED_RUN = """\
Running 3s test @ http://127.0.0.1:18556/v1/embeddings
  1 threads and 8 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.14ms  553.52us   9.35ms   82.94%
    Req/Sec     6.91k     1.89k    8.76k    62.50%
  Latency Distribution
     50%    0.95ms
     75%    1.27ms
     90%    1.77ms
     99%    2.67ms
  11004 requests in 3.10s, 4.24MB read
  Socket errors: connect 0, read 8, write 81013, timeout 0
Requests/sec:   3549.66
Transfer/sec:      1.37MB
"""

# What wrk prints (on stderr) when nothing listens on the port: no summary at all.
REFUSED_RUN = "unable to connect to 127.0.0.1:18599 Connection refused\n"


def test_a_clean_run() -> None:
    result = parse_wrk(FLOOR_RUN)
    assert result.requests == 17142
    assert result.duration_s == pytest.approx(3.01)
    assert result.requests_per_s == pytest.approx(5704.39)
    assert result.p50_ms == pytest.approx(2.83)
    assert result.p99_ms == pytest.approx(5.95)
    assert result.errors == 0


def test_microseconds_and_error_statuses() -> None:
    result = parse_wrk(NOT_FOUND_RUN)
    assert result.p50_ms == pytest.approx(0.359)
    assert result.p99_ms == pytest.approx(0.832)
    assert result.non_2xx == result.requests == 11095
    assert result.errors == 11095


def test_socket_errors_are_summed() -> None:
    result = parse_wrk(KILLED_RUN)
    assert result.socket_errors == 8 + 81013
    assert result.non_2xx == 0
    assert result.requests_per_s == pytest.approx(3549.66)


def test_no_summary_is_an_error() -> None:
    with pytest.raises(WrkOutputError):
        parse_wrk(REFUSED_RUN)


def _point(server: str, concurrency: int, text: str, cpu_s: float, round_: int = 1) -> Point:
    result = parse_wrk(text)
    return {
        "server": server,
        "concurrency": concurrency,
        "round": round_,
        "requests_per_s": result.requests_per_s,
        "p50_ms": result.p50_ms,
        "p99_ms": result.p99_ms,
        "errors": result.errors,
        "cpu_ms_per_request": 1e3 * cpu_s / result.requests,
        "load_average": [1.0, 1.0, 1.0],
    }


def test_medians_over_rounds_and_summed_errors() -> None:
    points = [
        _point("floor", 16, FLOOR_RUN, 2.0, 1),
        _point("floor", 16, KILLED_RUN, 1.0, 2),
    ]
    row = frontend_report.summarize(points)["floor"][16]
    assert row["requests_per_s"] == pytest.approx((5704.39 + 3549.66) / 2)
    assert row["errors"] == 8 + 81013
    assert row["rounds"] == 2


def test_report_names_what_did_not_run_and_leaves_its_targets_open() -> None:
    report = {
        "points": [
            _point("poolserve", 64, KILLED_RUN, 3.0),
            _point("floor", 64, FLOOR_RUN, 2.0),
        ],
        "not_run": {"infinity": "not installed (run bash bench/peers/infinity_env.sh)"},
        "failures": [],
        "peak_rss_mib": {"poolserve": 300.0, "floor": 50.0},
        "source": "commit abc",
        "cpus": 2,
    }
    text = frontend_report.markdown(report)
    assert "| poolserve, 1 front end | 64 | 3,550 |" in text
    assert "0.62x: **met**" in text  # 3549.66 / 5704.39 against the 0.40x floor target
    assert "req/s at concurrency 64 >= 2x Infinity's: n/a (not measured)" in text
    assert "Not run: Infinity 0.0.78: not installed" in text


def test_interleaved_totals_give_rates_cpu_and_the_floor_share() -> None:
    floor = Total("floor").add(8000, 2.0, 1.2, 0).add(6000, 2.0, 1.0, 0)  # 3,500 req/s
    pool = Total("poolserve-2fe").add(2900, 2.0, 2.0, 0).add(2700, 2.0, 2.2, 3)  # 1,400 req/s
    dead = Total("poolserve")
    rows = {row["server"]: row for row in summary([pool, floor, dead])}
    assert rows["poolserve-2fe"]["requests_per_s"] == pytest.approx(1400.0)
    assert rows["poolserve-2fe"]["cpu_ms_per_request"] == pytest.approx(1e3 * 4.2 / 5600)
    assert rows["poolserve-2fe"]["of_floor"] == pytest.approx(0.4)
    assert rows["poolserve-2fe"]["errors"] == 3
    assert rows["floor"]["of_floor"] == pytest.approx(1.0)
    assert rows["poolserve"]["cpu_ms_per_request"] is None
    assert rows["poolserve"]["of_floor"] == 0.0
    assert all(row["of_floor"] is None for row in summary([pool]))  # no floor, no share
    table = markdown(
        {
            "date": "d",
            "source": "s",
            "concurrency": 64,
            "rounds": 2,
            "point_s": 2,
            "not_run": {"infinity": "not installed"},
            "summary": summary([pool, floor, dead]),
        }
    )
    assert "| poolserve-2fe | 1,400 | 0.750 | 0.40x | 3 |" in table
    assert "| poolserve | 0 | - | 0.00x | 0 |" in table
    assert "- not run: infinity: not installed" in table

"""Prometheus config, alert rules and the Grafana dashboard pass promtool and match each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.tools import (
    DEPLOY_DIR,
    dashboard_queries,
    load_dashboard,
    metric_families,
    panel_exprs,
    require_tool,
    run_tool,
)

pytestmark = pytest.mark.slow

ALERTS = DEPLOY_DIR / "alerts.yml"
ALERT_TESTS = DEPLOY_DIR / "alerts.test.yml"
DATASOURCES = DEPLOY_DIR / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
# What the dashboard must show (the metric each panel family is read from).
DASHBOARD_MUST_READ = {
    "request rate by task and status": "poolserve_requests_total",
    "latency p50/p99": "poolserve_request_duration_seconds",
    "queue depth": "poolserve_waiting_requests",
    "queued tokens": "poolserve_queued_tokens",
    "step tokens/s": "poolserve_step_tokens_total",
    "KV blocks used": "poolserve_kv_blocks_used",
    "KV blocks total": "poolserve_kv_blocks_capacity",
    "cloned bytes": "poolserve_cloned_bytes_total",
    "output bytes": "poolserve_output_bytes_total",
    "rejections": "poolserve_rejected_requests_total",
}


def promtool(*args: str) -> None:
    """Run promtool and fail with its output unless it succeeds."""
    result = run_tool([require_tool("promtool"), *args])
    assert result.returncode == 0, result.describe()


def load_yaml(path: Path) -> Any:
    """A YAML file's content."""
    return yaml.safe_load(path.read_text())


def test_prometheus_config_is_valid() -> None:
    promtool("check", "config", str(DEPLOY_DIR / "prometheus.yml"))


def test_alert_rules_are_valid() -> None:
    promtool("check", "rules", str(ALERTS))


def test_alert_rules_fire_as_specified() -> None:
    # Unit tests on synthetic series: each alert fires for the broken instance only.
    promtool("test", "rules", str(ALERT_TESTS))


def test_every_alert_has_a_unit_test() -> None:
    defined = {r["alert"] for g in load_yaml(ALERTS)["groups"] for r in g["rules"]}
    tested = {
        t["alertname"]
        for case in load_yaml(ALERT_TESTS)["tests"]
        for t in case["alert_rule_test"]
        if t["exp_alerts"]
    }
    assert defined == tested


def test_alerts_cover_the_required_signals() -> None:
    exprs = " ".join(r["expr"] for g in load_yaml(ALERTS)["groups"] for r in g["rules"])
    for signal in (
        "poolserve_ready",
        'status=~"5.."',
        'status="429"',
        "poolserve_queue_duration_seconds_bucket",
        "poolserve_kv_blocks_used",
    ):
        assert signal in exprs


def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    # promtool parses recording-rule expressions, so each panel query becomes one rule.
    rules = [{"record": f"dashboard:panel_{i}", "expr": e} for i, e in enumerate(panel_exprs())]
    rule_file = tmp_path / "dashboard_rules.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    promtool("check", "rules", str(rule_file))


def test_dashboard_shows_the_required_metrics() -> None:
    read = metric_families(dashboard_queries())
    missing = {what: m for what, m in DASHBOARD_MUST_READ.items() if m not in read}
    assert not missing


def test_dashboard_uses_the_provisioned_datasource() -> None:
    provisioned = {d["uid"] for d in load_yaml(DATASOURCES)["datasources"]}
    used: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            datasource = node.get("datasource")
            if isinstance(datasource, dict):
                used.add(datasource["uid"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(load_dashboard())
    assert used == provisioned


def test_dashboard_panels_do_not_overlap() -> None:
    panels = load_dashboard()["panels"]
    assert isinstance(panels, list)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        covered = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & covered, f"panel {panel['title']!r} overlaps another"
        assert pos["x"] + pos["w"] <= 24
        cells |= covered

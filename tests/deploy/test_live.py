"""Live checks against a running `poolserve serve`: promtool, a real Prometheus, the dashboard."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.deploy.live import (
    HTTP_TIMEOUT_S,
    LiveProcess,
    poolserve_server,
    prometheus_server,
    query,
)
from tests.deploy.tools import (
    dashboard_queries,
    exposition_families,
    metric_families,
    panel_exprs,
    require_tool,
    run_tool,
    wait_until,
)

pytestmark = pytest.mark.slow

NUM_EMBEDDING_REQUESTS = 3
EMBEDDING_INPUTS = ["hello world", "foo"]
FIRST_SCRAPE_TIMEOUT_S = 30.0
RULE_EVALUATION_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SentRequests:
    """What the test sent to the server before Prometheus first scraped it."""

    model: str
    num_requests: int


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveProcess]:
    """One poolserve server for the module."""
    with poolserve_server(tmp_path_factory.mktemp("poolserve")) as live:
        yield live


@pytest.fixture(scope="module")
def sent(server: LiveProcess) -> SentRequests:
    """A few successful embedding requests, named with the model from /v1/models."""
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as client:
        models = client.get("/v1/models")
        assert models.status_code == 200, models.text
        model = models.json()["data"][0]["id"]
        for _ in range(NUM_EMBEDDING_REQUESTS):
            body = {"input": EMBEDDING_INPUTS, "model": model}
            response = client.post("/v1/embeddings", json=body)
            assert response.status_code == 200, response.text
            assert len(response.json()["data"]) == len(EMBEDDING_INPUTS)
    return SentRequests(model, NUM_EMBEDDING_REQUESTS)


@pytest.fixture(scope="module")
def metrics_text(server: LiveProcess, sent: SentRequests) -> str:
    """The live /metrics exposition after the requests."""
    response = httpx.get(server.base_url + "/metrics", timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 200
    return response.text


@pytest.fixture(scope="module")
def prometheus(
    server: LiveProcess, sent: SentRequests, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveProcess]:
    """A real Prometheus scraping the server every second, started after the requests."""
    target = server.base_url.removeprefix("http://")
    with prometheus_server(target, tmp_path_factory.mktemp("prometheus")) as live:
        yield live


def first_scrape(prometheus: LiveProcess, promql: str) -> list[dict[str, Any]]:
    """The query's result once Prometheus has scraped at least one sample for it."""
    return wait_until(
        lambda: query(prometheus, promql) or None,
        FIRST_SCRAPE_TIMEOUT_S,
        f"Prometheus to return samples for {promql}",
    )


def test_promtool_check_metrics_passes(metrics_text: str) -> None:
    result = run_tool([require_tool("promtool"), "check", "metrics"], stdin=metrics_text)
    assert result.returncode == 0, result.describe()


def test_prometheus_scrapes_the_server(prometheus: LiveProcess) -> None:
    up = first_scrape(prometheus, 'up{job="poolserve"}')
    assert [float(s["value"][1]) for s in up] == [1.0]
    ready = first_scrape(prometheus, 'poolserve_ready{job="poolserve"}')
    assert [float(s["value"][1]) for s in ready] == [1.0]


def test_prometheus_counts_the_requests_sent(prometheus: LiveProcess, sent: SentRequests) -> None:
    # Every request was sent before Prometheus started, so its first scrape holds the final counts.
    series = first_scrape(prometheus, 'poolserve_requests_total{endpoint="/v1/embeddings"}')
    counts = {(s["metric"]["task"], s["metric"]["status"]): float(s["value"][1]) for s in series}
    assert counts == {("embed", "200"): float(sent.num_requests)}


def test_dashboard_reads_only_exported_metrics(metrics_text: str) -> None:
    exported = exposition_families(metrics_text)
    unknown = metric_families(dashboard_queries()) - exported
    assert not unknown, f"the dashboard reads metrics the server does not export: {sorted(unknown)}"


def test_dashboard_queries_run_in_prometheus(prometheus: LiveProcess) -> None:
    first_scrape(prometheus, 'up{job="poolserve"}')
    for expr in panel_exprs():
        query(prometheus, expr)  # fails on any PromQL or evaluation error


def test_alert_rules_evaluate_cleanly_on_live_metrics(prometheus: LiveProcess) -> None:
    first_scrape(prometheus, 'up{job="poolserve"}')

    def evaluated_rules() -> list[dict[str, Any]] | None:
        body = httpx.get(prometheus.base_url + "/api/v1/rules", timeout=HTTP_TIMEOUT_S).json()
        rules = [r for g in body["data"]["groups"] for r in g["rules"]]
        return rules if rules and all(r["health"] != "unknown" for r in rules) else None

    rules = wait_until(evaluated_rules, RULE_EVALUATION_TIMEOUT_S, "every alert rule's evaluation")
    problems = {
        r["name"]: (r["health"], r.get("lastError"), r["state"])
        for r in rules
        if r["health"] != "ok" or r["state"] != "inactive"
    }
    assert not problems, f"rules must evaluate, and a healthy server must not alert: {problems}"

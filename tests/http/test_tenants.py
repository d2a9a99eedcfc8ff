"""The token bucket and the key ring of --api-keys-file, without HTTP: refills, debts, shares
of --api-server-count, reloads that keep what a tenant used."""

from __future__ import annotations

from pathlib import Path

import pytest

from poolserve.http.tenants import KeyRing, TokenBucket
from poolserve.observability.metrics import ServiceMetrics
from poolserve.types.errors import KeyRateLimitedError, PermissionDeniedError


def test_a_bucket_gives_its_burst_then_its_rate() -> None:
    bucket = TokenBucket(rate=2.0, capacity=3.0, now=0.0)
    assert [bucket.take(1.0, 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(1.0, 0.0) == pytest.approx(0.5)  # one more in half a second
    assert bucket.take(1.0, 0.25) == pytest.approx(0.25)
    assert bucket.take(1.0, 0.5) == 0.0
    assert bucket.take(1.0, 100.0) == 0.0  # refilled to its capacity, never beyond
    assert bucket.level == pytest.approx(2.0)


def test_a_charge_overdraws_and_the_debt_is_paid_by_the_refill() -> None:
    bucket = TokenBucket(rate=10.0, capacity=100.0, now=0.0)  # 600 a minute
    assert bucket.debt(0.0) == 0.0
    bucket.charge(150.0, 0.0)  # known after the fact: more than was left
    assert bucket.debt(0.0) == pytest.approx(5.0)
    assert bucket.debt(4.0) == pytest.approx(1.0)
    assert bucket.debt(5.0) == 0.0


def test_a_resize_keeps_what_was_used() -> None:
    bucket = TokenBucket(rate=1.0, capacity=10.0, now=0.0)
    bucket.charge(8.0, 0.0)
    bucket.resize(rate=2.0, capacity=5.0, now=0.0)
    assert bucket.level == pytest.approx(2.0)
    bucket.resize(rate=2.0, capacity=1.0, now=0.0)
    assert bucket.level == pytest.approx(1.0)


def _ring(tmp_path: Path, text: str, share: int = 1) -> KeyRing:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    ring = KeyRing(str(path), None, share, ServiceMetrics())
    ring.load()
    return ring


def test_each_front_end_enforces_its_share(tmp_path: Path) -> None:
    text = "keys: [{name: a, key: k, requests_per_second: 10, burst: 4, tokens_per_minute: 600}]"
    usage = _ring(tmp_path, text, share=2).usage["a"]
    assert usage.requests is not None and usage.tokens is not None
    assert (usage.requests.rate, usage.requests.capacity) == (5.0, 2.0)
    assert (usage.tokens.rate, usage.tokens.capacity) == (5.0, 300.0)
    # a burst smaller than the front ends still lets each front end through one request
    one = _ring(tmp_path, "keys: [{name: a, key: k, requests_per_second: 1}]", share=4)
    assert one.usage["a"].requests is not None and one.usage["a"].requests.capacity == 1.0


def test_find_matches_every_key_of_a_name_and_nothing_else(tmp_path: Path) -> None:
    ring = _ring(tmp_path, "keys: [{name: a, key: [k1, k2]}, {name: b, key: k3}]")
    found = [ring.find(k) for k in (b"k1", b"k2", b"k3", b"k4", b"")]
    assert [None if f is None else f.name for f in found] == ["a", "a", "b", None, None]


def test_admit_refuses_routes_then_limits(tmp_path: Path) -> None:
    text = "keys: [{name: a, key: k, requests_per_second: 1, routes: [/v1/embeddings]}]"
    tenant = _ring(tmp_path, text).find(b"k")
    assert tenant is not None and tenant.usage.requests is not None
    start = tenant.usage.requests.stamp
    with pytest.raises(PermissionDeniedError) as denied:
        tenant.admit("/v1/pooling", start)
    assert denied.value.code == "route_not_allowed"
    tenant.admit("/v1/embeddings", start)
    with pytest.raises(KeyRateLimitedError) as limited:
        tenant.admit("/v1/embeddings", start + 0.25)
    assert limited.value.retry_after_s == pytest.approx(0.75, abs=0.01)


def test_a_reload_keeps_the_use_of_names_it_keeps(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    ring = _ring(tmp_path, "keys: [{name: a, key: k, tokens_per_minute: 60}]")
    tenant = ring.find(b"k")
    assert tenant is not None
    tenant.charge(100)  # 40 tokens in debt
    path.write_text("keys: [{name: a, key: new, tokens_per_minute: 120}, {name: b, key: k2}]")
    ring.reload()
    assert ring.find(b"k") is None
    renewed = ring.find(b"new")
    assert renewed is not None and renewed.usage is tenant.usage  # an in-flight charge lands
    assert renewed.usage.tokens is not None and renewed.usage.tokens.level < -39
    with pytest.raises(KeyRateLimitedError):
        renewed.admit("/v1/embeddings", renewed.usage.tokens.stamp)


def test_a_bad_file_on_reload_keeps_the_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ring = _ring(tmp_path, "keys: [{name: a, key: k}]")
    (tmp_path / "keys.yaml").write_text("keys: [{name: a, key: k, requests_per_second: -1}]")
    with caplog.at_level("INFO", logger="poolserve.http.tenants"):
        ring.reload()
    assert ring.find(b"k") is not None
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert errors[0].getMessage().endswith("kept the 1 key(s) read before")
    assert "keys[0] (a).requests_per_second" in errors[0].getMessage()

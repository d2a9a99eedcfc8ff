"""API keys of many tenants (`--api-keys-file`) in one front end: who a request is, what it may
use, and how much.

A presented key is hashed with SHA-256 and its digest compared in constant time with every
configured digest (no early exit, no lookup by name). A key name's limits are token buckets of
this process: with `--api-server-count N` each front end enforces 1/N of every limit, the kernel
spreading connections over them. Requests per second: a bucket of `burst` requests refilled at
the rate, one request taking one. Tokens per minute: a bucket of a minute's prompt tokens,
refilled continuously; a request is admitted while the bucket is not in debt, and its prompt
tokens are charged once the engine has admitted them, so one request may overdraw the bucket and
the key then waits until the refill has paid the debt. The HTTP edge and the gRPC server of a
front end share its one `KeyRing` (table, buckets, counters). A SIGHUP re-reads the file: the
buckets of the names it keeps carry over (a reload neither resets nor forgets what a tenant
used); a bad file keeps the keys read before.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from dataclasses import dataclass
from itertools import repeat

from poolserve.config.api_keys import ApiKeysFileError, KeySpec, read_keys
from poolserve.frontend.state import ServiceState
from poolserve.observability.metrics import ServiceMetrics
from poolserve.types.errors import KeyRateLimitedError, PermissionDeniedError, clip

logger = logging.getLogger(__name__)

# Where the edge keeps a request's TenantKey in the ASGI scope's state.
TENANT_KEY = "poolserve.tenant"
# Why a key's request was refused: the reason label of poolserve_api_key_rejected_requests.
REASONS = ("route", "model", "requests_per_second", "tokens_per_minute")
SECONDS_PER_MINUTE = 60.0


class TokenBucket:
    """`capacity` units refilled at `rate` a second; a charge made after the fact may take the
    level below zero. Every method takes `now` (time.monotonic())."""

    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self.stamp = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, cost: float, now: float) -> float:
        """Take `cost` units: 0.0 when taken, else the seconds until they could be."""
        self._refill(now)
        if self.level >= cost:
            self.level -= cost
            return 0.0
        return (cost - self.level) / self.rate

    def debt(self, now: float) -> float:
        """The seconds until the level is back at zero (0.0: not in debt)."""
        self._refill(now)
        return 0.0 if self.level >= 0.0 else -self.level / self.rate

    def charge(self, cost: float, now: float) -> None:
        """Take `cost` units whatever the level."""
        self._refill(now)
        self.level -= cost

    def resize(self, rate: float, capacity: float, now: float) -> None:
        """New limits; what was used stays used (the level at most the new capacity)."""
        self._refill(now)
        self.rate = rate
        self.capacity = capacity
        self.level = min(self.level, capacity)


class Usage:
    """One key name's buckets and counters in this process (kept across reloads)."""

    def __init__(self, name: str, metrics: ServiceMetrics) -> None:
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        # children looked up once: `.labels()` costs microseconds per call
        self.counted = metrics.key_requests.labels(name)
        self.prompt_tokens = metrics.key_prompt_tokens.labels(name)
        self.rejected = {reason: metrics.key_rejected.labels(name, reason) for reason in REASONS}

    def limit(self, spec: KeySpec, share: int, now: float) -> None:
        """This process's share of the key's limits (1/share of each)."""
        rps, tpm = spec.requests_per_second, spec.tokens_per_minute
        if rps is None:
            self.requests = None
        else:  # each front end may always let one request through
            burst = max(1.0, (spec.burst or max(1.0, rps)) / share)
            self.requests = _sized(self.requests, rps / share, burst, now)
        if tpm is None:
            self.tokens = None
        else:
            self.tokens = _sized(self.tokens, tpm / share / SECONDS_PER_MINUTE, tpm / share, now)


def _sized(
    bucket: TokenBucket | None, rate: float, capacity: float, now: float
) -> TokenBucket | None:
    """A new bucket, or the one there resized (what was used stays used)."""
    if bucket is None:
        return TokenBucket(rate, capacity, now)
    bucket.resize(rate, capacity, now)
    return bucket


@dataclass(frozen=True, eq=False)
class TenantKey:
    """A request's key: its name, what it may use, and its name's usage."""

    spec: KeySpec
    usage: Usage
    limited: bool = True  # False for a batch line: counted, never held back by the buckets

    @property
    def name(self) -> str:
        """The key's name (the metrics label and the access log field; never the key)."""
        return self.spec.name

    def admit(self, path: str, now: float) -> None:
        """Count the request; 403 for a route the key may not use, 429 while a limit is spent
        (its tokens in debt, or no request left in its bucket)."""
        usage = self.usage
        usage.counted.inc()
        if not self.spec.allows_route(path):
            usage.rejected["route"].inc()
            raise PermissionDeniedError(
                f"this API key may not use {clip(path)}", None, "route_not_allowed"
            )
        tokens = usage.tokens
        wait = 0.0 if tokens is None else tokens.debt(now)
        if wait > 0.0:
            usage.rejected["tokens_per_minute"].inc()
            raise KeyRateLimitedError(
                "this API key's tokens_per_minute is spent; retry after the Retry-After seconds",
                wait,
            )
        requests = usage.requests
        wait = 0.0 if requests is None else requests.take(1.0, now)
        if wait > 0.0:
            usage.rejected["requests_per_second"].inc()
            raise KeyRateLimitedError(
                "this API key's requests_per_second is spent; retry after the Retry-After seconds",
                wait,
            )

    def may_use(self, names: tuple[str, ...]) -> bool:
        """Whether the key's `models` name the model served under `names` (an adapter: its
        own name only), by any of them."""
        models = self.spec.models
        return models is None or not models.isdisjoint(names)

    def check_model(self, names: tuple[str, ...]) -> None:
        """403 unless the key may use the model served under `names` (an adapter: its own)."""
        if self.may_use(names):
            return
        self.usage.rejected["model"].inc()
        raise PermissionDeniedError(
            f"this API key may not use the model {clip(names[0])!r}", "model", "model_not_allowed"
        )

    def charge(self, num_tokens: int) -> None:
        """The prompt tokens the engine admitted for one of the key's requests."""
        usage = self.usage
        usage.prompt_tokens.inc(num_tokens)
        if usage.tokens is not None and self.limited:
            usage.tokens.charge(num_tokens, time.monotonic())


def served_names(state: ServiceState, model_name: str, lora_name: str | None) -> tuple[str, ...]:
    """Every name of the model a request runs on, as a key's `models` reads them (an adapter:
    its own name only)."""
    if lora_name is not None:
        return (lora_name,)
    served = state.served.get(model_name)
    return (model_name,) if served is None else served.handle.served_names


class KeyRing:
    """The keys of --api-keys-file (and --api-key beside it) in this front end."""

    def __init__(self, path: str, api_key: str | None, share: int, metrics: ServiceMetrics):
        self.path = path
        self.api_key = api_key
        self.share = max(1, share)  # --api-server-count 0: this process is every front end
        self.metrics = metrics
        # every configured digest, and the key each stands for (a name may have several)
        self.table: tuple[tuple[bytes, ...], tuple[TenantKey, ...]] = ((), ())
        self.usage: dict[str, Usage] = {}

    def load(self) -> None:
        """Read the file and serve its keys from now on; raises ApiKeysFileError."""
        specs = read_keys(self.path, self.api_key)
        now = time.monotonic()
        digests: list[bytes] = []
        tenants: list[TenantKey] = []
        usage: dict[str, Usage] = {}
        for spec in specs:
            kept = usage[spec.name] = self.usage.get(spec.name) or Usage(spec.name, self.metrics)
            kept.limit(spec, self.share, now)
            tenant = TenantKey(spec, kept)
            digests.extend(spec.digests)
            tenants.extend(tenant for _ in spec.digests)
        # one assignment: a request reads the old table or the new one, never half of each
        self.table, self.usage = (tuple(digests), tuple(tenants)), usage

    def reload(self) -> None:
        """Read the file again (SIGHUP); a bad file keeps the keys read before, said in one
        error line."""
        try:
            self.load()
        except ApiKeysFileError as exc:
            logger.error("%s; kept the %d key(s) read before", exc, len(self.usage))
            return
        logger.info("--api-keys-file %s: %d key(s) read", self.path, len(self.usage))

    def named(self, name: str) -> TenantKey | None:
        """The key named `name` (a batch's owner), None once the file no longer has it."""
        usage = self.usage.get(name)
        if usage is None:
            return None
        return next((t for t in self.table[1] if t.name == name), None)

    def find(self, token: bytes) -> TenantKey | None:
        """The key whose digest is the SHA-256 of `token`, compared with every digest."""
        digest = hashlib.sha256(token).digest()
        digests, tenants = self.table
        # every comparison runs (map consumed whole, in C): no early exit tells how close a
        # guess came; only where a match sits is then looked up, and a match is a key its
        # sender holds already
        hits = list(map(hmac.compare_digest, repeat(digest, len(digests)), digests))
        return tenants[hits.index(True)] if True in hits else None


def on_hangup(keys: KeyRing | None) -> None:
    """SIGHUP: read the keys file again (every front end gets the signal)."""
    if keys is None:
        logger.info("SIGHUP: nothing to reload (no --api-keys-file)")
        return
    keys.reload()

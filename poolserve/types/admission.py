"""Bounded admission: refuse work early, by queued requests and queued prompt tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from poolserve.types.errors import OverloadedError, OverloadReason, RequestTooLargeError
from poolserve.types.limits import SchedulerConfig

MIN_RETRY_AFTER_S = 1.0
# a stale or tiny throughput estimate must not tell clients to go away for hours
MAX_RETRY_AFTER_S = 60.0


@dataclass(frozen=True, slots=True)
class AdmissionSnapshot:
    """Admission counters at one moment."""

    queued_requests: int
    queued_tokens: int
    num_rejected_queue_full: int
    num_rejected_tokens_full: int


class AdmissionControl:
    """Counts admitted, unfinished requests and their prompt tokens against fixed limits."""

    def __init__(
        self,
        max_num_queued_requests: int,
        max_num_queued_tokens: int,
        throughput_tokens_per_s: float | None = None,
    ) -> None:
        if max_num_queued_requests < 1 or max_num_queued_tokens < 1:
            raise ValueError("admission limits must be positive")
        self.max_num_queued_requests = max_num_queued_requests
        self.max_num_queued_tokens = max_num_queued_tokens
        self._throughput: float | None = None
        if throughput_tokens_per_s is not None:
            self.throughput_tokens_per_s = throughput_tokens_per_s
        self._queued_requests = 0
        self._queued_tokens = 0
        self._num_rejected = {reason: 0 for reason in OverloadReason}

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> AdmissionControl:
        """Admission with the limits of `config`."""
        return cls(config.max_num_queued_requests, config.max_num_queued_tokens)

    @property
    def queued_requests(self) -> int:
        """Requests admitted and not yet released."""
        return self._queued_requests

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens of the admitted, unreleased requests."""
        return self._queued_tokens

    @property
    def throughput_tokens_per_s(self) -> float | None:
        """The engine's latest prompt-token throughput estimate (None before the first)."""
        return self._throughput

    @throughput_tokens_per_s.setter
    def throughput_tokens_per_s(self, value: float) -> None:
        if not value > 0:
            raise ValueError(f"throughput must be positive, got {value}")
        self._throughput = value

    def retry_after_s(self) -> float:
        """Hint for clients: time to work off the queued tokens, within [1 s, 60 s]."""
        if self._throughput is None:
            return MIN_RETRY_AFTER_S
        estimate = self._queued_tokens / self._throughput
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, estimate))

    def precheck(self, num_requests: int) -> None:
        """Before tokenization: refuse when the requests cannot fit or no token room is left."""
        self._check_size("requests", num_requests, self.max_num_queued_requests)
        if self._queued_requests + num_requests > self.max_num_queued_requests:
            self._refuse(OverloadReason.QUEUE_FULL, f"{self._queued_requests} requests queued")
        if self._queued_tokens >= self.max_num_queued_tokens:
            self._refuse(OverloadReason.TOKENS_FULL, f"{self._queued_tokens} tokens queued")

    def reserve(self, num_requests: int, num_tokens: int) -> None:
        """After tokenization: admit all the requests and their tokens, or none."""
        self._check_size("requests", num_requests, self.max_num_queued_requests)
        self._check_size("prompt tokens", num_tokens, self.max_num_queued_tokens)
        if self._queued_requests + num_requests > self.max_num_queued_requests:
            self._refuse(OverloadReason.QUEUE_FULL, f"{self._queued_requests} requests queued")
        if self._queued_tokens + num_tokens > self.max_num_queued_tokens:
            self._refuse(OverloadReason.TOKENS_FULL, f"{self._queued_tokens} tokens queued")
        self._queued_requests += num_requests
        self._queued_tokens += num_tokens

    def release(self, num_requests: int, num_tokens: int) -> None:
        """Give back what reserve() took, when requests finish, fail or are cancelled."""
        if num_requests < 0 or num_tokens < 0:
            raise ValueError("cannot release a negative amount")
        if num_requests > self._queued_requests or num_tokens > self._queued_tokens:
            raise ValueError(
                f"release of {num_requests} requests / {num_tokens} tokens exceeds what is "
                f"queued ({self._queued_requests} / {self._queued_tokens})"
            )
        self._queued_requests -= num_requests
        self._queued_tokens -= num_tokens

    def mirror(
        self, queued_requests: int, queued_tokens: int, throughput_tokens_per_s: float | None
    ) -> None:
        """Take another instance's counters: a front end's view of the engine core's admission."""
        self._queued_requests = queued_requests
        self._queued_tokens = queued_tokens
        if throughput_tokens_per_s is not None:
            self.throughput_tokens_per_s = throughput_tokens_per_s

    def num_rejected(self, reason: OverloadReason) -> int:
        """Refusals so far for one reason."""
        return self._num_rejected[reason]

    def count_refusal(self, reason: OverloadReason) -> None:
        """A refusal decided outside these counters (every LoRA slot busy), counted with them."""
        self._num_rejected[reason] += 1

    def rejected_by_reason(self) -> dict[str, int]:
        """Refusals so far, keyed by the reason's value (a copy)."""
        return {reason.value: count for reason, count in self._num_rejected.items()}

    def snapshot(self) -> AdmissionSnapshot:
        """The counters now, as one frozen record."""
        return AdmissionSnapshot(
            self._queued_requests,
            self._queued_tokens,
            self._num_rejected[OverloadReason.QUEUE_FULL],
            self._num_rejected[OverloadReason.TOKENS_FULL],
        )

    @staticmethod
    def _check_size(what: str, requested: int, limit: int) -> None:
        """Refuse for good what could not fit even into an empty queue."""
        if requested < 0:
            raise ValueError(f"negative number of {what}: {requested}")
        if requested > limit:
            raise RequestTooLargeError(what, requested, limit)

    def _refuse(self, reason: OverloadReason, detail: str) -> NoReturn:
        """Count the refusal and raise it with a retry hint."""
        self._num_rejected[reason] += 1
        raise OverloadedError(reason, self.retry_after_s(), detail)


class CharBudget:
    """Bounds the characters being tokenized at once, so text work is admitted like prompt work."""

    def __init__(self, max_chars: int) -> None:
        if max_chars < 1:
            raise ValueError("the character budget must be positive")
        self.max_chars = max_chars
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Characters reserved by tokenizations that have not finished."""
        return self._in_flight

    def reserve(self, num_chars: int) -> None:
        """Take num_chars before tokenizing them; refuse for good above the bound, else for now."""
        if num_chars < 0:
            raise ValueError(f"negative number of characters: {num_chars}")
        if num_chars > self.max_chars:
            raise RequestTooLargeError("characters to tokenize", num_chars, self.max_chars)
        if self._in_flight + num_chars > self.max_chars:
            # tokenization runs at about a million characters a second: the budget frees quickly
            raise OverloadedError(
                OverloadReason.TOKENIZING_FULL,
                MIN_RETRY_AFTER_S,
                f"{self._in_flight} characters are being tokenized (limit {self.max_chars})",
            )
        self._in_flight += num_chars

    def release(self, num_chars: int) -> None:
        """Give back what reserve() took once its tokenization has finished."""
        if not 0 <= num_chars <= self._in_flight:
            raise ValueError(f"release of {num_chars} characters; {self._in_flight} reserved")
        self._in_flight -= num_chars


__all__ = ["AdmissionControl", "AdmissionSnapshot", "CharBudget", "OverloadReason"]

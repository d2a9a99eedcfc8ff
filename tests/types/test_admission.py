"""Admission control: bursts refused with the right reasons, all-or-nothing, capacity restored."""

from __future__ import annotations

import pytest

from poolserve.types.admission import AdmissionControl, AdmissionSnapshot, OverloadReason
from poolserve.types.errors import OverloadedError, RequestTooLargeError
from poolserve.types.limits import SchedulerConfig

Q = OverloadReason.QUEUE_FULL
T = OverloadReason.TOKENS_FULL


def _submit(
    admission: AdmissionControl, num_requests: int, num_tokens: int
) -> OverloadReason | None:
    """The engine's flow: precheck before tokenizing, reserve after; the refusal reason if any."""
    try:
        admission.precheck(num_requests)
        admission.reserve(num_requests, num_tokens)
    except OverloadedError as exc:
        return exc.reason
    return None


def test_burst_of_equal_requests_gets_the_expected_refusals() -> None:
    admission = AdmissionControl(max_num_queued_requests=4, max_num_queued_tokens=10)
    outcomes = [_submit(admission, 1, 3) for _ in range(8)]
    # 3 + 3 + 3 fit; the 4th would make 12 > 10 tokens; the requests limit is never reached
    assert outcomes == [None, None, None, T, T, T, T, T]
    assert admission.snapshot() == AdmissionSnapshot(3, 9, 0, 5)


def test_burst_hits_the_request_limit_first() -> None:
    admission = AdmissionControl(max_num_queued_requests=3, max_num_queued_tokens=100)
    outcomes = [_submit(admission, 1, 10) for _ in range(5)]
    assert outcomes == [None, None, None, Q, Q]
    assert admission.rejected_by_reason() == {
        "queue_full": 2,
        "tokens_full": 0,
        "tokenizing_full": 0,
        "adapter_slots": 0,
    }


def test_mixed_sequence_and_release_restores_capacity() -> None:
    admission = AdmissionControl(max_num_queued_requests=4, max_num_queued_tokens=10)
    assert _submit(admission, 2, 5) is None  # 2 requests, 5 tokens
    assert _submit(admission, 1, 6) is T  # 11 tokens > 10, nothing reserved
    assert _submit(admission, 1, 5) is None  # 3 requests, 10 tokens
    assert _submit(admission, 1, 0) is T  # precheck: tokens already at the limit
    assert _submit(admission, 2, 0) is Q  # precheck: 5 requests > 4
    assert (admission.queued_requests, admission.queued_tokens) == (3, 10)
    admission.release(2, 5)
    assert _submit(admission, 3, 5) is None  # 4 requests, 10 tokens
    assert admission.snapshot() == AdmissionSnapshot(4, 10, 1, 2)
    admission.release(4, 10)
    assert [_submit(admission, 1, 2) for _ in range(5)] == [None, None, None, None, Q]


def test_work_larger_than_the_limits_is_refused_for_good() -> None:
    admission = AdmissionControl(max_num_queued_requests=4, max_num_queued_tokens=10)
    with pytest.raises(RequestTooLargeError):
        admission.precheck(5)
    with pytest.raises(RequestTooLargeError):
        admission.reserve(1, 11)
    assert admission.snapshot() == AdmissionSnapshot(0, 0, 0, 0)  # not an overload


def test_release_beyond_what_is_queued_is_an_error() -> None:
    admission = AdmissionControl(max_num_queued_requests=4, max_num_queued_tokens=10)
    admission.reserve(1, 4)
    with pytest.raises(ValueError):
        admission.release(2, 4)
    with pytest.raises(ValueError):
        admission.release(1, 5)
    assert (admission.queued_requests, admission.queued_tokens) == (1, 4)


@pytest.mark.parametrize(
    ("throughput", "expected"),
    [(None, 1.0), (2.0, 5.0), (1000.0, 1.0), (0.01, 60.0)],
    ids=["no_estimate", "queued_over_rate", "floor_1s", "cap_60s"],
)
def test_retry_after_hint(throughput: float | None, expected: float) -> None:
    admission = AdmissionControl(1, 10, throughput_tokens_per_s=throughput)
    admission.reserve(1, 10)
    with pytest.raises(OverloadedError) as info:
        admission.precheck(1)
    assert info.value.reason is Q
    assert info.value.retry_after_s == expected


def test_throughput_must_be_positive_and_config_limits_apply() -> None:
    admission = AdmissionControl.from_config(
        SchedulerConfig(max_num_queued_requests=2, max_num_queued_tokens=7)
    )
    assert (admission.max_num_queued_requests, admission.max_num_queued_tokens) == (2, 7)
    with pytest.raises(ValueError):
        admission.throughput_tokens_per_s = 0.0
    admission.throughput_tokens_per_s = 3.5
    assert admission.throughput_tokens_per_s == 3.5

"""A gRPC call's key and its refusals without a server: the plain --api-key check, and the
retry hint HTTP's Retry-After gives, as `retry-after` trailing metadata."""

from __future__ import annotations

import grpc
import pytest

from poolserve.grpc.calls import check_key, grpc_error
from poolserve.types.errors import AuthenticationError, KeyRateLimitedError, PermissionDeniedError


def test_the_plain_api_key_is_checked_from_the_authorization_metadata() -> None:
    check_key(None, {})  # no --api-key: nothing to check
    check_key(b"k3y", {"authorization": "Bearer k3y"})
    check_key(b"k3y", {"authorization": "bearer  k3y "})
    for metadata in ({}, {"authorization": "Bearer nope"}, {"authorization": "k3y"}):
        with pytest.raises(AuthenticationError):
            check_key(b"k3y", metadata)


def test_refusals_take_grpc_codes_and_a_retry_hint_in_trailing_metadata() -> None:
    limited = grpc_error(KeyRateLimitedError("spent", 2.2))
    assert limited.code == grpc.StatusCode.RESOURCE_EXHAUSTED and limited.status == 429
    assert limited.trailers == (("retry-after", "3"),)  # rounded up, as HTTP's Retry-After
    assert grpc_error(KeyRateLimitedError("spent", 0.01)).trailers == (("retry-after", "1"),)
    denied = grpc_error(PermissionDeniedError("no", None, "route_not_allowed"))
    assert denied.code == grpc.StatusCode.PERMISSION_DENIED and denied.trailers == ()
    unknown = grpc_error(AuthenticationError("No valid auth token"))
    assert unknown.code == grpc.StatusCode.UNAUTHENTICATED

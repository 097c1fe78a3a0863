"""The client's envelope models and its exception per code (pure)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pydantic import ValidationError

import egress_client
from egress_client import (
    ERROR_CLASSES,
    CapacityExceeded,
    EgressError,
    ErrorCode,
    ExternalCallRequest,
    ExternalCallResponse,
    OutcomeUnknown,
    PermissionDenied,
    RetryPolicy,
    UnknownError,
)
from egress_client.retry import retry_wait

BASE: dict[str, Any] = {
    "trace_id": "tr-1",
    "correlation_id": "c-1",
    "target_system": "openai",
    "endpoint": "/v1/chat/completions",
    "method": "POST",
}


def failed(code: str, *, retryable: bool = False, after: float | None = None, **extra: Any):
    error = {"code": code, "message": "m", "retryable": retryable, "suggested_retry_after": after}
    return ExternalCallResponse.model_validate(
        {"success": False, "latency_ms": 1.0, "error": error, **extra}
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"timeout": "5"},  # strict: a string is not a number
        {"max_retries": True},  # strict: a bool is not an int
        {"timeout": 0},
        {"timeout": 601},
        {"max_retries": 11},
        {"method": "FETCH"},
        {"trace_id": "tr\r\nX-Injected: 1"},  # copied into headers and logs
        {"idempotency_key": "k\x1b[31m"},
        {"max_retires": 2},  # a misspelt field is an error, not a silent default
        {"endpoint": ""},
    ],
)
def test_the_request_refuses_what_the_sidecar_refuses(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ExternalCallRequest.model_validate({**BASE, **bad})


def test_an_upload_body_is_base64_of_the_bytes() -> None:
    body = egress_client.RequestBody.of("audio/wav", b"\x00\xffRIFF")
    assert body.model_dump() == {"content_type": "audio/wav", "base64": "AP9SSUZG"}
    request = ExternalCallRequest.model_validate({**BASE, "body": body, "query": {"alt": "sse"}})
    assert request.body == body
    with pytest.raises(ValidationError):
        egress_client.RequestBody(content_type="a\r\nb", base64="")


def test_the_request_defaults_are_the_contracts() -> None:
    request = ExternalCallRequest.model_validate(BASE)
    assert (request.timeout, request.max_retries, request.protocol_version) == (30.0, 3, "1")
    assert request.parameters == request.headers == request.metadata == {}


def test_the_answer_tolerates_what_a_newer_sidecar_may_add() -> None:
    answer = failed("SOME_FUTURE_CODE", after=3600.0, cost_usd=1.5)  # unknown code and field
    assert answer.error is not None
    assert answer.error.code == "SOME_FUTURE_CODE"
    assert not isinstance(answer.error.code, ErrorCode)
    with pytest.raises(EgressError) as caught:
        answer.raise_for_error()
    assert type(caught.value) is EgressError
    assert caught.value.code == "SOME_FUTURE_CODE"
    assert caught.value.retry_after == 3600.0


def test_a_known_code_is_the_enum_member() -> None:
    answer = failed("CIRCUIT_OPEN", retryable=True)
    assert answer.error is not None
    assert answer.error.code is ErrorCode.CIRCUIT_OPEN


def test_every_code_has_its_class_and_every_class_is_exported() -> None:
    assert set(ERROR_CLASSES) == {code.value for code in ErrorCode}
    for code, cls in ERROR_CLASSES.items():
        assert cls.default_code == code
        assert getattr(egress_client, cls.__name__) is cls
        assert issubclass(cls, EgressError)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_raise_for_error_raises_the_class_of_the_code_with_the_answers_values(
    code: ErrorCode,
) -> None:
    answer = failed(code.value, retryable=True, after=1.25, status_code=429, data={"x": 1})
    with pytest.raises(ERROR_CLASSES[code.value]) as caught:
        answer.raise_for_error()
    exc = caught.value
    # The answer decides, not the class (the sidecar may turn retryable off, or on).
    assert (exc.code, exc.retryable, exc.suggested_retry_after) == (code, True, 1.25)
    assert (exc.status_code, exc.data, exc.response) == (429, {"x": 1}, answer)
    assert str(exc) == f"{code.value}: m (retry after 1.25 s)"


def test_success_returns_itself_and_a_failure_without_payload_is_unknown() -> None:
    ok = ExternalCallResponse(success=True, latency_ms=1.0, data={"a": 1})
    assert ok.raise_for_error() is ok
    with pytest.raises(UnknownError):
        ExternalCallResponse(success=False, latency_ms=1.0).raise_for_error()


def test_capacity_exceeded_reads_like_the_issue() -> None:
    exc = CapacityExceeded("slow down", suggested_retry_after=2.0)
    assert (exc.code, exc.retryable, exc.retry_after) == (ErrorCode.CAPACITY_EXCEEDED, True, 2.0)
    assert not PermissionDenied("no").retryable


# -- when call_with_retries waits ---------------------------------------------------------

RNG = random.Random(7)
POLICY = RetryPolicy(max_attempts=4, backoff_base_s=0.5, backoff_max_s=4.0, jitter=0.2)


@pytest.mark.parametrize(
    ("error", "attempt", "remaining", "low", "high"),
    [
        # The hint, lengthened by at most 20 %, never shortened.
        (CapacityExceeded("m", suggested_retry_after=1.0), 1, 30.0, 1.0, 1.2),
        # Lengthening is cut to what fits before the deadline (less min_attempt_s).
        (CapacityExceeded("m", suggested_retry_after=1.0), 1, 1.15, 1.0, 1.05),
        # No hint: full jitter up to base * 2**(attempt-1), capped.
        (EgressError("m", code="DEPENDENCY_FAILED", retryable=True), 1, 30.0, 0.0, 0.5),
        (EgressError("m", code="DEPENDENCY_FAILED", retryable=True), 3, 30.0, 0.0, 2.0),
        (EgressError("m", code="DEPENDENCY_FAILED", retryable=True), 3, 0.6, 0.0, 0.5),
    ],
)
def test_the_wait(error: EgressError, attempt: int, remaining: float, low: float, high: float):
    for _ in range(50):
        wait = retry_wait(error, attempt, remaining, POLICY, RNG)
        assert wait is not None
        assert low <= wait <= high


@pytest.mark.parametrize(
    ("error", "attempt", "remaining"),
    [
        (PermissionDenied("m"), 1, 30.0),  # not retryable
        (EgressError("m", code="UPSTREAM_REJECTED", retryable=False), 1, 30.0),
        # Never OUTCOME_UNKNOWN, even if an answer said retryable.
        (OutcomeUnknown("m", retryable=True), 1, 30.0),
        (CapacityExceeded("m", suggested_retry_after=5.0), 1, 3.0),  # the hint passes the deadline
        (CapacityExceeded("m"), 4, 30.0),  # attempts spent
        (CapacityExceeded("m"), 1, 0.05),  # no time left for an attempt
    ],
)
def test_no_retry(error: EgressError, attempt: int, remaining: float) -> None:
    assert retry_wait(error, attempt, remaining, POLICY, RNG) is None


def test_a_policy_must_make_sense() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="negative"):
        RetryPolicy(jitter=-0.1)

"""What next after a target's attempts failed (pure): which failures move to the next
fallback, and that nothing moves once a byte reached the agent or the deadline passed."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.call.retry import failover_reason, next_option
from gateway.errors import (
    CapacityExceeded,
    CircuitOpen,
    DeadlineExceeded,
    DependencyFailed,
    GatewayError,
    OutcomeUnknown,
    PermissionDenied,
    QuotaExhausted,
    StreamInterrupted,
    UpstreamRejected,
)

CONTEXT = {"error": {"code": "context_length_exceeded", "message": "too long"}}
ANTHROPIC_CONTEXT = {"error": {"type": "invalid_request_error", "message": "prompt is too long"}}
FILTER = {"error": {"code": "content_filter", "message": "flagged"}}

CASES: list[tuple[str, GatewayError, str | None]] = [
    ("503", DependencyFailed("x", details={"upstream_status": 503}), "upstream_5xx"),
    ("529", DependencyFailed("x", details={"upstream_status": 529}), "upstream_5xx"),
    ("connect", DependencyFailed("x", details={"reason": "connect"}), "connect"),
    ("reset", DependencyFailed("x", details={"reason": "reset"}), "connect"),
    ("429", CapacityExceeded("x", details={"source": "upstream"}), "rate_limited"),
    ("own 429", CapacityExceeded("x", details={}), None),  # the sidecar's own group
    ("quota", QuotaExhausted("x", details={"source": "upstream"}), "quota"),
    ("budget-like quota", QuotaExhausted("x", details={}), None),
    ("breaker", CircuitOpen("x", details={"state": "open"}), "circuit_open"),
    ("silent", DeadlineExceeded("x", details={"reason": "attempt_timeout"}), "first_byte_timeout"),
    ("deadline", DeadlineExceeded("x", details={"reason": "deadline"}), None),
    ("stream", StreamInterrupted("x", details={"reason": "idle_timeout"}), "stream_failed"),
    ("400", UpstreamRejected("x", data={"error": {"message": "bad"}}), None),
    ("context", UpstreamRejected("x", data=CONTEXT), None),  # not without fallback_on
    ("401", PermissionDenied("x", details={"reason": "upstream_denied"}), None),
    ("unknown", OutcomeUnknown("x", details={"reason": "timeout"}), None),
]


@pytest.mark.parametrize(("name", "error", "reason"), CASES, ids=[c[0] for c in CASES])
def test_which_failures_move_on(name: str, error: GatewayError, reason: str | None) -> None:
    assert failover_reason(error, relayed=False, fallback_on=()) == reason


@pytest.mark.parametrize(("name", "error", "reason"), CASES, ids=[c[0] for c in CASES])
def test_nothing_moves_once_a_byte_reached_the_agent(
    name: str, error: GatewayError, reason: str | None
) -> None:
    assert failover_reason(error, relayed=True, fallback_on=("context_length_exceeded",)) is None


def test_context_length_moves_only_when_fallback_on_lists_it() -> None:
    rule = ("context_length_exceeded",)
    for data in (CONTEXT, ANTHROPIC_CONTEXT):
        error = UpstreamRejected("x", data=data)
        assert failover_reason(error, relayed=False, fallback_on=rule) == "context_length_exceeded"
    assert (
        failover_reason(UpstreamRejected("x", data=FILTER), relayed=False, fallback_on=rule) is None
    )


def test_a_request_lost_after_sending_moves_on_only_where_a_duplicate_costs_tokens() -> None:
    lost = OutcomeUnknown("x", details={"reason": "reset"})
    silent = OutcomeUnknown("x", details={"reason": "timeout"})
    kw: dict[str, Any] = {"relayed": False, "fallback_on": ()}
    assert failover_reason(lost, **kw, resend_unanswered=True) == "connect"
    assert failover_reason(silent, **kw, resend_unanswered=True) == "first_byte_timeout"
    assert failover_reason(lost, **kw, resend_unanswered=False) is None
    assert failover_reason(silent, **kw, resend_unanswered=False) is None


def test_next_option_walks_the_list_then_stops() -> None:
    error = DependencyFailed("x", details={"upstream_status": 503})
    kw = {"relayed": False, "fallback_on": (), "now": 1.0, "deadline": 10.0}
    assert next_option(error, 0, 2, **kw) == ("fallback", 0, "upstream_5xx")
    assert next_option(error, 1, 2, **kw) == ("fallback", 1, "upstream_5xx")
    assert next_option(error, 2, 2, **kw).action == "stop"
    assert next_option(error, 0, 0, **kw).action == "stop"


def test_next_option_stops_at_the_deadline_or_after_a_relayed_byte() -> None:
    error = DependencyFailed("x", details={"upstream_status": 503})
    late = next_option(error, 0, 2, relayed=False, fallback_on=(), now=10.0, deadline=10.0)
    assert late.action == "stop"
    cut = StreamInterrupted("x", details={"reason": "reset"})
    relayed = next_option(cut, 0, 2, relayed=True, fallback_on=(), now=1.0, deadline=10.0)
    assert relayed == ("stop", -1, None)

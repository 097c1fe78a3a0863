"""What next after an attempt (pure): retry after a wait, or stop, from the attempt's
outcome and the call's budget of retries and time; and a stream cut before its marker
is one outcome whatever ended it."""

from __future__ import annotations

import random

import pytest

from gateway.call.retry import (
    DONE,
    Outcome,
    RetryBudget,
    Step,
    backoff_s,
    next_step,
)
from gateway.errors import DependencyFailed, GatewayError, StreamInterrupted, UpstreamRejected

NOW = 1000.0
BUDGET = RetryBudget(retries=2, deadline=NOW + 60, backoff_base_s=0.5, backoff_max_s=8.0)
SEED = 7


def _failed(retryable: bool = True) -> GatewayError:
    return DependencyFailed("the upstream failed", retryable=retryable)


def _cut() -> GatewayError:
    return StreamInterrupted("cut", details={"reason": "no_terminal_marker"})


def _backoff(retry_number: int) -> float:
    return backoff_s(retry_number, 0.5, 8.0, random.Random(SEED))


CASES = [
    # (name, outcome, retries made, budget, expected step)
    ("success", DONE, 0, BUDGET, Step("stop", "done")),
    ("success-after-retries", DONE, 2, BUDGET, Step("stop", "done")),
    (
        "credential-refreshed",
        Outcome(refreshed=True),
        2,  # not counted: even with no retries left it goes again at once
        BUDGET,
        Step("retry", "refreshed", counted=False),
    ),
    ("permanent", Outcome(UpstreamRejected("no")), 0, BUDGET, Step("stop", "not_retryable")),
    (
        "retryable-with-retries",
        Outcome(_failed(), retryable=True),
        0,
        BUDGET,
        Step("retry", "backoff", wait_s=_backoff(0)),
    ),
    (
        "second-retry-backs-off-longer",
        Outcome(_failed(), retryable=True),
        1,
        BUDGET,
        Step("retry", "backoff", wait_s=_backoff(1)),
    ),
    (
        "no-retries-left",
        Outcome(_failed(), retryable=True),
        2,
        BUDGET,
        Step("stop", "no_retries_left"),
    ),
    (
        "max-retries-zero",
        Outcome(_failed(), retryable=True),
        0,
        RetryBudget(0, NOW + 60, 0.5, 8.0),
        Step("stop", "no_retries_left"),
    ),
    (
        "upstream-asked-wait",
        Outcome(_failed(), retryable=True, retry_after_s=3.0),
        0,
        BUDGET,
        Step("retry", "backoff", wait_s=3.0),
    ),
    (
        "upstream-asked-zero",
        Outcome(_failed(), retryable=True, retry_after_s=0.0),
        0,
        BUDGET,
        Step("retry", "backoff", wait_s=0.0),
    ),
    (
        "wait-past-deadline",
        Outcome(_failed(), retryable=True, retry_after_s=60.0),
        0,
        BUDGET,
        Step("stop", "deadline", wait_s=60.0),
    ),
    (
        "wait-just-inside-deadline",
        Outcome(_failed(), retryable=True, retry_after_s=59.5),
        0,
        BUDGET,
        Step("retry", "backoff", wait_s=59.5),
    ),
    (
        "deadline-already-passed",
        Outcome(_failed(), retryable=True, retry_after_s=0.0),
        0,
        RetryBudget(2, NOW, 0.5, 8.0),
        Step("stop", "deadline", wait_s=0.0),
    ),
    (
        "sent-and-lost-books-before-resend",
        Outcome(_failed(), retryable=True, retry_after_s=1.0, resend=True),
        0,
        BUDGET,
        Step("retry", "backoff", wait_s=1.0, resend=True),
    ),
    # A 2xx stream that ended before its marker: the same step however it ended.
    (
        "assembled-stream-cut-keyed",
        Outcome.stream_end(_cut(), relayed=False, safe_to_resend=True),
        0,
        RetryBudget(1, NOW + 60, 0.0, 0.0),
        Step("retry", "backoff", wait_s=0.0, resend=True),
    ),
    (
        "assembled-stream-cut-not-keyed",
        Outcome.stream_end(_cut(), relayed=False, safe_to_resend=False),
        0,
        BUDGET,
        Step("stop", "not_retryable"),
    ),
    (
        "relayed-stream-cut-keyed",
        Outcome.stream_end(_cut(), relayed=True, safe_to_resend=True),
        0,
        BUDGET,
        Step("stop", "not_retryable"),
    ),
    (
        "stream-error-event-not-retryable",
        Outcome.stream_end(_failed(retryable=False), relayed=False, safe_to_resend=True),
        0,
        BUDGET,
        Step("stop", "not_retryable"),
    ),
]


@pytest.mark.parametrize(
    ("outcome", "retries_made", "budget", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_next_step(
    outcome: Outcome, retries_made: int, budget: RetryBudget, expected: Step
) -> None:
    assert next_step(outcome, retries_made, budget, NOW, random.Random(SEED)) == expected


@pytest.mark.parametrize(
    "reason", ["no_terminal_marker", "reset", "idle_timeout", "agent_disconnected"]
)
def test_a_stream_end_is_judged_by_what_reached_the_agent_not_by_its_framing(
    reason: str,
) -> None:
    """However a stream ended early (the connection closed cleanly before the marker, a
    chunked body broke, the upstream fell silent), nothing relayed and a safe resend
    give the same retry."""
    error = StreamInterrupted("cut", details={"reason": reason})
    outcome = Outcome.stream_end(error, relayed=False, safe_to_resend=True)
    assert outcome.retryable is True
    assert outcome.resend is True
    step = next_step(outcome, 0, RetryBudget(1, NOW + 60, 0.0, 0.0), NOW, random.Random(1))
    assert step == Step("retry", "backoff", wait_s=0.0, resend=True)


def test_no_jitter_is_drawn_when_nothing_is_retried() -> None:
    """The seeded jitter of a call stays as it was: a stop draws nothing."""
    rng = random.Random(SEED)
    next_step(Outcome(_failed(), retryable=True), 2, BUDGET, NOW, rng)
    next_step(Outcome(UpstreamRejected("no")), 0, BUDGET, NOW, rng)
    assert rng.random() == random.Random(SEED).random()

"""When ``call_with_retries`` tries again (pure: no clock, no I/O).

The error contract (the sidecar's docs/api/envelope.md) is what decides: only an error
with ``retryable: true`` is retried, never OUTCOME_UNKNOWN (the call may have been
processed), and never past the caller's deadline. The wait is the sidecar's
``suggested_retry_after`` when it gave one, lengthened by up to ``jitter`` of itself (never
shortened: the hint is the earliest time the call can succeed, and agents that all
come back at that instant would meet the same wall), else exponential backoff with full
jitter, ``uniform(0, min(backoff_max_s, backoff_base_s * 2**(attempt - 1)))`` (the
AWS Architecture Blog's "Exponential Backoff And Jitter").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from egress_client.errors import EgressError
from egress_client.models import ErrorCode


@dataclass(frozen=True)
class RetryPolicy:
    """``max_attempts`` counts the first attempt; times in seconds. ``min_attempt_s`` is
    the least time left before the deadline that is worth another attempt."""

    max_attempts: int = 5
    backoff_base_s: float = 0.5
    backoff_max_s: float = 10.0
    jitter: float = 0.2
    min_attempt_s: float = 0.1

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if min(self.backoff_base_s, self.backoff_max_s, self.jitter, self.min_attempt_s) < 0:
            raise ValueError("backoff, jitter and min_attempt_s must not be negative")


def retry_wait(
    error: EgressError,
    attempt: int,
    remaining_s: float,
    policy: RetryPolicy,
    rng: random.Random,
) -> float | None:
    """Seconds to wait before attempt ``attempt + 1`` after ``error`` ended attempt
    ``attempt`` (1-based), with ``remaining_s`` left before the deadline; None means give
    up and raise ``error``."""
    if error.code == ErrorCode.OUTCOME_UNKNOWN or not error.retryable:
        return None
    if attempt >= policy.max_attempts:
        return None
    room = remaining_s - policy.min_attempt_s
    hint = error.suggested_retry_after
    if hint is not None:
        hint = max(hint, 0.0)
        if hint > room:
            return None
        return min(hint * (1.0 + rng.uniform(0.0, policy.jitter)), room)
    if room < 0:
        return None
    cap = min(policy.backoff_max_s, policy.backoff_base_s * 2.0 ** (attempt - 1), room)
    return rng.uniform(0.0, cap)

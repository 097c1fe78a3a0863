"""Retry decisions: Retry-After parsing, full-jitter backoff, what may be retried."""

from __future__ import annotations

import calendar
import random

import pytest

from gateway.call.retry import (
    MAX_RETRY_AFTER_S,
    backoff_s,
    parse_retry_after,
    status_retryable,
    transport_retryable,
)
from gateway.policy import DEFAULT_RETRY_ON
from gateway.providers import ErrorHint

# 2015-10-21 07:28:00 GMT, the example date of RFC 9110 section 5.6.7.
DATE = "Wed, 21 Oct 2015 07:28:00 GMT"
DATE_EPOCH = calendar.timegm((2015, 10, 21, 7, 28, 0))


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"retry-after": "120"}, 120.0),
        ({"retry-after": " 7 "}, 7.0),
        ({"retry-after": "0"}, 0.0),
        ({"retry-after": "1.5"}, 1.5),  # not RFC delay-seconds, but sent in practice
        ({"retry-after": "-5"}, None),  # negative: meaningless, so backoff applies
        ({"retry-after": "99999999"}, MAX_RETRY_AFTER_S),
        ({"retry-after": "inf"}, None),  # not a number of seconds: backoff applies
        ({"retry-after": "nan"}, None),
        ({"retry-after": "NaN"}, None),
        ({"retry-after": ""}, None),
        ({"retry-after": "soon"}, None),
        ({"retry-after": "0x10"}, None),
        ({"retry-after": "Wed, 99 Foo 2015 07:28:00 GMT"}, None),
        # retry-after-ms (OpenAI, Anthropic) wins over retry-after
        ({"retry-after-ms": "1500", "retry-after": "60"}, 1.5),
        ({"retry-after-ms": "250"}, 0.25),
        ({"retry-after-ms": "0", "retry-after": "60"}, 0.0),
        ({"retry-after-ms": "1e12"}, MAX_RETRY_AFTER_S),
        # an unusable retry-after-ms falls back to retry-after
        ({"retry-after-ms": "abc", "retry-after": "3"}, 3.0),
        ({"retry-after-ms": "-1", "retry-after": "3"}, 3.0),
        ({"retry-after-ms": "nan", "retry-after": "3"}, 3.0),
        ({"retry-after-ms": "nan"}, None),
    ],
)
def test_parse_retry_after(headers: dict[str, str], expected: float | None) -> None:
    assert parse_retry_after(headers, now_epoch_s=DATE_EPOCH) == expected


@pytest.mark.parametrize(
    "date",
    [
        DATE,  # IMF-fixdate
        "Wednesday, 21-Oct-15 07:28:00 GMT",  # obsolete RFC 850 format
        "Wed Oct 21 07:28:00 2015",  # obsolete asctime format: GMT though it says no zone
    ],
)
def test_http_date_in_the_future_is_the_seconds_until_then(date: str) -> None:
    headers = {"retry-after": date}
    assert parse_retry_after(headers, now_epoch_s=DATE_EPOCH - 30) == pytest.approx(30.0)


def test_http_date_in_the_past_is_zero() -> None:
    assert parse_retry_after({"retry-after": DATE}, now_epoch_s=DATE_EPOCH + 3600) == 0.0


def test_http_date_far_ahead_is_capped() -> None:
    assert parse_retry_after({"retry-after": DATE}, now_epoch_s=0.0) == MAX_RETRY_AFTER_S


def test_http_date_with_an_offset_is_honoured() -> None:
    # 07:28 at +01:00 is 06:28 GMT: an hour before DATE.
    headers = {"retry-after": "Wed, 21 Oct 2015 07:28:00 +0100"}
    assert parse_retry_after(headers, now_epoch_s=DATE_EPOCH - 3600 - 10) == pytest.approx(10.0)


# --- backoff ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("retry_number", "base_s", "cap_s", "ceiling"),
    [
        (0, 0.5, 20.0, 0.5),
        (1, 0.5, 20.0, 1.0),
        (2, 0.5, 20.0, 2.0),
        (5, 0.5, 20.0, 16.0),
        (6, 0.5, 20.0, 20.0),  # 32 s, capped
        (1000, 0.5, 20.0, 20.0),  # huge retry numbers do not overflow
        (3, 0.01, 0.05, 0.05),
    ],
)
def test_backoff_is_full_jitter_under_the_capped_exponential(
    retry_number: int, base_s: float, cap_s: float, ceiling: float
) -> None:
    rng = random.Random(1234)
    draws = [backoff_s(retry_number, base_s, cap_s, rng) for _ in range(2000)]
    assert all(0.0 <= d <= ceiling for d in draws)
    # Full jitter spreads over the whole range [0, ceiling], not just its upper half.
    assert min(draws) < 0.05 * ceiling
    assert max(draws) > 0.95 * ceiling
    assert sum(draws) / len(draws) == pytest.approx(ceiling / 2, rel=0.1)


def test_backoff_is_reproducible_with_a_seeded_random() -> None:
    first = [backoff_s(n, 0.5, 20.0, random.Random(7)) for n in range(5)]
    second = [backoff_s(n, 0.5, 20.0, random.Random(7)) for n in range(5)]
    assert first == second


def test_backoff_with_a_zero_base_never_waits() -> None:
    rng = random.Random(1)
    assert {backoff_s(n, 0.0, 20.0, rng) for n in range(10)} == {0.0}


# --- what may be retried ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (429, True),
        (500, True),
        (502, True),
        (503, True),
        (504, True),
        (529, True),
        (501, False),
        (400, False),
        (401, False),
        (404, False),
        (409, False),
        (200, False),
    ],
)
def test_status_retryable_with_the_default_retry_on(status: int, expected: bool) -> None:
    assert status_retryable(status, DEFAULT_RETRY_ON) is expected


def test_status_retryable_follows_the_policy_list() -> None:
    assert status_retryable(503, [429]) is False
    assert status_retryable(429, [429]) is True


QUOTA = ErrorHint("quota", "insufficient_quota")
RETRY = ErrorHint("retry", "x-should-retry: true")
NO_RETRY = ErrorHint("no_retry", "x-should-retry: false")
WAIT_ONLY = ErrorHint(None, "RetryInfo", retry_after_s=2.0)


@pytest.mark.parametrize(
    ("status", "retry_on", "hint", "expected"),
    [
        # the upstream's own word beats retry_on, both ways
        (429, DEFAULT_RETRY_ON, QUOTA, False),  # a quota error is never retried
        (400, DEFAULT_RETRY_ON, QUOTA, False),
        (503, DEFAULT_RETRY_ON, NO_RETRY, False),  # x-should-retry: false
        (429, DEFAULT_RETRY_ON, NO_RETRY, False),
        (409, DEFAULT_RETRY_ON, RETRY, True),  # x-should-retry: true, status not listed
        (400, (), RETRY, True),
        (503, DEFAULT_RETRY_ON, RETRY, True),
        # a hint without a verdict (only a wait) leaves it to retry_on
        (429, DEFAULT_RETRY_ON, WAIT_ONLY, True),
        (409, DEFAULT_RETRY_ON, WAIT_ONLY, False),
        (429, DEFAULT_RETRY_ON, None, True),
        (409, DEFAULT_RETRY_ON, None, False),
    ],
)
def test_status_retryable_with_the_upstreams_hint(
    status: int, retry_on: tuple[int | str, ...], hint: ErrorHint | None, expected: bool
) -> None:
    assert status_retryable(status, retry_on, hint) is expected


ALL = ("connect", "timeout")
KINDS_SENT = ("timeout", "reset")
IDEMPOTENT = ["GET", "HEAD", "PUT", "DELETE", "OPTIONS"]
NOT_IDEMPOTENT = ["POST", "PATCH"]


def case(
    kind: str,
    sent: bool,
    method: str,
    key: bool,
    retry_on: tuple[str, ...],
    expected: tuple[bool, bool],
) -> tuple[str, bool, str, bool, tuple[str, ...], tuple[bool, bool]]:
    return (kind, sent, method, key, retry_on, expected)


# design.md "Semantics": a connection never established is always safe to retry; a timeout
# or reset after sending is retried only for idempotent methods or with an idempotency key,
# otherwise the outcome is unknown. retry_on still decides whether a safe retry happens.
TRUTH_TABLE = [
    # never sent: safe for every method; retried when retry_on lists the kind
    *[case(k, False, m, False, ALL, (True, False)) for k in ("connect", "timeout", "reset")
      for m in IDEMPOTENT + NOT_IDEMPOTENT],
    case("connect", False, "POST", False, ("timeout",), (False, False)),
    case("reset", False, "POST", False, ("timeout",), (False, False)),  # reset counts as connect
    case("timeout", False, "POST", False, ("connect",), (False, False)),
    # sent, idempotent method: retried when listed, never "unknown"
    *[case(k, True, m, False, ALL, (True, False)) for k in KINDS_SENT for m in IDEMPOTENT],
    case("timeout", True, "GET", False, ("connect",), (False, False)),
    case("reset", True, "PUT", False, ("timeout",), (False, False)),
    # sent, not idempotent, no key: never retried, outcome unknown, whatever retry_on says
    *[case(k, True, m, False, ALL, (False, True)) for k in KINDS_SENT for m in NOT_IDEMPOTENT],
    case("timeout", True, "POST", False, (), (False, True)),
    # sent, not idempotent, but with an idempotency key: as safe as an idempotent method
    *[case(k, True, m, True, ALL, (True, False)) for k in KINDS_SENT for m in NOT_IDEMPOTENT],
    case("timeout", True, "POST", True, ("connect",), (False, False)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "sent", "method", "has_key", "retry_on", "expected"),
    TRUTH_TABLE,
    ids=[f"{c[0]}-{'sent' if c[1] else 'unsent'}-{c[2]}-{'key' if c[3] else 'nokey'}-"
         f"{'+'.join(c[4]) or 'none'}" for c in TRUTH_TABLE],
)  # fmt: skip
def test_transport_retryable_truth_table(
    kind: str,
    sent: bool,
    method: str,
    has_key: bool,
    retry_on: tuple[str, ...],
    expected: tuple[bool, bool],
) -> None:
    got = transport_retryable(
        kind,  # type: ignore[arg-type]
        sent=sent,
        method=method,
        has_idempotency_key=has_key,
        retry_on=retry_on,
    )
    assert got == expected

"""Provider rate-limit headers -> how long a group holds back (table-driven)."""

from __future__ import annotations

import pytest

from gateway.ratelimit.headers import provider_hold_s, retry_after_s

NOW = 1_700_000_000.0  # 2023-11-14T22:13:20Z


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"Retry-After": "7"}, 7.0),
        ({"retry-after": " 2.5 "}, 2.5),
        ({"Retry-After": "0"}, 0.0),
        ({"Retry-After": "-3"}, None),
        ({"Retry-After": "soon"}, None),
        ({"Retry-After": "Tue, 14 Nov 2023 22:13:50 GMT"}, 30.0),
        ({"Retry-After": "Tue, 14 Nov 2023 22:00:00 GMT"}, 0.0),  # in the past
        ({"retry-after-ms": "1500", "Retry-After": "2"}, 1.5),  # ms is finer: preferred
        ({"retry-after-ms": "nan", "Retry-After": "2"}, 2.0),
    ],
)
def test_retry_after(headers: dict[str, str], expected: float | None) -> None:
    got = retry_after_s(headers, NOW)
    assert got == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize(
    ("headers", "status", "expected"),
    [
        # Retry-After holds the group only on 429.
        ({"Retry-After": "3"}, 429, 3.0),
        ({"Retry-After": "3"}, 503, None),
        ({"retry-after-ms": "250"}, 429, 0.25),
        # OpenAI: remaining 0 -> reset duration; remaining > 0 -> nothing.
        ({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1s"}, 200, 1.0),
        ({"x-ratelimit-remaining-requests": "4", "x-ratelimit-reset-requests": "1s"}, 200, None),
        ({"X-RateLimit-Remaining-Tokens": "0", "X-RateLimit-Reset-Tokens": "6m0s"}, 200, 360.0),
        ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "20ms"}, 200, 0.02),
        (
            {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "1h2m3.5s"},
            200,
            3723.5,
        ),
        (
            {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "17"},
            200,
            17.0,
        ),  # Azure
        (
            {"x-ratelimit-remaining-tokens": "-1", "x-ratelimit-reset-tokens": "0"},
            200,
            None,
        ),  # Azure
        ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "6 m"}, 200, None),
        ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "5d"}, 200, None),
        ({"x-ratelimit-remaining-tokens": "0"}, 429, None),
        # The largest applicable hold wins.
        (
            {
                "Retry-After": "2",
                "x-ratelimit-remaining-requests": "0",
                "x-ratelimit-reset-requests": "500ms",
                "x-ratelimit-remaining-tokens": "0",
                "x-ratelimit-reset-tokens": "4s",
            },
            429,
            4.0,
        ),
        # Anthropic: RFC 3339 reset times.
        (
            {
                "anthropic-ratelimit-requests-remaining": "0",
                "anthropic-ratelimit-requests-reset": "2023-11-14T22:13:32Z",
            },
            200,
            12.0,
        ),
        (
            {
                "anthropic-ratelimit-output-tokens-remaining": "0",
                "anthropic-ratelimit-output-tokens-reset": "2023-11-14T23:13:21+01:00",
            },
            429,
            1.0,
        ),
        (
            {
                "anthropic-ratelimit-tokens-remaining": "0",
                "anthropic-ratelimit-tokens-reset": "2023-11-14T22:13:00Z",  # past
            },
            200,
            None,
        ),
        (
            {
                "anthropic-ratelimit-tokens-remaining": "0",
                "anthropic-ratelimit-tokens-reset": "2023-11-14T22:13:30",  # no zone
            },
            200,
            None,
        ),
        (
            {
                "anthropic-ratelimit-input-tokens-remaining": "12",
                "anthropic-ratelimit-input-tokens-reset": "2023-11-14T22:14:00Z",
            },
            200,
            None,
        ),
    ],
)
def test_provider_hold(headers: dict[str, str], status: int, expected: float | None) -> None:
    got = provider_hold_s(headers, status, NOW)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_aiohttp_header_mappings_are_read_case_insensitively_as_they_are() -> None:
    from multidict import CIMultiDict, CIMultiDictProxy

    raw = CIMultiDict(
        [("X-RateLimit-Remaining-Requests", "0"), ("X-RateLimit-Reset-Requests", "1.5s")]
    )
    raw.add("Retry-After", "7")
    for headers in (raw, CIMultiDictProxy(raw)):
        assert provider_hold_s(headers, 429, 0.0) == 7.0
        assert provider_hold_s(headers, 200, 0.0) == 1.5
        assert retry_after_s(headers, 0.0) == 7.0

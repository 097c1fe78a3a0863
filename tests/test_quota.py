"""Provider-aware retries through a real sidecar and loopback fake upstreams.

A quota or credit error is QUOTA_EXHAUSTED (HTTP 429, not retryable) and is sent once;
a plain rate limit is still retried; ``x-should-retry`` overrides the status both ways
(as the OpenAI and Anthropic SDKs obey it); a quota error does not put the rate-limit
group on hold.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from tests.conftest import compile_policy, envelope, openai_target

ANTHROPIC_KEY = "ak-fake-TEST-0002-NOTREAL"
GEMINI_KEY = "gk-fake-TEST-0004-NOTREAL"

OPENAI_QUOTA = {
    "error": {
        "message": "You exceeded your current quota, please check your plan and billing "
        "details. For more information on this error, read the docs: "
        "https://platform.openai.com/docs/guides/error-codes/api-errors.",
        "type": "insufficient_quota",
        "param": None,
        "code": "insufficient_quota",
    }
}
OPENAI_RATE_LIMIT = {
    "error": {
        "message": "Rate limit reached for gpt-4o in organization org-x on requests per min "
        "(RPM): Limit 3, Used 3, Requested 1.",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
}
COMPLETION = {
    "choices": [{"message": {"role": "assistant", "content": "pong"}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


@pytest.fixture(autouse=True)
def _provider_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ANTHROPIC_KEY", ANTHROPIC_KEY)
    monkeypatch.setenv("FAKE_GEMINI_KEY", GEMINI_KEY)


def answers(*replies: tuple[int, Any, dict[str, str]]):
    """A handler that gives ``replies`` in turn, then repeats the last one."""

    given = 0

    async def handler(_: web.Request) -> web.StreamResponse:
        nonlocal given
        given += 1
        status, body, headers = replies[min(given, len(replies)) - 1]
        return web.json_response(body, status=status, headers=headers)

    return handler


def assert_quota(status: int, answer: dict[str, Any], upstream_status: int) -> None:
    assert status == 429
    assert answer["success"] is False
    assert answer["status_code"] == upstream_status
    assert answer["error"]["code"] == "QUOTA_EXHAUSTED"
    assert answer["error"]["retryable"] is False
    assert answer["error"]["details"]["source"] == "upstream"


# -- OpenAI -------------------------------------------------------------------------------


async def test_openai_insufficient_quota_is_sent_once(upstream_factory, sidecar_factory):
    up = await upstream_factory(answers((429, OPENAI_QUOTA, {})))
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    status, answer = await sc.call(envelope(max_retries=3))
    assert up.hits == 1
    assert_quota(status, answer, 429)
    assert answer["error"]["details"]["upstream_reason"] == "insufficient_quota"
    assert answer["data"] == OPENAI_QUOTA  # the provider's own words reach the agent
    [record] = sc.audit_records()
    assert record["error_code"] == "QUOTA_EXHAUSTED"
    assert record["retryable"] is False


async def test_openai_plain_rate_limit_is_still_retried(upstream_factory, sidecar_factory):
    up = await upstream_factory(answers((429, OPENAI_RATE_LIMIT, {}), (200, COMPLETION, {})))
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    status, answer = await sc.call(envelope(max_retries=2))
    assert up.hits == 2
    assert status == 200
    assert answer["tokens_used"] == 4


async def test_openai_plain_rate_limit_after_retries_is_capacity(upstream_factory, sidecar_factory):
    up = await upstream_factory(answers((429, OPENAI_RATE_LIMIT, {})))
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    status, answer = await sc.call(envelope(max_retries=2))
    assert up.hits == 3
    assert status == 429
    assert answer["error"]["code"] == "CAPACITY_EXCEEDED"
    assert answer["error"]["retryable"] is True


async def test_quota_answer_is_not_stored_for_replay(upstream_factory, sidecar_factory):
    # Credit can be added at any moment: the same idempotency key must then go upstream.
    up = await upstream_factory(answers((429, OPENAI_QUOTA, {})))
    target = openai_target(up.url, idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    status, answer = await sc.call(envelope(idempotency_key="step-1"))
    assert_quota(status, answer, 429)
    up.handler = answers((200, COMPLETION, {}))  # someone topped up the account
    status, answer = await sc.call(envelope(idempotency_key="step-1"))
    assert status == 200
    assert up.hits == 2
    assert up.seen[0].headers["Idempotency-Key"] == up.seen[1].headers["Idempotency-Key"]


# -- x-should-retry -------------------------------------------------------------------------


async def test_should_retry_false_stops_retries_of_a_503(upstream_factory, sidecar_factory):
    failing = {"error": {"message": "The server had an error", "type": "server_error"}}
    up = await upstream_factory(answers((503, failing, {"x-should-retry": "false"})))
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    status, answer = await sc.call(envelope(max_retries=3))
    assert up.hits == 1
    assert status == 502
    assert answer["status_code"] == 503
    assert answer["error"]["code"] == "DEPENDENCY_FAILED"
    assert answer["error"]["retryable"] is False  # the upstream said retrying will not help
    assert answer["error"]["details"]["upstream_reason"] == "x-should-retry: false"


async def test_should_retry_false_on_a_429_is_quota(upstream_factory, sidecar_factory):
    up = await upstream_factory(answers((429, OPENAI_RATE_LIMIT, {"x-should-retry": "false"})))
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    status, answer = await sc.call(envelope(max_retries=3))
    assert up.hits == 1
    assert_quota(status, answer, 429)
    assert answer["error"]["details"]["upstream_reason"] == "x-should-retry: false"


async def test_should_retry_true_retries_a_409(upstream_factory, sidecar_factory):
    conflict = {"error": {"message": "lock timeout", "type": "conflict"}}
    up = await upstream_factory(
        answers((409, conflict, {"x-should-retry": "true"}), (200, COMPLETION, {}))
    )
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    status, _ = await sc.call(envelope(max_retries=2))
    assert up.hits == 2  # 409 is not in retry_on: the header alone allowed the retry
    assert status == 200


async def test_should_retry_true_is_still_bounded(upstream_factory, sidecar_factory):
    conflict = {"error": {"message": "lock timeout", "type": "conflict"}}
    up = await upstream_factory(answers((409, conflict, {"x-should-retry": "true"})))
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    status, answer = await sc.call(envelope(max_retries=2))
    assert up.hits == 3  # max_retries
    assert status == 409
    assert answer["error"]["code"] == "UPSTREAM_REJECTED"
    assert answer["error"]["details"]["upstream_reason"] == "x-should-retry: true"
    # and a target that allows no retries sends it once
    up.handler = answers((409, conflict, {"x-should-retry": "true"}))
    before = up.hits
    _, answer = await sc.call(envelope(max_retries=0, correlation_id="corr-2"))
    assert up.hits == before + 1


async def test_should_retry_applies_to_a_target_without_a_dialect(
    upstream_factory, sidecar_factory
):
    up = await upstream_factory(answers((502, {"message": "bad"}, {"x-should-retry": "false"})))
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url, usage="none")}))
    status, answer = await sc.call(envelope(max_retries=3))
    assert up.hits == 1
    assert status == 502
    assert answer["error"]["code"] == "DEPENDENCY_FAILED"
    assert answer["error"]["retryable"] is False


# -- Anthropic ------------------------------------------------------------------------------


def anthropic_target(url: str) -> dict[str, Any]:
    return {
        "base_url": url,
        "credential": {"header": "x-api-key", "default_ref": "env://FAKE_ANTHROPIC_KEY"},
        "endpoints": [{"path": "/v1/messages", "methods": ["POST"]}],
        "usage": "anthropic",
        "retry": {"backoff_base_s": 0.01, "backoff_max_s": 0.05},
    }


def anthropic_envelope(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "target_system": "fake-anthropic",
        "endpoint": "/v1/messages",
        "api_key_ref": ...,
        "max_retries": 3,
    }
    fields.update(overrides)
    return envelope(**fields)


def anthropic_error(kind: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message, **extra}}


@pytest.mark.parametrize(
    ("upstream_status", "body", "reason"),
    [
        (402, anthropic_error("billing_error", "There's an issue with your billing."),
         "billing_error"),
        (400, anthropic_error("invalid_request_error", "Your credit balance is too low to "
                              "access the Anthropic API. Please go to Plans & Billing to "
                              "upgrade or purchase credits."), "credit_balance_too_low"),
        (400, anthropic_error("invalid_request_error", "You have reached your specified API "
                              "usage limits. You will regain access on 2026-09-01 at 00:00 "
                              "UTC."), "spend_limit_reached"),
        (429, anthropic_error("rate_limit_error", "You have reached your API usage limits: "
                              "your organization has crossed its monthly API usage threshold.",
                              details={"error_code": "enforced_spend_limit_reached"}),
         "enforced_spend_limit_reached"),
    ],
)  # fmt: skip
async def test_anthropic_credit_and_spend_errors_are_quota(
    upstream_factory, sidecar_factory, upstream_status, body, reason
):
    up = await upstream_factory(answers((upstream_status, body, {})))
    sc = await sidecar_factory(compile_policy({"fake-anthropic": anthropic_target(up.url)}))
    status, answer = await sc.call(anthropic_envelope())
    assert up.hits == 1
    assert up.seen[0].headers["x-api-key"] == ANTHROPIC_KEY
    assert_quota(status, answer, upstream_status)
    assert answer["error"]["details"]["upstream_reason"] == reason
    assert ANTHROPIC_KEY not in str(answer) + sc.log.getvalue()


async def test_anthropic_rate_limit_is_still_retried(upstream_factory, sidecar_factory):
    limited = anthropic_error("rate_limit_error", "This request would exceed your account's "
                              "rate limit. Please try again later.")  # fmt: skip
    message = {"type": "message", "usage": {"input_tokens": 3, "output_tokens": 4}}
    up = await upstream_factory(answers((429, limited, {}), (200, message, {})))
    sc = await sidecar_factory(compile_policy({"fake-anthropic": anthropic_target(up.url)}))
    status, answer = await sc.call(anthropic_envelope())
    assert up.hits == 2
    assert status == 200
    assert answer["tokens_used"] == 7


# -- Gemini ---------------------------------------------------------------------------------


def gemini_target(url: str) -> dict[str, Any]:
    return {
        "base_url": url,
        "credential": {"header": "x-goog-api-key", "default_ref": "env://FAKE_GEMINI_KEY"},
        "endpoints": [{"path": "/v1beta/models/*", "methods": ["POST"]}],
        "usage": "gemini",
        "retry": {"backoff_base_s": 0.01, "backoff_max_s": 0.05},
    }


def gemini_envelope(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "target_system": "fake-gemini",
        "endpoint": "/v1beta/models/fake-model:generateContent",
        "api_key_ref": ...,
        "parameters": {"contents": [{"parts": [{"text": "ping"}]}]},
        "max_retries": 3,
        "timeout": 10,
    }
    fields.update(overrides)
    return envelope(**fields)


def gemini_exhausted(code: int, *details: dict[str, Any], message: str = "") -> dict[str, Any]:
    text = message or "You exceeded your current quota, please check your plan and billing details."
    return {
        "error": {
            "code": code,
            "message": text,
            "status": "RESOURCE_EXHAUSTED",
            "details": list(details),
        }
    }


METRIC = "generativelanguage.googleapis.com/generate_content_free_tier_requests"


def violation(quota_id: str) -> dict[str, Any]:
    return {
        "@type": "type.googleapis.com/google.rpc.QuotaFailure",
        "violations": [
            {
                "quotaMetric": METRIC,
                "quotaId": quota_id,
                "quotaDimensions": {"location": "global", "model": "fake-model"},
                "quotaValue": "200",
            }
        ],
    }


def retry_info(delay: str) -> dict[str, Any]:
    return {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}


@pytest.mark.parametrize(
    ("upstream_status", "body", "reason"),
    [
        (402, gemini_exhausted(402, message="Your prepayment credits are depleted."),
         "payment_required"),
        (429, gemini_exhausted(429, message="Your prepayment credits are depleted. Please go "
                               "to AI Studio to manage your project and billing."),
         "prepayment_credits_depleted"),
        (429, gemini_exhausted(429, violation("GenerateRequestsPerDayPerProjectPerModel-FreeTier"),
                               retry_info("20s")),
         "GenerateRequestsPerDayPerProjectPerModel-FreeTier"),
    ],
)  # fmt: skip
async def test_gemini_spent_credit_and_daily_quota_are_quota(
    upstream_factory, sidecar_factory, upstream_status, body, reason
):
    up = await upstream_factory(answers((upstream_status, body, {})))
    sc = await sidecar_factory(compile_policy({"fake-gemini": gemini_target(up.url)}))
    status, answer = await sc.call(gemini_envelope())
    assert up.hits == 1
    assert_quota(status, answer, upstream_status)
    assert answer["error"]["details"]["upstream_reason"] == reason
    assert answer["error"]["suggested_retry_after"] is None  # "20s" is not when a day resets


async def test_gemini_per_minute_limit_is_retried_after_its_retry_info(
    upstream_factory, sidecar_factory
):
    per_minute = gemini_exhausted(
        429, violation("GenerateRequestsPerMinutePerProjectPerModel-FreeTier"), retry_info("0.4s")
    )
    done = {"candidates": [], "usageMetadata": {"promptTokenCount": 2, "totalTokenCount": 5}}
    up = await upstream_factory(answers((429, per_minute, {}), (200, done, {})))
    sc = await sidecar_factory(compile_policy({"fake-gemini": gemini_target(up.url)}))
    status, answer = await sc.call(gemini_envelope())
    assert status == 200
    assert up.hits == 2
    # backoff alone would wait at most 0.05 s: the body's RetryInfo set the wait
    assert 0.4 <= up.seen[1].at - up.seen[0].at <= 2.5
    assert answer["tokens_used"] == 5


async def test_gemini_retry_info_beyond_the_deadline_is_suggested(
    upstream_factory, sidecar_factory
):
    per_minute = gemini_exhausted(
        429, violation("GenerateRequestsPerMinutePerProjectPerModel-FreeTier"), retry_info("37s")
    )
    up = await upstream_factory(answers((429, per_minute, {})))
    sc = await sidecar_factory(compile_policy({"fake-gemini": gemini_target(up.url)}))
    status, answer = await sc.call(gemini_envelope(timeout=5))
    assert up.hits == 1
    assert status == 429
    assert answer["error"]["code"] == "CAPACITY_EXCEEDED"
    assert answer["error"]["retryable"] is True
    assert answer["error"]["suggested_retry_after"] == 37


# -- the rate-limit group -------------------------------------------------------------------


async def _group_of_two(upstream_factory, sidecar_factory, first_answer: Any, code: str):
    """Target a answers ``first_answer`` with long Retry-After and reset headers; then a
    call to target b of the same group. Returns b's upstream, b's answer and the seconds
    b's call waited in the group (the limiter's own count: 0.0 when admitted at once)."""
    headers = {
        "retry-after": "3600",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "24h0m0s",
    }
    a = await upstream_factory(answers((429, first_answer, headers)))
    b = await upstream_factory(answers((200, COMPLETION, {})))
    policy = compile_policy(
        {
            "fake-openai": openai_target(a.url, rate_limit_group="llm"),
            "other-openai": openai_target(b.url, rate_limit_group="llm"),
        },
        rate_limit_groups={"llm": {"requests_per_second": 50, "burst": 10, "max_queue_s": 1}},
    )
    sc = await sidecar_factory(policy)
    _, answer = await sc.call(envelope(max_retries=0))
    assert a.hits == 1
    assert answer["error"]["code"] == code
    _, other = await sc.call(envelope(target_system="other-openai", correlation_id="corr-b"))
    return b, other, sc.audit_records()[-1]["rate_limit_wait_ms"]


async def test_quota_error_does_not_hold_the_group(upstream_factory, sidecar_factory):
    b, other, waited_ms = await _group_of_two(
        upstream_factory, sidecar_factory, OPENAI_QUOTA, "QUOTA_EXHAUSTED"
    )
    assert other["success"] is True
    assert b.hits == 1
    assert waited_ms == 0  # no wait for a hold: admitted at once


async def test_plain_rate_limit_holds_the_group(upstream_factory, sidecar_factory):
    # The control: the same headers on a rate limit do hold every target of the group.
    b, other, _ = await _group_of_two(
        upstream_factory, sidecar_factory, OPENAI_RATE_LIMIT, "CAPACITY_EXCEEDED"
    )
    assert b.hits == 0
    assert other["error"]["code"] == "CAPACITY_EXCEEDED"
    assert other["error"]["details"]["reason"] == "provider_hold"

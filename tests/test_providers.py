"""Provider error hints: what an error answer says about retrying it (table-driven, pure).

The bodies are the providers' documented shapes (sources in each dialect's docstring).
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.providers import DIALECTS, ErrorHint, error_hint
from gateway.providers.base import error_object, should_retry_header


def openai_error(message: str, type_: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def anthropic_error(type_: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"type": "error", "error": {"type": type_, "message": message, **extra}}


def gemini_error(code: int, message: str, *details: dict[str, Any]) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message, "status": "RESOURCE_EXHAUSTED"}
    if details:
        error["details"] = list(details)
    return {"error": error}


METRIC = "generativelanguage.googleapis.com/generate_content_free_tier_requests"


def quota_failure(*quota_ids: str) -> dict[str, Any]:
    return {
        "@type": "type.googleapis.com/google.rpc.QuotaFailure",
        "violations": [
            {
                "quotaMetric": METRIC,
                "quotaId": quota_id,
                "quotaValue": "10",
            }
            for quota_id in quota_ids
        ],
    }


def retry_info(delay: Any) -> dict[str, Any]:
    return {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}


GEMINI_QUOTA = "You exceeded your current quota, please check your plan and billing details."
PER_MINUTE = "GenerateRequestsPerMinutePerProjectPerModel-FreeTier"
PER_DAY = "GenerateRequestsPerDayPerProjectPerModel-FreeTier"
OPENAI_QUOTA = "You exceeded your current quota, please check your plan and billing details."


def q(reason: str) -> ErrorHint:
    return ErrorHint("quota", reason)


OPENAI_CASES = [
    # the classic shape: type and code both insufficient_quota
    (429, openai_error(OPENAI_QUOTA, "insufficient_quota", "insufficient_quota"),
     q("insufficient_quota")),
    (429, openai_error(OPENAI_QUOTA, "insufficient_quota", None), q("insufficient_quota")),
    # finer codes under the broad type: the code is reported
    (429, openai_error("no credits", "insufficient_quota", "credit_balance_exhausted"),
     q("credit_balance_exhausted")),
    (429, openai_error("x", "insufficient_quota", "organization_spend_limit_exceeded"),
     q("organization_spend_limit_exceeded")),
    (429, openai_error("x", "insufficient_quota", "project_spend_limit_exceeded"),
     q("project_spend_limit_exceeded")),
    (429, openai_error("x", "insufficient_quota", "organization_usage_limit_exceeded"),
     q("organization_usage_limit_exceeded")),
    (429, openai_error("Your account is not active", "billing_not_active", "billing_not_active"),
     q("billing_not_active")),
    (400, openai_error("Billing hard limit has been reached", "invalid_request_error",
                       "billing_hard_limit_reached"), q("billing_hard_limit_reached")),
    # plain rate limits are not quota: the status decides (retried)
    (429, openai_error("Rate limit reached for requests", "requests", "rate_limit_exceeded"),
     None),
    (429, openai_error("Rate limit reached for tokens", "tokens", "rate_limit_exceeded"), None),
    (429, {"error": "slow down"}, None),
    (429, None, None),
    (429, ["not", "an", "object"], None),
    # a quota word on a non-4xx is not read
    (500, openai_error("x", "insufficient_quota", "insufficient_quota"), None),
    (400, openai_error("bad", "invalid_request_error", "invalid_value"), None),
    (429, {"error": {"type": ["insufficient_quota"], "code": 5}}, None),  # odd types
]  # fmt: skip


@pytest.mark.parametrize(("status", "body", "expected"), OPENAI_CASES)
def test_openai_error_hint(status: int, body: Any, expected: ErrorHint | None) -> None:
    assert DIALECTS["openai"].error_hint(status, {}, body) == expected


ANTHROPIC_CASES = [
    (402, anthropic_error("billing_error", "There's an issue with your billing"),
     q("billing_error")),
    (402, None, q("billing_error")),  # 402 is Payment Required, whatever the body
    (400, anthropic_error("invalid_request_error", "Your credit balance is too low to access "
                          "the Anthropic API. Please go to Plans & Billing to upgrade or "
                          "purchase credits."), q("credit_balance_too_low")),
    (400, anthropic_error("invalid_request_error", "You have reached your specified API usage "
                          "limits. You will regain access on 2026-09-01 at 00:00 UTC."),
     q("spend_limit_reached")),
    (400, anthropic_error("invalid_request_error", "You have reached your specified workspace "
                          "API usage limits."), q("spend_limit_reached")),
    # the usage tier's monthly spend cap: a 429 rate_limit_error with a code
    (429, anthropic_error("rate_limit_error", "You have reached your API usage limits: your "
                          "organization has crossed its monthly API usage threshold.",
                          details={"error_code": "enforced_spend_limit_reached"}),
     q("enforced_spend_limit_reached")),
    (429, anthropic_error("rate_limit_error", "You have reached your API usage limits: ..."),
     q("enforced_spend_limit_reached")),
    # plain rate limits, overload and other rejections are not quota
    (429, anthropic_error("rate_limit_error", "This request would exceed your account's rate "
                          "limit. Please try again later."), None),
    (529, anthropic_error("overloaded_error", "Overloaded"), None),
    (400, anthropic_error("invalid_request_error", "max_tokens: Field required"), None),
    (400, anthropic_error("invalid_request_error", "Your prompt mentions your credit balance "
                          "is too low"), None),  # only the beginning counts
    (404, anthropic_error("not_found_error", "model: claude-x"), None),
    (429, {"error": {"type": "rate_limit_error", "details": "enforced_spend_limit_reached"}},
     None),  # details not an object
    (400, None, None),
]  # fmt: skip


@pytest.mark.parametrize(("status", "body", "expected"), ANTHROPIC_CASES)
def test_anthropic_error_hint(status: int, body: Any, expected: ErrorHint | None) -> None:
    assert DIALECTS["anthropic"].error_hint(status, {}, body) == expected


GEMINI_CASES = [
    # prepay credit depleted: 402 now, 429 before
    (402, gemini_error(402, "Your prepayment credits are depleted."), q("payment_required")),
    (402, None, q("payment_required")),
    (429, gemini_error(429, "Your prepayment credits are depleted. Please go to AI Studio"),
     q("prepayment_credits_depleted")),
    # a daily quota is spent: quota, whatever RetryInfo says
    (429, gemini_error(429, GEMINI_QUOTA, quota_failure(PER_DAY), retry_info("20s")), q(PER_DAY)),
    (429, gemini_error(429, GEMINI_QUOTA, quota_failure(PER_MINUTE, PER_DAY)), q(PER_DAY)),
    (429, gemini_error(429, GEMINI_QUOTA, quota_failure("RequestsDailyPerProject")),
     q("RequestsDailyPerProject")),
    (429, [gemini_error(429, GEMINI_QUOTA, quota_failure(PER_DAY))], q(PER_DAY)),  # JSON array
    (429, gemini_error(429, "credits", {"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                                        "reason": "INSUFFICIENT_G1_CREDITS_BALANCE"}),
     q("INSUFFICIENT_G1_CREDITS_BALANCE")),
    # per-minute limits are rate limits: retried, after RetryInfo's wait when it names one
    (429, gemini_error(429, GEMINI_QUOTA, quota_failure(PER_MINUTE), retry_info("37s")),
     ErrorHint(None, "RetryInfo", retry_after_s=37.0)),
    (429, gemini_error(429, GEMINI_QUOTA, retry_info("1.5s")),
     ErrorHint(None, "RetryInfo", retry_after_s=1.5)),
    (503, gemini_error(503, "overloaded", retry_info("900ms")),
     ErrorHint(None, "RetryInfo", retry_after_s=0.9)),
    (429, gemini_error(429, GEMINI_QUOTA, quota_failure(PER_MINUTE)), None),
    (429, gemini_error(429, "Resource exhausted. Please try again later."), None),  # Vertex AI
    (429, gemini_error(429, GEMINI_QUOTA, retry_info("soon")), None),
    (429, gemini_error(429, GEMINI_QUOTA, retry_info(37)), None),
    (429, gemini_error(429, GEMINI_QUOTA, retry_info("-3s")), None),
    (429, gemini_error(429, GEMINI_QUOTA, {"@type": "other.QuotaFailure",
                                           "violations": [{"quotaId": PER_DAY}]}), None),
    (429, {"error": {"code": 429, "details": "PerDay"}}, None),
    (400, gemini_error(400, "API key not valid"), None),
]  # fmt: skip


@pytest.mark.parametrize(("status", "body", "expected"), GEMINI_CASES)
def test_gemini_error_hint(status: int, body: Any, expected: ErrorHint | None) -> None:
    assert DIALECTS["gemini"].error_hint(status, {}, body) == expected


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"x-should-retry": "true"}, True),
        ({"x-should-retry": "false"}, False),
        ({"x-should-retry": " false "}, False),  # field values carry no surrounding space
        ({"x-should-retry": "True"}, None),  # the SDKs compare exactly
        ({"x-should-retry": "1"}, None),
        ({"x-should-retry": ""}, None),
    ],
)
def test_should_retry_header(headers: dict[str, str], expected: bool | None) -> None:
    assert should_retry_header(headers) is expected


PLAIN_429 = openai_error("Rate limit reached", "requests", "rate_limit_exceeded")
QUOTA_429 = openai_error(OPENAI_QUOTA, "insufficient_quota", "insufficient_quota")

COMBINED = [
    # x-should-retry applies to every dialect, "none" included, in any header case
    ("none", 503, {"x-should-retry": "false"}, None,
     ErrorHint("no_retry", "x-should-retry: false")),
    ("openai", 503, {"X-Should-Retry": "false"}, None,
     ErrorHint("no_retry", "x-should-retry: false")),
    ("anthropic", 409, {"x-should-retry": "true"}, None,
     ErrorHint("retry", "x-should-retry: true")),
    ("none", 400, {"x-should-retry": "true"}, None, ErrorHint("retry", "x-should-retry: true")),
    # false on a 429 is quota (design.md, "New codes")
    ("openai", 429, {"x-should-retry": "false"}, PLAIN_429, q("x-should-retry: false")),
    ("none", 429, {"x-should-retry": "false"}, None, q("x-should-retry: false")),
    # the body's quota wins over a header that allows a retry
    ("openai", 429, {"x-should-retry": "true"}, QUOTA_429, q("insufficient_quota")),
    # a RetryInfo wait is kept when the header allows a retry
    ("gemini", 400, {"x-should-retry": "true"}, gemini_error(400, "x", retry_info("2s")),
     ErrorHint("retry", "x-should-retry: true", retry_after_s=2.0)),
    # without the header, only the dialect speaks; unknown dialects read nothing else
    ("openai", 429, {}, PLAIN_429, None),
    ("openai", 429, {}, QUOTA_429, q("insufficient_quota")),
    ("none", 429, {}, QUOTA_429, None),  # a target with usage: none has no dialect
    ("none", 402, {}, None, None),  # Stripe's 402 is a declined card, not quota
    ("anthropic", 429, {"x-should-retry": "maybe"}, None, None),
]  # fmt: skip


@pytest.mark.parametrize(("provider", "status", "headers", "body", "expected"), COMBINED)
def test_error_hint_combines_dialect_and_header(
    provider: str, status: int, headers: dict[str, str], body: Any, expected: ErrorHint | None
) -> None:
    assert error_hint(provider, status, headers, body) == expected


def test_error_object_shapes() -> None:
    assert error_object({"error": {"type": "x"}}) == {"type": "x"}
    assert error_object([{"error": {"type": "x"}}]) == {"type": "x"}
    assert error_object({"error": "x"}) is None
    assert error_object([]) is None
    assert error_object("error") is None

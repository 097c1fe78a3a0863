"""Metrics: the rendered exposition, parsed back with prometheus-client's own parsers."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from gateway.envelope import ErrorCode
from gateway.metrics import UNKNOWN_LABEL, Metrics

CANARY = "sk-canary-7f3a9c"


def samples(m: Metrics) -> list[tuple[str, dict[str, str], float]]:
    body, _ = m.render()
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    ]


def value(m: Metrics, name: str, **labels: str) -> float | None:
    found = [v for n, lab, v in samples(m) if n == name and lab == labels]
    assert len(found) <= 1, found
    return found[0] if found else None


def series(m: Metrics, name: str) -> list[dict[str, str]]:
    return [lab for n, lab, _ in samples(m) if n == name]


@pytest.fixture
def m() -> Metrics:
    metrics = Metrics()
    metrics.set_known(targets=["openai", "slack"], groups=["llm"])
    return metrics


def test_call_counts_and_latency_histograms(m: Metrics) -> None:
    m.observe_call("openai", "success", None, latency_s=0.3, upstream_latency_s=0.2)
    m.observe_call("openai", "success", None, latency_s=0.7, upstream_latency_s=0.6)
    m.observe_call("openai", "error", ErrorCode.CIRCUIT_OPEN, latency_s=0.001)

    assert (
        value(m, "egress_gateway_calls_total", target="openai", outcome="success", code="OK") == 2
    )
    assert (
        value(
            m, "egress_gateway_calls_total", target="openai", outcome="error", code="CIRCUIT_OPEN"
        )
        == 1
    )
    hist = "egress_gateway_call_duration_seconds"
    assert value(m, f"{hist}_count", target="openai") == 3
    assert value(m, f"{hist}_sum", target="openai") == pytest.approx(1.001)
    assert value(m, f"{hist}_bucket", target="openai", le="0.5") == 2
    assert value(m, f"{hist}_bucket", target="openai", le="+Inf") == 3
    # The refused call sent nothing upstream, so only two upstream observations.
    assert value(m, "egress_gateway_upstream_duration_seconds_count", target="openai") == 2
    assert value(m, "egress_gateway_upstream_duration_seconds_sum", target="openai") == (
        pytest.approx(0.8)
    )


def test_unknown_names_are_bucketed_and_never_rendered(m: Metrics) -> None:
    # An envelope can name any target or group: none of it may become a label value.
    m.observe_call(CANARY, "error", ErrorCode.PERMISSION_DENIED, latency_s=0.01)
    m.observe_call(f"{CANARY}-2", "error", ErrorCode.PERMISSION_DENIED, latency_s=0.01)
    m.observe_retry(CANARY)
    m.observe_tokens(CANARY, input_tokens=5)
    m.observe_ratelimit_wait(CANARY, 0.1)
    m.observe_ratelimit_rejection(CANARY)
    m.observe_call("openai", CANARY, CANARY, latency_s=0.01)  # type: ignore[arg-type]
    m.observe_secret_cache(CANARY)  # type: ignore[arg-type]

    body, _ = m.render()
    assert CANARY not in body.decode()
    assert (
        value(
            m,
            "egress_gateway_calls_total",
            target=UNKNOWN_LABEL,
            outcome="error",
            code="PERMISSION_DENIED",
        )
        == 2
    )
    assert (
        value(
            m,
            "egress_gateway_calls_total",
            target="openai",
            outcome=UNKNOWN_LABEL,
            code=UNKNOWN_LABEL,
        )
        == 1
    )
    assert value(m, "egress_gateway_retries_total", target=UNKNOWN_LABEL) == 1
    assert value(m, "egress_gateway_ratelimit_rejections_total", group=UNKNOWN_LABEL) == 1
    assert value(m, "egress_gateway_ratelimit_wait_seconds_count", group=UNKNOWN_LABEL) == 1
    assert value(m, "egress_gateway_secret_cache_total", result=UNKNOWN_LABEL) == 1


def test_tokens_by_kind_skip_missing_counts(m: Metrics) -> None:
    m.observe_tokens("openai", input_tokens=100, output_tokens=20, cached_tokens=64)
    m.observe_tokens("openai", input_tokens=50, output_tokens=None)
    m.observe_tokens("slack")

    name = "egress_gateway_tokens_total"
    assert value(m, name, target="openai", kind="input") == 150
    assert value(m, name, target="openai", kind="output") == 20
    assert value(m, name, target="openai", kind="cached") == 64
    assert {lab["target"] for lab in series(m, name)} == {"openai"}


def test_retries_and_rate_limit_group_series(m: Metrics) -> None:
    m.observe_retry("openai")
    m.observe_retry("openai")
    m.observe_ratelimit_wait("llm", 0.02)
    m.observe_ratelimit_wait("llm", 2.0)
    m.observe_ratelimit_rejection("llm")

    assert value(m, "egress_gateway_retries_total", target="openai") == 2
    wait = "egress_gateway_ratelimit_wait_seconds"
    assert value(m, f"{wait}_count", group="llm") == 2
    assert value(m, f"{wait}_bucket", group="llm", le="0.05") == 1
    assert value(m, f"{wait}_sum", group="llm") == pytest.approx(2.02)
    assert value(m, "egress_gateway_ratelimit_rejections_total", group="llm") == 1


def test_breaker_state_gauge_follows_transitions_and_policy(m: Metrics) -> None:
    gauge = "egress_gateway_breaker_state"
    # Known targets start closed so a dashboard shows them before the first failure.
    assert value(m, gauge, target="openai") == 0
    assert value(m, gauge, target="slack") == 0

    m.observe_breaker_transition("openai", "open")
    assert value(m, gauge, target="openai") == 2
    m.observe_breaker_transition("openai", "half_open")
    assert value(m, gauge, target="openai") == 1
    m.observe_breaker_transition("openai", "closed")
    m.observe_breaker_transition("openai", "open")
    assert value(m, gauge, target="openai") == 2
    transitions = "egress_gateway_breaker_transitions_total"
    assert value(m, transitions, target="openai", to="open") == 2
    assert value(m, transitions, target="openai", to="half-open") == 1
    assert value(m, transitions, target="openai", to="closed") == 1

    # A reload that drops slack and adds github: slack's gauge goes, counters stay.
    m.observe_call("slack", "success", None, latency_s=0.1)
    m.set_known(targets=["openai", "github"], groups=["llm"])
    assert {lab["target"] for lab in series(m, gauge)} == {"openai", "github"}
    assert value(m, gauge, target="openai") == 2  # unchanged target keeps its state
    assert value(m, "egress_gateway_calls_total", target="slack", outcome="success", code="OK") == 1
    m.observe_retry("slack")
    assert value(m, "egress_gateway_retries_total", target=UNKNOWN_LABEL) == 1


def test_secret_cache_and_policy_reloads(m: Metrics) -> None:
    for result in ("hit", "hit", "miss", "stale"):
        m.observe_secret_cache(result)  # type: ignore[arg-type]
    m.observe_policy_reload(ok=True)
    m.observe_policy_reload(ok=False)
    m.observe_policy_reload(ok=False)

    assert value(m, "egress_gateway_secret_cache_total", result="hit") == 2
    assert value(m, "egress_gateway_secret_cache_total", result="miss") == 1
    assert value(m, "egress_gateway_secret_cache_total", result="stale") == 1
    assert value(m, "egress_gateway_policy_reloads_total", result="ok") == 1
    assert value(m, "egress_gateway_policy_reloads_total", result="error") == 2


def test_registries_are_isolated_from_each_other_and_the_global_one() -> None:
    a, b = Metrics(), Metrics()
    a.set_known(["openai"], [])
    b.set_known(["openai"], [])
    a.observe_retry("openai")

    assert value(a, "egress_gateway_retries_total", target="openai") == 1
    assert value(b, "egress_gateway_retries_total", target="openai") is None
    assert not [n for n in REGISTRY._names_to_collectors if n.startswith("egress_gateway")]


@pytest.mark.parametrize(
    ("accept", "content_type"),
    [
        (None, "text/plain; version=0.0.4; charset=utf-8"),
        ("text/plain", "text/plain; version=0.0.4; charset=utf-8"),
        ("application/openmetrics-text; version=1.0.0", "application/openmetrics-text"),
    ],
)
def test_render_negotiates_the_format(m: Metrics, accept: str | None, content_type: str) -> None:
    m.observe_call("openai", "replay", None, latency_s=0.01)
    body, ctype = m.render(accept)

    assert ctype.startswith(content_type)
    text = body.decode()
    parse: Any = (
        openmetrics_families
        if content_type.startswith("application/")
        else (text_string_to_metric_families)
    )
    families = {f.name: f for f in parse(text)}
    calls = families["egress_gateway_calls"]
    assert calls.type == "counter"
    assert [
        s.value
        for s in calls.samples
        if s.name == "egress_gateway_calls_total" and s.labels["outcome"] == "replay"
    ] == [1]

"""Metrics: the rendered exposition, parsed back with prometheus-client's own parsers."""

from __future__ import annotations

import platform
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import REGISTRY
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

import gateway
from gateway.envelope import ErrorCode
from gateway.metrics import MAX_PREFIXED_MODELS, UNKNOWN_LABEL, Metrics
from tests.conftest import compile_policy, envelope, openai_target

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
    assert value(b, "egress_gateway_retries_total", target="openai") == 0  # known: starts at 0
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


# --- the GenAI client metrics, standard collectors, info gauges ----------------------------


def test_genai_metrics_carry_semconv_labels_and_bounded_models(m: Metrics) -> None:
    m.set_known(["openai"], ["llm"], models=["gpt-4o-mini", "claude-*"])
    m.observe_genai(
        "chat", "openai", "gpt-4o-mini", "gpt-4o-mini-2024-07-18",
        duration_s=0.3, input_tokens=120, output_tokens=7,
    )  # fmt: skip
    m.observe_genai("chat", "anthropic", "claude-3-haiku", None, duration_s=1.0, output_tokens=3)
    m.observe_genai("chat", "openai", CANARY, CANARY, duration_s=0.1, error_type="AGENT_TIMEOUT")
    m.observe_genai("chat", "openai", None, None, duration_s=0.1, first_chunk_s=0.05)

    usage = "gen_ai_client_token_usage"
    labels = {
        "gen_ai_operation_name": "chat",
        "gen_ai_provider_name": "openai",
        "gen_ai_request_model": "gpt-4o-mini",
        # A dated snapshot the policy does not list is bucketed, the listed name is kept.
        "gen_ai_response_model": "_other",
    }
    assert value(m, f"{usage}_sum", **labels, gen_ai_token_type="input") == 120
    assert value(m, f"{usage}_count", **labels, gen_ai_token_type="output") == 1
    assert value(m, f"{usage}_bucket", **labels, gen_ai_token_type="input", le="256.0") == 1
    assert value(m, f"{usage}_bucket", **labels, gen_ai_token_type="input", le="64.0") == 0
    claude = {**labels, "gen_ai_provider_name": "anthropic"}
    claude |= {"gen_ai_request_model": "claude-3-haiku", "gen_ai_response_model": "_none"}
    assert value(m, f"{usage}_sum", **claude, gen_ai_token_type="output") == 3
    assert value(m, f"{usage}_count", **claude, gen_ai_token_type="input") is None  # unknown

    duration = "gen_ai_client_operation_duration_seconds"
    failed = {**labels, "gen_ai_request_model": "_other", "error_type": "AGENT_TIMEOUT"}
    assert value(m, f"{duration}_count", **failed) == 1
    assert value(m, f"{duration}_count", **labels, error_type="") == 1
    first = "gen_ai_client_operation_time_to_first_chunk_seconds"
    nomodel = {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "openai"}
    assert value(m, f"{first}_count", **nomodel, gen_ai_request_model="_none") == 1
    assert CANARY not in m.render()[0].decode()


def test_a_prefix_admits_a_bounded_number_of_models(m: Metrics) -> None:
    m.set_known(["openai"], [], models=["gpt-*"])
    for i in range(MAX_PREFIXED_MODELS + 5):
        m.observe_genai("chat", "openai", f"gpt-{i}", None, duration_s=0.1)
    m.observe_genai("chat", "openai", "gpt-0", None, duration_s=0.1)  # seen: still its own
    models = {
        lab["gen_ai_request_model"]
        for lab in series(m, "gen_ai_client_operation_duration_seconds_count")
    }
    assert len(models) == MAX_PREFIXED_MODELS + 1
    assert "_other" in models
    assert "gpt-0" in models


def test_no_created_series_and_the_standard_collectors(m: Metrics) -> None:
    m.observe_call("openai", "success", None, latency_s=0.1)
    m.observe_genai("chat", "openai", None, None, duration_s=0.1, input_tokens=1)
    names = {n for n, _, _ in samples(m)}
    assert not [n for n in names if n.endswith("_created")]
    assert {"process_resident_memory_bytes", "process_start_time_seconds"} <= names
    assert {"python_info", "python_gc_objects_collected_total"} <= names


def test_build_and_policy_info(m: Metrics) -> None:
    assert value(
        m, "egress_gateway_build_info", version=gateway.__version__,
        python=platform.python_version(),
    ) == 1  # fmt: skip
    m.set_known(["openai"], [], agent_id="planner-01", digest="abc123")
    assert value(m, "egress_gateway_policy_info", agent_id="planner-01", digest="abc123") == 1
    m.set_known(["openai"], [], agent_id="planner-01", digest="def456")  # a reload
    assert series(m, "egress_gateway_policy_info") == [
        {"agent_id": "planner-01", "digest": "def456"}
    ]


async def test_a_model_call_feeds_the_genai_metrics(
    sidecar_factory: Any, upstream_factory: Any
) -> None:
    async def answer(_: web.Request) -> web.StreamResponse:
        return web.json_response(
            {
                "model": "fake-model-1-0613",
                "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
            }
        )

    upstream = await upstream_factory(answer)
    policy = compile_policy(
        {"fake-openai": openai_target(upstream.url)},
        telemetry={"models": ["fake-model-1", "fake-model-1-*"]},
    )
    sidecar = await sidecar_factory(policy)
    assert (await sidecar.call(envelope()))[0] == 200
    assert (await sidecar.call(envelope(endpoint="/v1/models/x", method="GET")))[0] == 200
    m = sidecar.gateway.metrics
    labels = {
        "gen_ai_operation_name": "chat",
        "gen_ai_provider_name": "openai",
        "gen_ai_request_model": "fake-model-1",
        "gen_ai_response_model": "fake-model-1-0613",
    }
    assert value(m, "gen_ai_client_token_usage_sum", **labels, gen_ai_token_type="input") == 9
    assert value(m, "gen_ai_client_token_usage_sum", **labels, gen_ai_token_type="output") == 4
    # GET /v1/models is no model call: one operation only.
    assert value(m, "gen_ai_client_operation_duration_seconds_count", **labels, error_type="") == 1
    (info,) = series(m, "egress_gateway_policy_info")
    assert info["agent_id"] == "test-agent"
    assert len(info["digest"]) == 16


def test_known_label_values_start_at_zero(m: Metrics) -> None:
    # rate() and alerts need a series before the first event.
    assert value(m, "egress_gateway_ratelimit_rejections_total", group="llm") == 0
    assert value(m, "egress_gateway_retries_total", target="slack") == 0
    assert value(m, "egress_gateway_secret_cache_total", result="stale") == 0
    assert value(m, "egress_gateway_policy_reloads_total", result="error") == 0
    assert value(m, "egress_gateway_audit_write_failures_total") == 0
    assert value(m, "egress_gateway_secrets_ready") == 1


async def test_audit_write_failures_are_counted(
    sidecar_factory: Any, upstream: Any, tmp_path: Any
) -> None:
    # /dev/full opens, and every write to it fails with ENOSPC: a full disk.
    policy = compile_policy(
        {"fake-openai": openai_target(upstream.url)}, audit={"sink": "file", "path": "/dev/full"}
    )
    sidecar = await sidecar_factory(policy)
    for _ in range(3):
        assert (await sidecar.call(envelope()))[0] == 200
    # The start record (policy_start) and the three calls.
    assert value(sidecar.gateway.metrics, "egress_gateway_audit_write_failures_total") == 4
    assert value(sidecar.gateway.metrics, "egress_gateway_secrets_ready") == 1

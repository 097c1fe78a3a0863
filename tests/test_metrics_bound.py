"""Metrics looked up by the names a call gives (bound once, not mapped on every call)
still label every observation as the policy in force says, and stay bounded.

The exposition is parsed back with prometheus-client's own parser.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway import metrics as metrics_module
from gateway.metrics import NO_MODEL, OTHER_MODEL, UNKNOWN_LABEL, Metrics


def samples(m: Metrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    body, _ = m.render()
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
        if s.name == name
    }


def genai_count(m: Metrics, request_model: str, response_model: str) -> float | None:
    found = samples(m, "gen_ai_client_operation_duration_seconds_count")
    key = (
        ("error_type", ""),
        ("gen_ai_operation_name", "chat"),
        ("gen_ai_provider_name", "openai"),
        ("gen_ai_request_model", request_model),
        ("gen_ai_response_model", response_model),
    )
    return found.get(key)


def call(m: Metrics, request_model: str | None, response_model: str | None, **kw: int) -> None:
    m.observe_genai(
        "chat",
        "openai",
        request_model,
        response_model,
        duration_s=0.2,
        input_tokens=kw.get("inp"),
        output_tokens=kw.get("out"),
    )


def test_genai_labels_follow_the_models_of_the_policy_in_force() -> None:
    m = Metrics()
    m.set_known(["openai"], [])
    call(m, "gpt-4o-mini", "gpt-4o-mini-2024-07-18", inp=10, out=2)
    call(m, "gpt-4o-mini", "gpt-4o-mini-2024-07-18", inp=10, out=2)
    assert genai_count(m, OTHER_MODEL, OTHER_MODEL) == 2
    m.set_known(["openai"], [], models=["gpt-4o-mini", "gpt-4o-mini-*"])  # a reload
    call(m, "gpt-4o-mini", "gpt-4o-mini-2024-07-18", inp=10, out=2)
    assert genai_count(m, "gpt-4o-mini", "gpt-4o-mini-2024-07-18") == 1
    assert genai_count(m, OTHER_MODEL, OTHER_MODEL) == 2  # the old series keep their counts
    call(m, None, None)
    assert genai_count(m, NO_MODEL, NO_MODEL) == 1
    tokens = samples(m, "gen_ai_client_token_usage_count")
    assert sorted(v for k, v in tokens.items() if ("gen_ai_token_type", "input") in k) == [1, 2]
    # No token series for label values that never had a count.
    assert not [k for k in tokens if ("gen_ai_request_model", NO_MODEL) in k]


def test_two_names_with_one_label_share_their_series() -> None:
    m = Metrics()
    m.set_known(["openai"], [])
    call(m, "model-a", "model-a-1", inp=3)
    call(m, "model-b", "model-b-1", out=4)
    assert genai_count(m, OTHER_MODEL, OTHER_MODEL) == 2
    tokens = samples(m, "gen_ai_client_token_usage_count")
    assert sorted(tokens.values()) == [1, 1]  # one input and one output observation


def test_named_lookups_stay_bounded() -> None:
    m = Metrics()
    m.set_known(["openai"], [], models=["m-*"])
    for i in range(metrics_module._MAX_NAMED + 50):
        call(m, f"agent-model-{i}", f"answer-{i}", inp=1)
        m.observe_cost("openai", f"agent-model-{i}", 0.001)
    assert len(m._per_named) <= metrics_module._MAX_NAMED
    assert len(m._cost_by_named) <= metrics_module._MAX_NAMED
    assert genai_count(m, OTHER_MODEL, OTHER_MODEL) == metrics_module._MAX_NAMED + 50


def test_token_counters_by_target_follow_the_policy() -> None:
    m = Metrics()
    m.set_known(["openai"], [])
    m.observe_tokens("openai", 10, 2, 0)
    m.observe_tokens("github", 5, None, None)  # not (yet) a policy target
    found = samples(m, "egress_gateway_tokens_total")
    assert found == {
        (("kind", "input"), ("target", "openai")): 10,
        (("kind", "output"), ("target", "openai")): 2,
        (("kind", "input"), ("target", UNKNOWN_LABEL)): 5,
    }  # no "cached" series before a count above 0
    m.observe_tokens("openai", None, None, 7)
    m.set_known(["openai", "github"], [])
    m.observe_tokens("github", 1, None, None)
    found = samples(m, "egress_gateway_tokens_total")
    assert found[(("kind", "cached"), ("target", "openai"))] == 7
    assert found[(("kind", "input"), ("target", "github"))] == 1
    assert found[(("kind", "input"), ("target", UNKNOWN_LABEL))] == 5


def test_wait_histogram_and_cost_counter_follow_the_policy() -> None:
    m = Metrics()
    m.set_known(["openai"], ["llm"], models=["gpt-4o-mini"])
    m.observe_ratelimit_wait("llm", 0.002)
    m.observe_ratelimit_wait("batch", 0.5)
    m.observe_cost("openai", "gpt-4o-mini", 0.25)
    m.observe_cost("slack", "gpt-4o-mini", 0.5)
    m.set_known(["openai", "slack"], ["llm", "batch"], models=[])
    m.observe_ratelimit_wait("batch", 0.5)
    m.observe_cost("openai", "gpt-4o-mini", 0.125)
    m.observe_cost("slack", "gpt-4o-mini", 1.0)
    waits = samples(m, "egress_gateway_ratelimit_wait_seconds_count")
    assert waits == {
        (("group", "llm"),): 1,
        (("group", UNKNOWN_LABEL),): 1,
        (("group", "batch"),): 1,
    }
    cost = samples(m, "egress_gateway_cost_usd_total")
    assert cost == {
        (("model", "gpt-4o-mini"), ("target", "openai")): 0.25,
        (("model", "gpt-4o-mini"), ("target", UNKNOWN_LABEL)): 0.5,
        (("model", OTHER_MODEL), ("target", "openai")): 0.125,
        (("model", OTHER_MODEL), ("target", "slack")): 1.0,
    }

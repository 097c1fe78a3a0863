"""Each budget's spend against its limit as gauges, read at each scrape:
``egress_gateway_budget_spent_usd`` (local budgets, this sidecar's current window) and
``egress_gateway_budget_limit_usd`` (every budget)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.budgets import Budgets
from gateway.metrics import Metrics
from gateway.policy.budgets import BudgetSpec

NOW = 1_780_000_000.0


def _gauges(metrics: Metrics) -> dict[tuple[str, str, str], float]:
    body, _ = metrics.render()
    return {
        (sample.name, sample.labels["budget"], sample.labels["scope"]): sample.value
        for family in text_string_to_metric_families(body.decode())
        if family.name.startswith("egress_gateway_budget_")
        for sample in family.samples
    }


async def test_spend_and_limit_per_budget_at_each_scrape() -> None:
    specs = {
        "daily": BudgetSpec(limit_usd=10, window="daily"),
        "shared": BudgetSpec(limit_usd=50, window="monthly", scope="cluster"),
    }
    budgets = Budgets(specs, clock=lambda: NOW)  # no Redis: the cluster one counted here
    metrics = Metrics()
    metrics.watch(audit_failures=lambda: 0, secrets_ready=lambda: True, budgets=budgets.levels)
    assert _gauges(metrics) == {
        ("egress_gateway_budget_spent_usd", "daily", "local"): 0.0,
        ("egress_gateway_budget_spent_usd", "shared", "cluster"): 0.0,
        ("egress_gateway_budget_limit_usd", "daily", "local"): 10.0,
        ("egress_gateway_budget_limit_usd", "shared", "cluster"): 50.0,
    }
    booking = await budgets.reserve(budgets.applying("t", None, "a"), 2.5)
    budgets.settle(booking, 1.25)
    gauges = _gauges(metrics)
    assert gauges[("egress_gateway_budget_spent_usd", "daily", "local")] == 1.25
    assert gauges[("egress_gateway_budget_spent_usd", "shared", "cluster")] == 1.25
    budgets.update({"daily": specs["daily"]})  # a reload removes one: its series go
    assert set(_gauges(metrics)) == {
        ("egress_gateway_budget_spent_usd", "daily", "local"),
        ("egress_gateway_budget_limit_usd", "daily", "local"),
    }


def test_no_budget_no_series() -> None:
    metrics = Metrics()
    assert _gauges(metrics) == {}

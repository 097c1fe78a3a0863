"""The metric families of :class:`gateway.metrics.Metrics` (names, help, labels, buckets).

Kept apart from the recording logic so that each stays small; the module docstring of
:mod:`gateway.metrics` lists every series with its type and labels. prometheus-client
is owned by this package.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import gateway

NAMESPACE: Final = "egress_gateway"
#: A budget at a scrape: (name, scope, spent USD or None where not counted here, limit USD).
BudgetLevel = tuple[str, str, float | None, float]

# LLM calls run for tens of seconds; the top buckets keep them apart from the fast ones.
CALL_BUCKETS_S: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
WAIT_BUCKETS_S: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# The GenAI metrics' explicit bucket advice (semantic conventions, gen-ai-metrics).
TOKEN_BUCKETS: Final = tuple(float(4**i) for i in range(14))  # 1 .. 67,108,864
OPERATION_BUCKETS_S: Final = tuple(0.01 * 2**i for i in range(14))  # 0.01 .. 81.92
FIRST_CHUNK_BUCKETS_S: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
_GENAI: Final = ("gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model")


class Series:
    """Every metric family, registered in ``registry`` (the attributes are the families;
    :class:`gateway.metrics.Metrics` records into them)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._declare(registry)
        self.build_info.info({"version": gateway.__version__, "python": platform.python_version()})

    def _declare(self, r: CollectorRegistry) -> None:
        """Declarations only: each family, registered in ``r``."""
        self.calls = Counter(
            "calls", "Calls answered, by target, outcome and error code (OK on success).",
            ["target", "outcome", "code"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.agent_calls = Counter(
            "agent_calls", "Calls answered, by the agent the sidecar established (never a "
            "claimed id; _unknown: no agent of the policy) and decision.",
            ["agent", "decision"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.call_duration = Histogram(
            "call_duration_seconds", "Wall time of a call inside the sidecar, in seconds.",
            ["target"], namespace=NAMESPACE, registry=r, buckets=CALL_BUCKETS_S,
        )  # fmt: skip
        self.upstream_duration = Histogram(
            "upstream_duration_seconds",
            "Time spent waiting on the upstream (all attempts of a call), in seconds.",
            ["target"], namespace=NAMESPACE, registry=r, buckets=CALL_BUCKETS_S,
        )  # fmt: skip
        self.tokens = Counter(
            "tokens", "LLM tokens reported by the upstream, by target and kind.",
            ["target", "kind"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "retries", "Upstream attempts beyond the first, by target.",
            ["target"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.failovers = Counter(
            "failovers", "Calls moved to a fallback, by the target left, the one tried, why.",
            ["from", "to", "reason"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.ratelimit_wait = Histogram(
            "ratelimit_wait_seconds", "Time a call queued for rate-limit capacity, in seconds.",
            ["group"], namespace=NAMESPACE, registry=r, buckets=WAIT_BUCKETS_S,
        )  # fmt: skip
        self.ratelimit_rejections = Counter(
            "ratelimit_rejections", "Calls refused because the group could not admit in time.",
            ["group"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.pool_wait = Histogram(
            "upstream_pool_wait_seconds",
            "Time a call waited for one of its target's connections (all were busy), in seconds.",
            ["target"], namespace=NAMESPACE, registry=r, buckets=WAIT_BUCKETS_S,
        )  # fmt: skip
        self.pool_rejections = Counter(
            "upstream_pool_rejections",
            "Calls refused because none of their target's connections freed up in time.",
            ["target"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.redis_fallbacks = Counter(
            "redis_fallbacks",
            "Calls a fail-open cluster group admitted locally because Redis was unavailable.",
            ["group"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.breaker_state = Gauge(
            "breaker_state", "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
            ["target"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.breaker_transitions = Counter(
            "breaker_transitions", "Circuit breaker state changes, by target and new state.",
            ["target", "to"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.secret_cache = Counter(
            "secret_cache", "Secret cache lookups: hit, miss, or stale (Vault down, old value).",
            ["result"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.policy_reloads = Counter(
            "policy_reloads", "Policy reload attempts, by result.",
            ["result"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.mcp_requests = Counter(
            "mcp_requests", "JSON-RPC requests to MCP targets, by method, tool and outcome.",
            ["target", "method", "tool", "outcome"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.database_statements = Counter(
            "database_statements", "Named statements of database targets, by outcome.",
            ["target", "statement", "outcome"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.inflight = Gauge(
            "inflight_calls", "Calls currently inside the sidecar.",
            namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.build_info = Info(
            "build", "The sidecar's version and the Python that runs it.",
            namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.policy_info = Info(
            "policy", "The policy in force: its agent_id and a digest of its content.",
            namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.token_usage = Histogram(
            "gen_ai_client_token_usage", "Number of input and output tokens used.",
            [*_GENAI, "gen_ai_response_model", "gen_ai_token_type"],
            registry=r, buckets=TOKEN_BUCKETS,
        )  # fmt: skip
        self.operation_duration = Histogram(
            "gen_ai_client_operation_duration_seconds", "GenAI operation duration.",
            [*_GENAI, "gen_ai_response_model", "error_type"],
            registry=r, buckets=OPERATION_BUCKETS_S,
        )  # fmt: skip
        self.first_chunk = Histogram(
            "gen_ai_client_operation_time_to_first_chunk_seconds",
            "Time to receive the first chunk of a streamed answer, from the call's start.",
            list(_GENAI), registry=r, buckets=FIRST_CHUNK_BUCKETS_S,
        )  # fmt: skip
        # Cost and budgets (docs/features/budgets.md): rule names come from the policy.
        self.cost = Counter(
            "cost_usd", "Cost of answered calls in USD (usage x price), by target and model.",
            ["target", "model"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.budget_rejections = Counter(
            "budget_rejections", "Calls refused by a cost budget (BUDGET_EXCEEDED).",
            ["budget"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.chain_refusals = Counter(
            "call_chain_refusals", "Calls refused for their call chain (CALL_CHAIN_REFUSED), "
            "by reason: circular_call_detected, max_depth_exceeded, ttl_expired, invalid_chain.",
            ["reason"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.model_drift = Counter(
            "model_drift", "Answers that named another model than the one sent, by target and "
            "the models sent and answered (model labels as for the gen_ai metrics).",
            ["target", "sent", "answered"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        # The operator's desk (docs/features/approvals.md).
        self.dead_letters = Counter(
            "dead_letters", "Calls kept as dead letters (retries exhausted, OUTCOME_UNKNOWN), "
            "by target.", ["target"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.dead_letters_dropped = Counter(
            "dead_letters_dropped", "Dead letters dropped (oldest first) to stay within "
            "dead_letters.max_count or max_bytes.", namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.approvals = Counter(
            "approvals", "Approval events, by event: requested, decided, used.",
            ["event"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.shadow_denials = Counter(
            "shadow_denials", "Calls a mode: shadow rule would have refused, by kind and rule.",
            ["kind", "rule"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        # Stopping a runaway agent (docs/features/stopping.md).
        self.agent_stops = Gauge(
            "agent_stops", "Stop switches in force on this sidecar, by scope (agent, target, all).",
            ["scope"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip
        self.agent_stop_changes = Counter(
            "agent_stop_changes", "Stops and resumes asked through this sidecar's ops API.",
            ["action", "scope"], namespace=NAMESPACE, registry=r,
        )  # fmt: skip


class Watched(Collector):
    """Values the sidecar holds elsewhere, read when scraped."""

    def __init__(self) -> None:
        self.audit_failures: Callable[[], int] = lambda: 0
        self.secrets_ready: Callable[[], bool] = lambda: True
        self.budgets: Callable[[], Iterable[BudgetLevel]] = tuple
        self.audit_shipping: Callable[[], tuple[int, int] | None] = lambda: None

    def collect(self) -> Iterator[Metric]:
        failures = CounterMetricFamily(
            f"{NAMESPACE}_audit_write_failures",
            "Audit lines the audit file sink could not write (disk full, unwritable path).",
        )
        failures.add_metric([], self.audit_failures())
        yield failures
        yield GaugeMetricFamily(
            f"{NAMESPACE}_secrets_ready",
            "1 when the secret store is usable (no Vault, or Vault with a valid token), else 0.",
            value=1 if self.secrets_ready() else 0,
        )
        spent = GaugeMetricFamily(
            f"{NAMESPACE}_budget_spent_usd",
            "Spend (booked and reserved) of a local budget in its current window, in USD.",
            labels=["budget", "scope"],
        )
        limit = GaugeMetricFamily(
            f"{NAMESPACE}_budget_limit_usd",
            "A budget's limit per window, in USD.",
            labels=["budget", "scope"],
        )
        for name, scope, spent_usd, limit_usd in self.budgets():
            limit.add_metric([name, scope], limit_usd)
            if spent_usd is not None:
                spent.add_metric([name, scope], spent_usd)
        yield spent
        yield limit
        shipping = self.audit_shipping()
        if shipping is not None:
            dropped = CounterMetricFamily(
                f"{NAMESPACE}_audit_shipping_dropped",
                "Audit lines dropped from the OTLP spool when it was full (still in the "
                "file or stdout sink).",
            )
            dropped.add_metric([], shipping[0])
            yield dropped
            yield GaugeMetricFamily(
                f"{NAMESPACE}_audit_shipping_pending_bytes",
                "Bytes of audit lines spooled and not yet accepted by the OTLP collector.",
                value=shipping[1],
            )

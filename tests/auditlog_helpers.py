"""A generated audit log, written by the real writer (gateway.audit), for the audit tests.

Calls of several agents to several targets, with successes, failures of each kind,
retries, replays, rate-limit waits, token usage, and breaker state changes and a policy
reload among them. The expected figures are computed in the tests from the file itself
(plain ``json``), never from the code under test.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from gateway.audit.log import AuditLog
from gateway.audit.schema import CALL_EVENT
from gateway.policy import AuditSpec

AGENTS = ("planner-01", "coder-02", "reviewer-03")
#: The digests of the two policies the calls ran under (even and odd call numbers).
POLICY_DIGESTS = ("a" * 64, "b" * 64)
TARGETS = {
    "openai": ("https://api.openai.com:443", ["/v1/chat/completions", "/v1/embeddings"]),
    "anthropic": ("https://api.anthropic.com:443", ["/v1/messages"]),
    "slack": ("https://slack.com:443", ["/api/chat.postMessage", "/api/conversations.list"]),
}
FAILURES = (
    ("CAPACITY_EXCEEDED", 429, True),
    ("DEPENDENCY_FAILED", 503, True),
    ("CIRCUIT_OPEN", None, True),
    ("AGENT_TIMEOUT", None, True),
    ("UPSTREAM_REJECTED", 400, False),
)


def call_record(rng: random.Random, number: int, agent: str, trace: str) -> dict[str, Any]:
    """The call fields of one AuditRecord (the writer adds event, level, timestamp...)."""
    target = rng.choice(sorted(TARGETS))
    upstream, endpoints = TARGETS[target]
    roll = rng.random()
    replayed = roll < 0.08
    denied = 0.08 <= roll < 0.13
    failure = FAILURES[number % len(FAILURES)] if 0.13 <= roll < 0.35 else None
    attempts = 0 if replayed or denied else rng.choice((1, 1, 1, 2, 3, 4))
    llm = target in ("openai", "anthropic")
    success = not denied and failure is None
    tokens = (rng.randint(10, 900), rng.randint(1, 400), rng.choice((0, 0, 64))) if llm else None
    record: dict[str, Any] = {
        "agent_id": agent,
        "trace_id": trace,
        "correlation_id": f"corr-{number:04d}",
        "target_system": target,
        "endpoint": rng.choice(endpoints),
        "method": "POST",
        "upstream": None if denied else upstream,
        "decision": "replayed" if replayed else ("denied" if denied else "allowed"),
        "success": success,
        "status_code": 200 if success else (None if denied or failure is None else failure[1]),
        "error_code": None if success else ("PERMISSION_DENIED" if denied else failure[0]),
        "retryable": None if success else (False if denied else failure[2]),
        "attempts": attempts,
        "latency_ms": round(rng.lognormvariate(4.0, 0.8), 3),
        "upstream_latency_ms": None if denied or replayed else round(rng.uniform(5, 400), 3),
        "tokens_used": (tokens[0] + tokens[1]) if tokens and success else None,
        "tokens_input": tokens[0] if tokens and success else None,
        "tokens_output": tokens[1] if tokens and success else None,
        "tokens_cached": tokens[2] if tokens and success else None,
        "request_bytes": rng.randint(50, 5000),
        "request_sha256": f"{number:064x}",
        "response_bytes": None if denied else rng.randint(10, 9000),
        "api_key_ref": f"vault://{target}-key" if target != "slack" else "env://SLACK_TOKEN",
        "rate_limit_group": "llm" if llm else None,
        "rate_limit_wait_ms": round(rng.uniform(1, 250), 3) if rng.random() < 0.2 else 0.0,
        "idempotency_key": f"idem-{number:04d}" if replayed or rng.random() < 0.3 else None,
        "replayed": replayed,
        "warnings": ["unknown envelope field 'foo' ignored"] if number % 17 == 0 else [],
        "metadata": {"step": number % 5, "tags": ["gen"]},
        "traceparent": f"00-{number:032x}-{number + 1:016x}-01",
        "http_method": None,
        "http_path": None,
        "http_status": None,
        "stream": number % 5 == 0,
        "stream_events": 12 if number % 5 == 0 else None,
        "time_to_first_byte_ms": 3.5 if number % 5 == 0 else None,
        "tokens_reasoning": None,
        "api": "envelope",
        "cost_usd": round(tokens[0] * 1.5e-7, 9) if target == "openai" and tokens else None,
        "cost_reason": None if target == "openai" else "no_dialect",
        "cost_model": "gpt-4o-mini" if target == "openai" else None,
        "cost_source": "genai-prices" if target == "openai" else None,
        "budgets": [],
        "shadow_denied": [],
        "mcp_method": None,
        "mcp_tool": None,
        "mcp_request_id": None,
        "mcp_is_error": None,
        "mcp_error_code": None,
        "a2a_method": None,
        "a2a_request_id": None,
        "a2a_task_id": None,
        "a2a_context_id": None,
        "a2a_error_code": None,
        "agent_auth": "uid",
        "agent_claimed": None,
        "peer_uid": 1000 + AGENTS.index(agent) if agent in AGENTS else None,
        "policy_sha256": POLICY_DIGESTS[number % 2],
        "call_chain": [agent],
        "call_chain_depth": 1,
        "served_by": {"target": target, "model": "gpt-4o-mini" if llm else None}
        if success
        else None,
        "tried": None,
        # openai calls under models: rules, one in 11 answered by another model
        "model_requested": "gpt-4o-mini" if target == "openai" else None,
        "model_sent": "gpt-4o-mini-2024-07-18" if target == "openai" else None,
        "model_drift": (
            {"sent": "gpt-4o-mini-2024-07-18", "answered": "gpt-4o-mini-2024-09-01"}
            if target == "openai" and success and number % 11 == 0
            else None
        ),
        "db_statement": None,
        "db_sql_sha256": None,
        "db_params_sha256": None,
        "db_user": None,
        "db_rows": None,
        "db_sqlstate": None,
        "db_pool_wait_ms": None,
        "db_retries": None,
        "agent_rate_limit_group": None,
        "rate_limit_refused": None,
    }
    return record


def write_calls(
    log: AuditLog, n_calls: int, *, seed: int = 7, first: int = 0, breaker_every: int = 37
) -> None:
    """Write ``n_calls`` call records (and breaker events) of several agents to ``log``."""
    rng = random.Random(seed)
    for number in range(first, first + n_calls):
        agent = AGENTS[number % len(AGENTS)]
        trace = f"trace-{number // 4:03d}"  # four calls per trace
        log.call(call_record(rng, number, agent, trace))
        if number % breaker_every == 5:
            target = sorted(TARGETS)[number % len(TARGETS)]
            for old, new in (("closed", "open"), ("open", "half_open"), ("half_open", "closed")):
                log.event(
                    "breaker_state_change",
                    agent_id=agent,
                    target_system=target,
                    old_state=old,
                    new_state=new,
                )
        if number == first + 3:
            log.event("policy_reload", agent_id=agent, version=2, ok=True)


def write_log(
    path: Path,
    n_calls: int = 240,
    *,
    chain: bool = True,
    seed: int = 7,
    max_bytes: int | None = None,
) -> None:
    """A generated log at ``path`` (rotated when ``max_bytes``), by the real writer."""
    spec = AuditSpec(sink="file", path=str(path), chain=chain, max_bytes=max_bytes, backup_count=50)
    log = AuditLog(spec, agent_id=AGENTS[0])
    try:
        write_calls(log, n_calls, seed=seed)
    finally:
        log.close()


def read_json(path: Path) -> list[dict[str, Any]]:
    """Every line of ``path`` parsed with plain json (the tests' independent reader)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def calls_of(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if line.get("event") == CALL_EVENT]

"""Policy input that is hostile or careless: YAML merge keys, the
bound of every number, and what ``serve`` and a reload do with a policy that is not one.

The failure modes with a file of their own (unhashable keys, deep nesting, alias bombs,
huge numbers, binary junk...) are in ``tests/policies/`` and checked by test_policy.py.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from gateway.cli import main
from gateway.policy import PolicyError, a2a, load_policy, parse_policy
from gateway.policy import defaults as d
from gateway.policy.root import Policy
from gateway.server.runtime import Gateway
from tests.conftest import calls_made
from tests.test_policy import BAD_POLICIES, FIXTURES, ROOT, expected_problems

HEAD = "version: 1\nagent_id: a\n"
TARGET = "base_url: https://api.example.com, endpoints: [{path: /x, methods: [GET]}]"
#: One problem line: ``FILE:LINE: key.path: problem``, printable, on one line.
PROBLEM_LINE = re.compile(r"^(?P<file>[^\n]+?):(?P<line>[1-9][0-9]*): (?P<key>[^:\s][^\n]*?): \S")


def problems_of(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    return info.value.problems


# --- merge keys --------------------------------------------------------------------------

SHARED_RETRY = """\
version: 1
agent_id: a
targets:
  openai:
    base_url: https://api.openai.com
    endpoints: [{path: /v1/chat/completions, methods: [POST]}]
    retry: &llm-retry
      max_retries: 5
      backoff_base_s: 0.25
      retry_on: [429, 503]
  anthropic:
    base_url: https://api.anthropic.com
    endpoints: [{path: /v1/messages, methods: [POST]}]
    retry:
      <<: *llm-retry
      max_retries: 2
  gemini:
    <<: {base_url: https://generativelanguage.googleapis.com, timeout_s: 90}
    endpoints: [{path: /v1beta/models/*, methods: [POST]}]
    retry: *llm-retry
"""


def test_targets_share_a_retry_block_through_a_merge_key() -> None:
    targets = parse_policy(SHARED_RETRY, "p.yaml").targets
    anthropic, gemini = targets["anthropic"].retry, targets["gemini"].retry
    assert (anthropic.max_retries, anthropic.backoff_base_s) == (2, 0.25)  # own key wins
    assert anthropic.retry_on == [429, 503]
    assert gemini == targets["openai"].retry
    assert targets["gemini"].timeout_s == 90
    assert targets["gemini"].base_url == "https://generativelanguage.googleapis.com"


def test_merge_precedence_follows_the_yaml_merge_spec() -> None:
    # https://yaml.org/type/merge.html: the mapping's own keys win, then earlier
    # mappings of the merge list over later ones.
    text = HEAD + (
        "rate_limit_groups:\n"
        "  a: &a {requests_per_second: 1, burst: 1}\n"
        "  b: &b {requests_per_second: 2, burst: 2, max_queue_s: 2}\n"
        "  c: {<<: [*a, *b], burst: 3}\n"
    )
    group = parse_policy(text, "p.yaml").rate_limit_groups["c"]
    assert (group.requests_per_second, group.burst, group.max_queue_s) == (1, 3, 2)


def test_an_error_through_a_merge_names_the_line_it_is_written_on() -> None:
    text = SHARED_RETRY.replace("max_retries: 2", "max_retries: 20")
    assert problems_of(text) == [
        "p.yaml:16: targets.anthropic.retry.max_retries: Input should be less than or equal to 10"
    ]
    text = SHARED_RETRY.replace("retry_on: [429, 503]", "retry_on: [429, 404]")
    lines = problems_of(text)
    assert [p.split(": ", 1)[0] for p in lines] == ["p.yaml:10"] * 3
    assert {p.split(": ")[1] for p in lines} == {
        f"targets.{name}.retry.retry_on" for name in ("openai", "anthropic", "gemini")
    }


def _merge_bomb(depth: int) -> str:
    levels = "".join(f"  g{i}: &g{i} {{<<: [*g{i - 1}, *g{i - 1}]}}\n" for i in range(1, depth))
    return HEAD + "rate_limit_groups:\n  g0: &g0 {requests_per_second: 1}\n" + levels


def test_a_merge_key_bomb_is_cheap() -> None:
    # Each level merges the one before twice: PyYAML's own merge doubles the key list
    # per level (2**40 entries); merged keys are kept once each. The work is counted in
    # function calls (about a thousand a level today), not timed.
    with calls_made() as half:
        parse_policy(_merge_bomb(20), "p.yaml")
    with calls_made() as calls:
        groups = parse_policy(_merge_bomb(40), "p.yaml").rate_limit_groups
    assert groups["g39"].requests_per_second == 1
    assert len(calls) < 100_000
    assert len(calls) <= 2 * len(half) + 2_000  # linear in the levels, not doubling


def test_an_alias_to_a_whole_target_with_an_override() -> None:
    text = HEAD + f"targets:\n  a: &a {{{TARGET}}}\n  b: {{<<: *a, timeout_s: 5}}\n"
    targets = parse_policy(text, "p.yaml").targets
    assert (targets["a"].timeout_s, targets["b"].timeout_s) == (30, 5)
    assert targets["b"].endpoints == targets["a"].endpoints


def test_the_yaml_value_key_is_read_as_a_plain_string() -> None:
    # '=' resolves to YAML 1.1's !!value tag, which PyYAML reads as the string "=".
    [problem] = problems_of(HEAD + "=: 1\n")
    assert problem.startswith("p.yaml:3: =: unknown key; known keys here: version,")


# --- numbers: finite, bounded ----------------------------------------------------------

#: Every float key of the policy, as a YAML snippet with ``@`` for the value.
T = "targets: {t: {" + TARGET
MCP = "targets: {t: {base_url: https://api.example.com, mcp: {arguments: {x: {a: {"
A2A = "targets: {t: {base_url: https://agent.example.com, a2a: {"
OPERATOR = "\noperators: {o: {token_ref: env://OPERATOR_TOKEN}}"
DB = (
    "targets: {t: {database: {engine: postgresql, dsn: 'postgresql://db.example.com/x', "
    "credential: {user_ref: 'env://U', password_ref: 'env://P'}, "
)
DB_POOL = DB + "statements: {s: {mode: read, sql: SELECT 1}}, "
STATEMENT = DB + "statements: {s: {mode: read, sql: SELECT 1, "
FLOAT_KEYS = {
    "targets.t.database.pool.acquire_timeout_s": DB_POOL + "pool: {acquire_timeout_s: @}}}}",
    "targets.t.database.pool.max_lifetime_s": DB_POOL + "pool: {max_lifetime_s: @}}}}",
    "targets.t.database.session.statement_timeout_s": DB_POOL
    + "session: {statement_timeout_s: @}}}}",
    "targets.t.database.session.lock_timeout_s": DB_POOL + "session: {lock_timeout_s: @}}}}",
    "targets.t.database.statements.s.timeout_s": STATEMENT + "timeout_s: @}}}}}",
    "targets.t.mcp.arguments.x.a.minimum": MCP + "minimum: @}}}}}}",
    "targets.t.mcp.arguments.x.a.maximum": MCP + "maximum: @}}}}}}",
    "server.drain_s": "server: {drain_s: @}",
    "audit.otlp.timeout_s": "audit: {otlp: {endpoint: 'http://otel:4318', timeout_s: @}}",
    "server.reload_interval_s": "server: {reload_interval_s: @}",
    "targets.t.timeout_s": T + ", timeout_s: @}}",
    "targets.t.stream_idle_timeout_s": T + ", stream_idle_timeout_s: @}}",
    "targets.t.connection_wait_s": T + ", connection_wait_s: @}}",
    "targets.t.first_byte_timeout_s": T + ", first_byte_timeout_s: @}}",
    "server.shutdown.quiet_s": "server: {shutdown: {quiet_s: @}}",
    "targets.t.retry.backoff_base_s": T + ", retry: {backoff_base_s: @}}}",
    "targets.t.retry.backoff_max_s": T + ", retry: {backoff_max_s: @}}}",
    "targets.t.circuit_breaker.reset_timeout_s": T + ", circuit_breaker: {reset_timeout_s: @}}}",
    "targets.t.idempotency.ttl_s": T + ", idempotency: {ttl_s: @}}}",
    "rate_limit_groups.g.requests_per_second": "rate_limit_groups: {g: {requests_per_second: @}}",
    "rate_limit_groups.g.max_queue_s": (
        "rate_limit_groups: {g: {requests_per_second: 1, max_queue_s: @}}"
    ),
    "secrets.vault.cache_ttl_s": "secrets: {vault: {cache_ttl_s: @}}",
    "secrets.vault.stale_if_error_s": "secrets: {vault: {stale_if_error_s: @}}",
    "secrets.vault.timeout_s": "secrets: {vault: {timeout_s: @}}",
    "redis.socket_timeout_s": "redis: {socket_timeout_s: @}",
    "redis.connect_timeout_s": "redis: {connect_timeout_s: @}",
    "telemetry.tracing.sample_ratio": "telemetry: {tracing: {sample_ratio: @}}",
    "budgets.b.limit_usd": "budgets: {b: {window: daily, limit_usd: @}}",
    "budgets.b.per_hours": "budgets: {b: {limit_usd: 1, window: rolling, per_hours: @}}",
    "controls.stop_switch.poll_interval_s": "controls: {stop_switch: {poll_interval_s: @}}",
    "controls.repeated_calls.window_s": (
        "controls: {repeated_calls: {max_repeats: 1, window_s: @}}"
    ),
    "prices.m.input_usd_per_mtok": "prices: {m: {output_usd_per_mtok: 1, input_usd_per_mtok: @}}",
    "prices.m.output_usd_per_mtok": "prices: {m: {input_usd_per_mtok: 1, output_usd_per_mtok: @}}",
    "prices.m.cached_usd_per_mtok": (
        "prices: {m: {input_usd_per_mtok: 1, output_usd_per_mtok: 1, cached_usd_per_mtok: @}}"
    ),
    "prices.m.cache_write_usd_per_mtok": (
        "prices: {m: {input_usd_per_mtok: 1, output_usd_per_mtok: 1, cache_write_usd_per_mtok: @}}"
    ),
    "chain.ttl_s": "chain: {ttl_s: @}",
    "chain.max_clock_skew_s": "chain: {max_clock_skew_s: @}",
    "targets.t.a2a.task_ttl_s": A2A + "task_ttl_s: @}}}",
    "targets.t.a2a.card.ttl_s": A2A + "card: {ttl_s: @}}}}",
    "inbound.timeout_s": "inbound: {agent_url: http://127.0.0.1:9000, timeout_s: @}",
    "targets.t.approval.ttl_s": T + ", approval: {tools: [x], ttl_s: @}}}" + OPERATOR,
    "targets.t.approval.retry_after_s": (
        T + ", approval: {tools: [x], retry_after_s: @}}}" + OPERATOR
    ),
}

#: Every bounded key with its upper bound (the named constant the model uses).
UPPER_BOUNDS = {
    "targets.t.database.pool.acquire_timeout_s": d.MAX_WAIT_S,
    "targets.t.database.pool.max_lifetime_s": d.MAX_WAIT_S,
    "targets.t.database.session.statement_timeout_s": d.MAX_WAIT_S,
    "targets.t.database.session.lock_timeout_s": d.MAX_WAIT_S,
    "targets.t.database.statements.s.timeout_s": d.MAX_WAIT_S,
    "targets.t.database.pool.max_size": d.MAX_DB_POOL_SIZE,
    "targets.t.database.statements.s.max_rows": d.MAX_DB_MAX_ROWS,
    "targets.t.database.statements.s.max_bytes": d.MAX_BODY_BYTES,
    "targets.t.database.statements.s.max_affected_rows": d.MAX_DB_AFFECTED_ROWS,
    "targets.t.mcp.arguments.x.a.minimum": d.MAX_ARGUMENT_NUMBER,
    "targets.t.mcp.arguments.x.a.maximum": d.MAX_ARGUMENT_NUMBER,
    "targets.t.mcp.arguments.x.a.min_length": d.MAX_ARGUMENT_LENGTH,
    "targets.t.mcp.arguments.x.a.max_length": d.MAX_ARGUMENT_LENGTH,
    "server.drain_s": d.MAX_WAIT_S,
    "server.reload_interval_s": d.MAX_WAIT_S,
    "targets.t.timeout_s": d.MAX_WAIT_S,
    "targets.t.stream_idle_timeout_s": d.MAX_WAIT_S,
    "targets.t.connection_wait_s": d.MAX_WAIT_S,
    "targets.t.max_connections": d.MAX_MAX_CONNECTIONS,
    "targets.t.first_byte_timeout_s": d.MAX_WAIT_S,
    "server.shutdown.quiet_s": d.MAX_SHUTDOWN_QUIET_S,
    "targets.t.retry.backoff_base_s": d.MAX_BACKOFF_BASE_S,
    "targets.t.retry.backoff_max_s": d.MAX_CALL_WAIT_S,
    "targets.t.circuit_breaker.reset_timeout_s": d.MAX_WAIT_S,
    "targets.t.idempotency.ttl_s": d.MAX_IDEMPOTENCY_TTL_S,
    "rate_limit_groups.g.requests_per_second": d.MAX_REQUESTS_PER_SECOND,
    "rate_limit_groups.g.max_queue_s": d.MAX_CALL_WAIT_S,
    "secrets.vault.cache_ttl_s": d.MAX_VAULT_CACHE_TTL_S,
    "secrets.vault.stale_if_error_s": d.MAX_VAULT_STALE_IF_ERROR_S,
    "secrets.vault.timeout_s": d.MAX_VAULT_TIMEOUT_S,
    "redis.socket_timeout_s": d.MAX_REDIS_TIMEOUT_S,
    "redis.connect_timeout_s": d.MAX_REDIS_TIMEOUT_S,
    "telemetry.tracing.sample_ratio": d.MAX_TRACE_SAMPLE_RATIO,
    "budgets.b.limit_usd": d.MAX_BUDGET_USD,
    "budgets.b.per_hours": d.MAX_BUDGET_PER_HOURS,
    "controls.stop_switch.poll_interval_s": d.MAX_STOP_POLL_INTERVAL_S,
    "controls.repeated_calls.window_s": d.MAX_REPEAT_WINDOW_S,
    "controls.repeated_calls.max_repeats": d.MAX_REPEATS,
    "budgets.b.max_calls": d.MAX_BUDGET_CALLS,
    "prices.m.input_usd_per_mtok": d.MAX_USD_PER_MTOK,
    "prices.m.output_usd_per_mtok": d.MAX_USD_PER_MTOK,
    "prices.m.cached_usd_per_mtok": d.MAX_USD_PER_MTOK,
    "prices.m.cache_write_usd_per_mtok": d.MAX_USD_PER_MTOK,
    "budgets.b.max_output_tokens": d.MAX_TOKENS_PER_MINUTE,
    "agents.a.uid": d.MAX_AGENT_UID,
    "server.max_request_bytes": d.MAX_BODY_BYTES,
    "server.max_response_bytes": d.MAX_BODY_BYTES,
    "server.max_inflight_request_bytes": d.MAX_INFLIGHT_BYTES,
    "server.idempotency_max_entries": d.MAX_IDEMPOTENCY_ENTRIES,
    "server.idempotency_max_bytes": d.MAX_IDEMPOTENCY_STORE_BYTES,
    "rate_limit_groups.g.burst": d.MAX_BURST,
    "rate_limit_groups.g.tokens_per_minute": d.MAX_TOKENS_PER_MINUTE,
    "targets.t.retry.max_retries": d.MAX_POLICY_MAX_RETRIES,
    "targets.t.circuit_breaker.fail_max": d.MAX_FAIL_MAX,
    "redis.pool_size": d.MAX_REDIS_POOL_SIZE,
    "audit.max_bytes": d.MAX_AUDIT_FILE_BYTES,
    "audit.backup_count": d.MAX_AUDIT_BACKUPS,
    "audit.otlp.timeout_s": d.MAX_AUDIT_OTLP_TIMEOUT_S,
    "audit.otlp.spool_max_bytes": d.MAX_AUDIT_SPOOL_BYTES,
    "chain.ttl_s": d.MAX_CHAIN_TTL_S,
    "chain.max_clock_skew_s": d.MAX_CHAIN_CLOCK_SKEW_S,
    "targets.t.a2a.task_ttl_s": a2a.MAX_TASK_TTL_S,
    "targets.t.a2a.card.ttl_s": a2a.MAX_CARD_TTL_S,
    "inbound.timeout_s": a2a.MAX_INBOUND_TIMEOUT_S,
    "chain.max_depth": d.MAX_CHAIN_MAX_DEPTH,
    "targets.t.approval.ttl_s": d.MAX_APPROVAL_TTL_S,
    "targets.t.approval.retry_after_s": d.MAX_APPROVAL_TTL_S,
    "dead_letters.max_count": d.MAX_DEAD_LETTERS_MAX_COUNT,
    "dead_letters.max_bytes": d.MAX_DEAD_LETTERS_MAX_BYTES,
}
INT_KEYS = {
    "targets.t.database.pool.max_size": DB_POOL + "pool: {max_size: @}}}}",
    "targets.t.database.statements.s.max_rows": STATEMENT + "max_rows: @}}}}}",
    "targets.t.database.statements.s.max_bytes": STATEMENT + "max_bytes: @}}}}}",
    "targets.t.database.statements.s.max_affected_rows": STATEMENT + "max_affected_rows: @}}}}}",
    "targets.t.mcp.arguments.x.a.min_length": MCP + "min_length: @}}}}}}",
    "targets.t.mcp.arguments.x.a.max_length": MCP + "max_length: @}}}}}}",
    "server.max_request_bytes": "server: {max_request_bytes: @}",
    "server.max_response_bytes": "server: {max_response_bytes: @}",
    "server.max_inflight_request_bytes": "server: {max_inflight_request_bytes: @}",
    "server.idempotency_max_entries": "server: {idempotency_max_entries: @}",
    "server.idempotency_max_bytes": "server: {idempotency_max_bytes: @}",
    "rate_limit_groups.g.burst": "rate_limit_groups: {g: {requests_per_second: 1, burst: @}}",
    "rate_limit_groups.g.tokens_per_minute": (
        "rate_limit_groups: {g: {requests_per_second: 1, tokens_per_minute: @}}"
    ),
    "targets.t.retry.max_retries": T + ", retry: {max_retries: @}}}",
    "targets.t.max_connections": T + ", max_connections: @}}",
    "targets.t.circuit_breaker.fail_max": T + ", circuit_breaker: {fail_max: @}}}",
    "redis.pool_size": "redis: {pool_size: @}",
    "audit.max_bytes": "audit: {max_bytes: @}",
    "audit.backup_count": "audit: {backup_count: @}",
    "audit.otlp.spool_max_bytes": (
        "audit: {otlp: {endpoint: 'http://otel:4318', spool_max_bytes: @}}"
    ),
    "budgets.b.max_output_tokens": (
        "budgets: {b: {limit_usd: 1, window: daily, max_output_tokens: @}}"
    ),
    "agents.a.uid": "agents: {a: {uid: @}}",
    "chain.max_depth": "chain: {max_depth: @}",
    "controls.repeated_calls.max_repeats": (
        "controls: {repeated_calls: {window_s: 1, max_repeats: @}}"
    ),
    "budgets.b.max_calls": "budgets: {b: {window: daily, max_calls: @}}",
    "dead_letters.max_count": "dead_letters: {max_count: @}",
    "dead_letters.max_bytes": "dead_letters: {max_bytes: @}",
}


def with_value(snippet: str, value: object) -> str:
    return HEAD + snippet.replace("@", str(value)) + "\n"


def _numeric_fields(model: type[BaseModel], kind: type) -> set[tuple[str, str]]:
    found = set()
    for cls in [model, *_models_under(model)]:
        for name, field in cls.model_fields.items():
            args = typing.get_args(field.annotation) or (field.annotation,)
            if kind in args and bool not in args:
                found.add((cls.__name__, name))
    return found


def _models_under(model: type[BaseModel]) -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []
    stack = [model]
    while stack:
        for field in stack.pop().model_fields.values():
            todo = [field.annotation]
            while todo:
                ann = todo.pop()
                if isinstance(ann, type) and issubclass(ann, BaseModel) and ann not in seen:
                    seen.append(ann)
                    stack.append(ann)
                todo.extend(typing.get_args(ann))
    return seen


def _field_of(key: str) -> str:
    return key.rsplit(".", 1)[1]


def test_the_tables_cover_every_number_of_the_policy() -> None:
    # A float or int key added to the models must be added here, with its bound.
    floats = {name for _, name in _numeric_fields(Policy, float)}
    ints = {name for _, name in _numeric_fields(Policy, int)} - {"port", "ops_port"}
    assert floats == {_field_of(k) for k in FLOAT_KEYS}
    assert ints == {_field_of(k) for k in INT_KEYS} - {"version"}
    assert set(UPPER_BOUNDS) == set(FLOAT_KEYS) | set(INT_KEYS)


@pytest.mark.parametrize("key", sorted(FLOAT_KEYS))
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", ".NaN", "1.0e+999"])
def test_infinity_and_nan_are_refused_for_every_number(key: str, value: str) -> None:
    problems = problems_of(with_value(FLOAT_KEYS[key], value))
    assert problems == [f"p.yaml:3: {key}: Input should be a finite number"]


@pytest.mark.parametrize("key", sorted(UPPER_BOUNDS))
def test_every_number_has_its_named_upper_bound(key: str) -> None:
    snippet = {**FLOAT_KEYS, **INT_KEYS}[key]
    bound = UPPER_BOUNDS[key]
    at = int(bound) if key in INT_KEYS or bound == int(bound) else bound
    parse_policy(with_value(snippet, at), "p.yaml")
    past = at + 1 if isinstance(at, int) else at * 1.5
    assert problems_of(with_value(snippet, past)) == [
        f"p.yaml:3: {key}: Input should be less than or equal to {at}"
    ]


def test_requests_per_second_has_a_floor_the_cluster_limiter_can_count() -> None:
    snippet = INT_KEYS["rate_limit_groups.g.burst"].replace("second: 1", "second: %")
    parse_policy(with_value(snippet, d.MAX_BURST).replace("%", "0.001"), "p.yaml")
    assert problems_of(with_value(snippet, 1).replace("%", "0.0009")) == [
        "p.yaml:3: rate_limit_groups.g.requests_per_second: "
        "Input should be greater than or equal to 0.001"
    ]


def test_a_bare_number_is_no_cidr_but_a_string_is() -> None:
    egress = parse_policy(
        HEAD + "egress: {allow_cidrs: ['10.0.0.0/8', '10.1.2.3', 'fd00::/8']}\n", "p"
    ).egress
    assert [str(n) for n in egress.allow_cidrs] == ["10.0.0.0/8", "10.1.2.3/32", "fd00::/8"]
    for value, kind in [("10", "a number"), ("167772160", "a number"), ("true", "a boolean")]:
        assert problems_of(HEAD + f"egress: {{deny_cidrs: [{value}]}}\n") == [
            f"p.yaml:3: egress.deny_cidrs.0: a CIDR is written as a string such as "
            f"'10.0.0.0/8' (got {kind})"
        ]


@pytest.mark.parametrize(
    ("items", "problem"),
    [
        ("[true]", "retry_on.0: must be an HTTP status (429, 5xx) or 'timeout' or 'connect'"),
        ("[soon]", "retry_on.0: must be an HTTP status (429, 5xx) or 'timeout' or 'connect'"),
        ("[503, 5.5]", "retry_on.1: must be an HTTP status (429, 5xx) or 'timeout' or 'connect'"),
    ],
)
def test_retry_on_items(items: str, problem: str) -> None:
    text = HEAD + f"targets: {{t: {{{TARGET}, retry: {{retry_on: {items}}}}}}}\n"
    assert problems_of(text) == [f"p.yaml:3: targets.t.retry.{problem}"]


def test_a_cross_reference_problem_of_a_dotted_target_name_has_its_line() -> None:
    text = HEAD + (
        "targets:\n"
        "  api.v2:\n"
        "    base_url: https://api.example.com\n"
        "    endpoints: [{path: /x, methods: [GET]}]\n"
        "    rate_limit_group: nope\n"
    )
    assert problems_of(text) == [
        "p.yaml:7: targets.api.v2.rate_limit_group: no rate-limit group 'nope' (known: none)"
    ]


# --- serve and reload refuse what validate refuses --------------------------------------

NASTY = [
    FIXTURES / f"{name}.yaml"
    for name in (
        "billion_laughs",
        "deep_nesting_flow",
        "deep_nesting_mapping",
        "key_is_a_sequence",
        "integer_too_many_digits",
        "binary_junk",
        "nul_byte",
        "not_utf8",
        "alias_cycle",
        "date_out_of_range",
    )
]


def test_every_fixture_problem_has_the_file_line_key_form(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["validate", *map(str, BAD_POLICIES)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) >= len(BAD_POLICIES)
    for line in lines:
        match = PROBLEM_LINE.match(line)
        assert match, line
        assert Path(match["file"]) in BAD_POLICIES
        assert line.isprintable()


@pytest.mark.parametrize("path", NASTY, ids=lambda p: p.stem)
def test_serve_refuses_a_nasty_policy_with_the_same_lines(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--policy", str(path)]) == 1
    assert capsys.readouterr().err.splitlines() == expected_problems(path)


async def test_a_reload_to_a_nasty_policy_keeps_the_old_one(tmp_path: Path) -> None:
    good = load_policy(ROOT / "policies" / "demo.yaml")
    gateway = Gateway(good)
    for path in [*NASTY, tmp_path]:  # tmp_path: a directory
        assert await gateway.reload(str(path)) is False
        assert gateway.policy is good
    assert await gateway.reload(str(ROOT / "policies" / "example.yaml")) is True
    assert gateway.policy is not good


def test_validate_survives_an_unexpected_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Not a YAML library patch: the sidecar's own loader is made to fail like a bug would.
    def broken(path: Any) -> Any:
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.setattr("gateway.policy.load_policy", broken)
    assert main(["validate", "x.yaml"]) == 1
    assert capsys.readouterr().err == (
        "x.yaml:1: (top level): internal error while checking the policy "
        "(RuntimeError: a bug over two lines); please report it\n"
    )

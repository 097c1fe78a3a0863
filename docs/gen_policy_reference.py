"""Write docs/reference/policy.md from the policy models, so that the reference cannot
drift from the code: every key of the YAML file, its type, default, bounds, description
and an example taken from a shipped policy (policies/*.yaml).

    python docs/gen_policy_reference.py            # (re)write the page
    python docs/gen_policy_reference.py --check    # exit 1 if the page is not current

Run by ``make docs`` before ``mkdocs build``; ``make test`` runs ``--check`` (make
docs-check), and tests/test_policy_reference_is_current.py regenerates it and compares.
A key's description is, in this order: its ``description=`` in the model, DESCRIPTIONS
below, or the comment written after it in the model's source; a key with none of them
fails the test, so a new key comes with its words.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import sys
import tokenize
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT: Final = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.policy.root import Policy  # noqa: E402 - after the path is set

PAGE: Final = ROOT / "docs" / "reference" / "policy.md"
#: Where examples come from: the policies the project ships, in this order.
EXAMPLE_FILES: Final = sorted((ROOT / "policies").glob("*.yaml"))
#: The placeholder of a mapping's own names in a key path (``targets.NAME.base_url``).
NAME: Final = "NAME"

#: Descriptions of keys whose model says nothing next to them (the key path, with NAME).
DESCRIPTIONS: Final[dict[str, str]] = {
    "version": "the policy format's version; always `1`",
    "targets.NAME.credential.refs": "a key pool: secret references used in order when the "
    "call names none; a key rests after a 429 or a quota refusal and the next serves "
    "(not with `default_ref`)",
    "targets.NAME.fallbacks": "options tried in order when the target fails before "
    "anything reached the agent (docs/features/failover.md)",
    "targets.NAME.fallbacks.target": "the policy's target to send the call to instead",
    "targets.NAME.fallbacks.model": "the model to name there instead; `null`: the request's own",
    "targets.NAME.fallback_on": "answers that also fail over besides outages "
    "(`context_length_exceeded`: to a fallback with a longer context)",
    "targets.NAME.first_byte_timeout_s": "longest wait for a stream's first event, in "
    "seconds; past it STREAM_INTERRUPTED `first_byte_timeout` (a fallback may serve); "
    "`null`: `stream_idle_timeout_s`",
    "targets.NAME.call_chain": "whether the call chain goes out to this target "
    '(docs/features/call-chain.md, "Which targets get the chain")',
    "agent_id": "the agent this sidecar serves: audit records' `agent_id`, `failed_agent`",
    "server": "the sidecar's listeners and process limits",
    "server.host": "address of the calls listener (envelope, drop-in, MCP)",
    "server.port": "port of the calls listener",
    "server.ops_host": "address of the ops listener (`/healthz`, `/readyz`, `/metrics`)",
    "server.ops_port": "port of the ops listener; `null` turns it off",
    "server.max_request_bytes": "largest request body an agent may send, in bytes",
    "server.max_response_bytes": "largest upstream body (decoded) or stream, in bytes",
    "server.max_inflight_request_bytes": "memory the request bodies in flight may hold, in "
    "bytes of their charge; past it a call is refused CAPACITY_EXCEEDED (429, retryable)",
    "server.drain_s": "seconds given to calls in flight after SIGTERM",
    "server.shutdown": "what happens between SIGTERM and exit",
    "server.shutdown.accept_new_calls": "serve new calls while draining "
    "(`GATEWAY_SHUTDOWN_ACCEPT_NEW_CALLS` overrides it)",
    "server.shutdown.quiet_s": "with new calls accepted: exit once nothing was in flight "
    "for this many seconds",
    "server.reload_interval_s": "seconds between checks of the policy file (0: SIGHUP only)",
    "server.idempotency_max_entries": "bound of the in-memory idempotency store, in entries",
    "server.idempotency_max_bytes": "bound of the in-memory idempotency store, in bytes",
    "envelope": "how envelopes are read",
    "envelope.unknown_fields": "an unknown top-level envelope field is refused or warned of",
    "egress": "which resolved addresses the sidecar may connect to",
    "egress.allow_cidrs": "private, loopback or link-local networks that are allowed",
    "egress.deny_cidrs": "networks always refused; wins over everything",
    "targets": "the upstreams the agent may call; none: every call is refused",
    "targets.NAME": "one upstream, named as the agent names it (`target_system`)",
    "targets.NAME.base_url": "`scheme://host[:port][/base-path]`: the only place hosts live",
    "targets.NAME.credential": "how the secret is attached to each request",
    "targets.NAME.credential.header": "header that carries the secret",
    "targets.NAME.credential.query_param": "query parameter that carries the secret instead",
    "targets.NAME.credential.format": "the header's value, `{secret}` replaced by the secret",
    "targets.NAME.credential.default_ref": "secret reference used when the call names none",
    "targets.NAME.credential.allowed_refs": "other secret references a call may name",
    "targets.NAME.endpoints": "the allowlist of paths and methods (not with `mcp`)",
    "targets.NAME.endpoints.path": "path pattern: `*` one segment, a final `**` any rest",
    "targets.NAME.endpoints.methods": "HTTP methods allowed on the path",
    "targets.NAME.rate_limit_group": "rate-limit group used when the call names none",
    "targets.NAME.timeout_s": "cap of one attempt, in seconds",
    "targets.NAME.stream_idle_timeout_s": "longest gap between two chunks of a stream, in s",
    "targets.NAME.max_connections": "connections open to the target at once (a call or stream: 1)",
    "targets.NAME.connection_wait_s": "longest wait for a free connection, then CAPACITY_EXCEEDED",
    "targets.NAME.retry": "which failures are retried and how long to wait",
    "targets.NAME.retry.max_retries": "retries at most (the envelope's `max_retries` is capped)",
    "targets.NAME.retry.backoff_base_s": "first backoff, doubled per retry (full jitter)",
    "targets.NAME.retry.backoff_max_s": "longest backoff between two attempts, in seconds",
    "targets.NAME.retry.retry_on": "statuses (429, 5xx) and failure kinds that are retried",
    "targets.NAME.retry.resend_unanswered": (
        "a connection reset before the answer is sent again (and may fail over) without "
        "an idempotency key, on the dialect's inference endpoints (docs/features/retries.md); "
        "`null`: on with a provider `usage`; `true` needs one"
    ),
    "targets.NAME.circuit_breaker": "per-target breaker; `null` turns it off",
    "targets.NAME.circuit_breaker.fail_max": "consecutive failed attempts that open it",
    "targets.NAME.circuit_breaker.reset_timeout_s": "seconds open before one probe goes through",
    "targets.NAME.usage": "the provider dialect that usage, streams and errors are read in",
    "targets.NAME.idempotency": "one upstream call per idempotency key",
    "targets.NAME.idempotency.header": "header the key is sent in, on every attempt",
    "targets.NAME.idempotency.methods": "methods that get a key",
    "targets.NAME.idempotency.ttl_s": "how long an answer is stored for replay, in seconds",
    "targets.NAME.idempotency.scope": "`local` (this sidecar) or `cluster` (Redis)",
    "targets.NAME.forward_headers": "headers the agent may set in the envelope's `headers`",
    "targets.NAME.static_headers": "headers always sent (e.g. `anthropic-version`)",
    "targets.NAME.mcp": "an MCP server: tool and argument rules",
    "targets.NAME.approval": "calls that wait for a person's yes (APPROVAL_PENDING)",
    "targets.NAME.approval.tools": "MCP tool names (globs) whose calls need approval",
    "targets.NAME.approval.endpoints": "endpoints (globs) and methods whose calls need approval",
    "targets.NAME.approval.endpoints.path": "a glob over the envelope's endpoint",
    "targets.NAME.approval.endpoints.methods": "the methods that need approval",
    "targets.NAME.approval.approvers": "operator names who may decide (empty: any operator)",
    "targets.NAME.approval.ttl_s": "seconds a request waits for a decision, and an approval "
    "for its call",
    "targets.NAME.approval.retry_after_s": "the `suggested_retry_after` of APPROVAL_PENDING, s",
    "targets.NAME.mcp.tools": "which tools may be called",
    "targets.NAME.mcp.tools.allow": "tool names or globs allowed (`*`: any run of characters)",
    "targets.NAME.mcp.tools.deny": "tool names or globs refused; wins over allow",
    "targets.NAME.mcp.arguments": "per tool (name or glob), per argument: constraints",
    "targets.NAME.mcp.arguments.NAME.NAME": "the constraints of one argument",
    "targets.NAME.mcp.arguments.NAME.NAME.pattern": "regular expression the whole string matches",
    "targets.NAME.mcp.arguments.NAME.NAME.enum": "the values allowed",
    "targets.NAME.mcp.arguments.NAME.NAME.max_length": "longest string, in characters",
    "targets.NAME.mcp.arguments.NAME.NAME.min_length": "shortest string, in characters",
    "targets.NAME.mcp.arguments.NAME.NAME.minimum": "smallest number",
    "targets.NAME.mcp.arguments.NAME.NAME.maximum": "largest number",
    "targets.NAME.mcp.arguments.NAME.NAME.type": "JSON type of the argument",
    "targets.NAME.mcp.arguments.NAME.NAME.required": "the argument must be present",
    "targets.NAME.mcp.tools_rate_limit_group": "group that `tools/call` requests are counted in",
    "targets.NAME.database": (
        "a database reached by named statements only ([Database targets](../api/databases.md))"
    ),
    "targets.NAME.database.engine": (
        "the database engine (PostgreSQL, through asyncpg: the `database` extra)"
    ),
    "targets.NAME.database.dsn": ("`postgresql://HOST[:PORT]/DBNAME`: never a user or password"),
    "targets.NAME.database.credential": (
        "who the sidecar connects as: a Vault role, or two secret references"
    ),
    "targets.NAME.database.credential.vault_database_role": (
        "role of Vault's database secrets engine: one lease per sidecar"
    ),
    "targets.NAME.database.credential.mount": ("mount of the database secrets engine"),
    "targets.NAME.database.credential.user_ref": (
        "secret reference of the user (with `password_ref`)"
    ),
    "targets.NAME.database.credential.password_ref": ("secret reference of the password"),
    "targets.NAME.database.pool": ("the connection pool"),
    "targets.NAME.database.pool.max_size": ("most connections open at once"),
    "targets.NAME.database.pool.acquire_timeout_s": (
        "longest wait for a free connection (then CAPACITY_EXCEEDED), s"
    ),
    "targets.NAME.database.pool.max_lifetime_s": (
        "a pool's life before it is replaced, s: shorter than the lease"
    ),
    "targets.NAME.database.session": ("limits set on each transaction with SET LOCAL (0: none)"),
    "targets.NAME.database.session.statement_timeout_s": ("PostgreSQL's `statement_timeout`, s"),
    "targets.NAME.database.session.lock_timeout_s": ("PostgreSQL's `lock_timeout`, s"),
    "targets.NAME.database.statements": (
        "the statements agents may run, by name (the endpoint `/NAME`)"
    ),
    "targets.NAME.database.statements.NAME": (
        "one statement: exactly one SQL statement with `$1..$N` parameters"
    ),
    "targets.NAME.database.statements.NAME.mode": (
        "`read` (GET, a READ ONLY transaction) or `write` (POST)"
    ),
    "targets.NAME.database.statements.NAME.sql": (
        "the SQL, prepared at start and bound server-side; never templated"
    ),
    "targets.NAME.database.statements.NAME.params": ("the parameters, in `$1..$N` order"),
    "targets.NAME.database.statements.NAME.params.name": (
        "its name in the envelope's `parameters`"
    ),
    "targets.NAME.database.statements.NAME.params.type": ("JSON type of the value"),
    "targets.NAME.database.statements.NAME.params.required": (
        "the value must be given (else NULL when absent)"
    ),
    "targets.NAME.database.statements.NAME.params.pattern": (
        "regular expression the whole string matches"
    ),
    "targets.NAME.database.statements.NAME.params.enum": ("the values allowed"),
    "targets.NAME.database.statements.NAME.params.max_length": ("longest string, in characters"),
    "targets.NAME.database.statements.NAME.params.min_length": ("shortest string, in characters"),
    "targets.NAME.database.statements.NAME.params.minimum": ("smallest number"),
    "targets.NAME.database.statements.NAME.params.maximum": ("largest number"),
    "targets.NAME.database.statements.NAME.max_rows": ("most rows answered"),
    "targets.NAME.database.statements.NAME.max_bytes": ("most bytes of JSON rows answered"),
    "targets.NAME.database.statements.NAME.on_limit": (
        "past a limit: truncate (`truncated: true`) or error (RESPONSE_TOO_LARGE)"
    ),
    "targets.NAME.database.statements.NAME.timeout_s": (
        "the statement's own timeout, s (the session's and the call's bound it too)"
    ),
    "targets.NAME.database.statements.NAME.max_affected_rows": (
        "a write touching more rows is rolled back (UPSTREAM_REJECTED)"
    ),
    "targets.NAME.database.statements.NAME.idempotent": (
        "a write that may be sent again when its outcome was lost"
    ),
    "rate_limit_groups": "token buckets shared by the calls that name them",
    "rate_limit_groups.NAME": "one group",
    "rate_limit_groups.NAME.requests_per_second": "sustained rate r: at most B + r*T calls "
    "in T seconds",
    "rate_limit_groups.NAME.burst": "bucket size B",
    "rate_limit_groups.NAME.tokens_per_minute": "a second bucket of LLM tokens",
    "rate_limit_groups.NAME.max_queue_s": "longest wait for capacity, in seconds",
    "rate_limit_groups.NAME.scope": "`local` (this sidecar) or `cluster` (Redis)",
    "rate_limit_groups.NAME.on_redis_error": "with Redis down: own bucket, or refuse",
    "rate_limit_groups.NAME.mode": "`shadow`: never waits or refuses, records what it would do",
    "secrets": "secret stores",
    "secrets.vault": "Vault (or OpenBao) KV, see Vault",
    "secrets.vault.address": "Vault's URL (`VAULT_ADDR` otherwise)",
    "secrets.vault.namespace": "Vault Enterprise namespace (`VAULT_NAMESPACE` otherwise)",
    "secrets.vault.auth": "how the sidecar logs in to Vault",
    "secrets.vault.auth.method": "`token`, `kubernetes` or `approle`",
    "secrets.vault.auth.token_file": "file holding the token (`VAULT_TOKEN` otherwise)",
    "secrets.vault.auth.role": "Vault role (kubernetes auth)",
    "secrets.vault.auth.jwt_path": "service-account token file (kubernetes auth)",
    "secrets.vault.auth.mount_path": "the auth method's mount path",
    "secrets.vault.auth.role_id_file": "file holding the AppRole role id",
    "secrets.vault.auth.secret_id_file": "file holding the AppRole secret id",
    "secrets.vault.kv_mount": "KV mount of `vault://` references",
    "secrets.vault.kv_version": "KV engine version",
    "secrets.vault.refs": "explicit mappings of `vault://` references",
    "secrets.vault.refs.NAME": "one reference's mount, version, path and field",
    "secrets.vault.refs.NAME.mount": "KV mount",
    "secrets.vault.refs.NAME.kv_version": "KV engine version",
    "secrets.vault.refs.NAME.path": "secret path",
    "secrets.vault.refs.NAME.field": "field of the secret",
    "secrets.vault.cache_ttl_s": "how long a read secret is cached, in seconds",
    "secrets.vault.stale_if_error_s": "how long a cached secret serves while Vault fails",
    "secrets.vault.timeout_s": "timeout of one Vault request, in seconds",
    "secrets.vault.ca_cert": "CA bundle file for Vault's TLS",
    "secrets.vault.skip_verify": "do not verify Vault's TLS certificate (development only)",
    "redis": "the Redis of `scope: cluster` (`REDIS_URL` overrides the URL)",
    "redis.url": "Redis URL",
    "redis.key_prefix": "prefix of every key the sidecar writes",
    "redis.pool_size": "connections at most",
    "redis.socket_timeout_s": "timeout of one command, in seconds",
    "redis.connect_timeout_s": "timeout of a connection, in seconds",
    "audit": "where audit records go",
    "audit.sink": "`stdout` (JSON lines) or `file` (size-rotated)",
    "audit.otlp": "also ship every audit line to an OpenTelemetry collector (OTLP/HTTP "
    "logs) through a bounded on-disk spool; headers from `OTEL_EXPORTER_OTLP_LOGS_HEADERS`",
    "audit.otlp.endpoint": "the collector's logs URL, e.g. `http://otel-collector:4318/v1/logs`",
    "audit.otlp.timeout_s": "timeout of one export, in seconds",
    "audit.otlp.spool_path": "directory of the spool (lines not yet accepted by the collector)",
    "audit.otlp.spool_max_bytes": "spool size; past it the oldest lines are dropped from "
    "shipping (still in the file or stdout sink)",
    "audit.path": "the file, with `sink: file`",
    "audit.payloads": "`summary` (sizes and hashes) or `none`",
    "audit.chain": "hash-chain the records (`seq`, `prev_hash`, `hash`)",
    "audit.max_bytes": "rotate the file past this size, in bytes",
    "audit.backup_count": "rotated files kept",
    "telemetry": "traces and model labels",
    "telemetry.tracing": "OpenTelemetry traces over OTLP/HTTP",
    "telemetry.tracing.endpoint": "OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` otherwise)",
    "telemetry.tracing.service_name": "the spans' `service.name`",
    "telemetry.tracing.sample_ratio": "share of calls traced",
    "telemetry.models": "model names (globs) that get their own metric label",
    "budgets": "spend limits in USD",
    "budgets.NAME": "one budget",
    "budgets.NAME.limit_usd": "spend allowed per window, in USD (this or `max_calls`)",
    "budgets.NAME.max_calls": "calls allowed per window: a tool cap (this or `limit_usd`)",
    "budgets.NAME.applies_to.tool": "calls of this MCP tool or endpoint path (`*` globs)",
    "budgets.NAME.window": "`daily`, `monthly` (UTC calendar) or `rolling`",
    "budgets.NAME.per_hours": "length of a rolling window, in hours",
    "budgets.NAME.applies_to": "the calls it counts (all keys given must match)",
    "budgets.NAME.applies_to.target": "calls to this target",
    "budgets.NAME.applies_to.rate_limit_group": "calls in this rate-limit group",
    "budgets.NAME.applies_to.agent": "calls of this agent",
    "budgets.NAME.scope": "`local` (this sidecar) or `cluster` (Redis)",
    "budgets.NAME.mode": "`shadow`: books and records, never refuses",
    "budgets.NAME.max_output_tokens": "output cap assumed for a call that sets no "
    "`max_tokens` (none: such a call is refused)",
    "budgets.NAME.on_unknown_price": "a call whose price is unknown is refused or allowed",
    "budgets.NAME.on_redis_error": "with Redis down: refuse, or count locally",
    "prices": "per-model prices that win over genai-prices",
    "prices.NAME": "one model's prices, USD per million tokens",
    "prices.NAME.input_usd_per_mtok": "input tokens",
    "prices.NAME.output_usd_per_mtok": "output tokens",
    "prices.NAME.cached_usd_per_mtok": "cached input tokens (the input price otherwise)",
    "prices.NAME.cache_write_usd_per_mtok": "cache writes (the input price otherwise)",
    "agents": "the agents of one pod: how each is recognised, what each may use",
    "agents.NAME": "one agent (`uid` and/or `token_ref`)",
    "agents.NAME.uid": "the UID its processes run as (recognised first)",
    "agents.NAME.token_ref": "secret reference of its token (header `x-egress-agent-token`)",
    "agents.NAME.targets": "the targets it may call (absent: every target)",
    "agents.NAME.rate_limit_group": "a group of `rate_limit_groups` each of its calls takes "
    "once, besides the call's own group: its pace (absent: none)",
    "controls": "the operator's stop switch and the repeated-call breaker",
    "controls.operator_token_ref": "secret reference of the ops API's stop/resume token "
    "(absent: those routes refuse every request)",
    "controls.stop_switch": "where stops live",
    "controls.stop_switch.scope": "`local` (this sidecar) or `cluster` (Redis: every sidecar)",
    "controls.stop_switch.on_redis_error": "with Redis down: keep the last state read, or "
    "refuse every call (AGENT_STOPPED)",
    "controls.stop_switch.poll_interval_s": "seconds between reads of the cluster's stops",
    "controls.repeated_calls": "the same call more than `max_repeats` times in `window_s` "
    "is REPEATED_CALL",
    "controls.repeated_calls.max_repeats": "repeats allowed in the window",
    "controls.repeated_calls.window_s": "the window, in seconds",
    "controls.repeated_calls.scope": "`local` (this sidecar) or `cluster` (Redis)",
    "controls.repeated_calls.mode": "`shadow`: records the refusal it would give",
    "controls.repeated_calls.on_redis_error": "with Redis down: count locally, or refuse",
    "controls.repeat_exempt": "endpoint paths or MCP tool names never counted (`*` globs)",
    "operators": "who may use the ops routes, the CLI and the console",
    "operators.NAME": "one operator",
    "operators.NAME.token_ref": "secret reference of the operator's bearer token",
    "approvals": "where approval requests live",
    "approvals.scope": "`local` (this process) or `cluster` (Redis, every sidecar)",
    "dead_letters": "the calls that failed for good, kept for an operator",
    "dead_letters.max_count": "dead letters kept at most (the oldest dropped first)",
    "dead_letters.max_bytes": "bytes of stored requests kept at most",
    "chain": "the call chain of agents calling agents",
    "chain.max_depth": "agents in a chain at most, this one included",
    "chain.ttl_s": "seconds a chain started here lives",
    "chain.max_clock_skew_s": "seconds a received deadline may lie past now + ttl_s",
    "chain.signing_key_ref": "secret reference of the fleet's HMAC key",
    "chain.previous_signing_key_ref": "the previous key, accepted while rotating",
    "chain.require_signed_inbound": "refuse a chain without a valid signature",
}


def _class_source(model: type[BaseModel]) -> str:
    """The text of ``class Model(...):`` and its body, from its module's file. Not
    inspect.getsource: it parses the module with ``ast``, which CPython 3.11 refuses
    ("AST constructor recursion depth mismatch") in a process that once hit a
    RecursionError, as the test suite's deep-nesting tests do."""
    path = inspect.getsourcefile(model)
    if path is None:
        return ""
    lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    start = next((i for i, t in enumerate(lines) if t.startswith(f"class {model.__name__}(")), None)
    if start is None:
        return ""
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].strip() and lines[i][0] not in " \t#"),
        len(lines),
    )
    return "".join(lines[start:end])


def _comments(model: type[BaseModel]) -> dict[str, str]:
    """The comment written after each field of ``model``'s class body, by field name."""
    source = _class_source(model)
    found: dict[str, str] = {}
    last_name = ""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    for tok in tokens:
        if tok.type == tokenize.NAME and tok.start[1] == 4 and tok.string not in ("def", "@"):
            last_name = tok.string
        elif tok.type == tokenize.COMMENT and last_name and tok.start[1] > 4:
            text = tok.string.lstrip("#").strip()
            if not text.startswith(("type:", "noqa")):
                found.setdefault(last_name, text)
        elif tok.type == tokenize.NEWLINE:
            last_name = ""
    return found


def _bounds(metadata: list[Any]) -> list[str]:
    """``>= 0``, ``<= 3600``, ``1..64 items``, ``pattern ...`` from a field's metadata."""
    out: list[str] = []
    symbols = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
    for item in metadata:
        for attr, symbol in symbols:
            value = getattr(item, attr, None)
            if isinstance(item, annotated_types.BaseMetadata) and value is not None:
                out.append(f"{symbol} {value:,}" if isinstance(value, int) else f"{symbol} {value}")
        for attr, words in (("min_length", "at least {} long"), ("max_length", "at most {} long")):
            value = getattr(item, attr, None)
            if value is not None:
                out.append(words.format(value))
        pattern = getattr(item, "pattern", None)
        if isinstance(pattern, str):
            out.append(f"matches `{pattern}`")
    return out


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """An annotation without ``Annotated``, and the metadata it carried."""
    metadata: list[Any] = []
    while typing.get_origin(annotation) is typing.Annotated:
        metadata.extend(annotation.__metadata__)
        annotation = annotation.__origin__
    return annotation, metadata


def _type_name(annotation: Any) -> str:
    """A reader's name of a type: ``number``, ``list of string``, ``"a" | "b"``."""
    annotation, metadata = _unwrap(annotation)
    origin = typing.get_origin(annotation)
    validated = any(type(m).__name__ == "PlainValidator" for m in metadata)
    if validated and "Network" in str(annotation):
        return "CIDR string"
    if annotation is type(None):
        return "null"
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in typing.get_args(annotation)]
        return " or ".join(dict.fromkeys(names))
    if origin is list:
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if origin is dict:
        return f"mapping of {_type_name(typing.get_args(annotation)[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    names = {bool: "boolean", int: "integer", float: "number", str: "string"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "see its keys"
    return f"`{json.dumps(value, default=str)}`"


def _nested(annotation: Any) -> tuple[str, type[BaseModel]] | None:
    """The model a field holds and the key-path suffix to reach its keys: ``""`` for a
    model or a list of models, ``".NAME"`` per mapping level."""
    annotation, _ = _unwrap(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _nested(arg)
            if found:
                return found
        return None
    if origin is list:
        return _nested(typing.get_args(annotation)[0])
    if origin is dict:
        found = _nested(typing.get_args(annotation)[1])
        return (f".{NAME}{found[0]}", found[1]) if found else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return ("", annotation)
    return None


def _key_bounds(annotation: Any) -> list[str]:
    """Bounds of a mapping's names (``targets.NAME``: the name pattern)."""
    annotation, _ = _unwrap(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [b for arg in typing.get_args(annotation) for b in _key_bounds(arg)]
    if typing.get_origin(annotation) is dict:
        _, metadata = _unwrap(typing.get_args(annotation)[0])
        return ["names " + b.replace("matches", "match") for b in _bounds(metadata)]
    return []


def _rows(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, FieldInfo, str]]:
    """Every key under ``model`` depth first: (key path, field, description)."""
    comments = _comments(model)
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        words = field.description or DESCRIPTIONS.get(path) or comments.get(name, "")
        yield path, field, words
        nested = _nested(field.annotation)
        if nested:
            suffix, inner = nested
            if suffix:
                yield (
                    f"{path}{suffix}",
                    FieldInfo(annotation=inner),
                    DESCRIPTIONS.get(f"{path}{suffix}", ""),
                )
            yield from _rows(inner, f"{path}{suffix}.")


def _examples() -> list[tuple[str, Any]]:
    return [(p.name, yaml.safe_load(p.read_text(encoding="utf-8"))) for p in EXAMPLE_FILES]


def _lookup(data: Any, parts: list[str]) -> Iterator[Any]:
    """Values at a key path in parsed YAML; NAME matches any key, lists are walked."""
    if not parts:
        yield data
    elif isinstance(data, list):
        for item in data:
            yield from _lookup(item, parts)
    elif isinstance(data, dict):
        keys = list(data) if parts[0] == NAME else [parts[0]] if parts[0] in data else []
        for key in keys:
            yield from _lookup(data[key], parts[1:])


def _example(path: str, policies: list[tuple[str, Any]]) -> str:
    for filename, data in policies:
        for value in _lookup(data, path.split(".")):
            too_long = isinstance(value, dict | list) and len(json.dumps(value)) > 60
            if value in ({}, []) or too_long:
                continue
            text = json.dumps(value, ensure_ascii=False).replace("|", "\\|")
            return f"`{text}` ({filename})"
    return ""


HEADER: Final = """# Policy reference

<!-- Generated by docs/gen_policy_reference.py from gateway/policy/ (models.py, stores.py,
budgets.py, chain.py, mcp.py): do not edit; run `make docs`. -->

Every key of a policy file, generated from the models the sidecar loads it with, so it
cannot drift from the code. `NAME` stands for a name you choose (a target, a group, a
budget); names match `^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$` unless the bounds say otherwise.
Every mapping refuses unknown keys and every value is strictly typed (`"8181"` is not a
port). Bounds are in the key's unit (`_s` seconds, `_bytes` bytes, `_usd` US dollars).
Examples are taken from the policies shipped in `policies/`. How the file is read
(anchors, aliases, limits) is on [Policy format](policy-format.md); check a file with
`egress-gateway validate FILE`.
"""


def render() -> str:
    """The whole page, Markdown."""
    policies = _examples()
    out = [HEADER]
    section = ""
    for path, field, words in _rows(Policy, ""):
        top = path.split(".")[0]
        if top != section:
            section = top
            out.append(f"\n## `{top}`\n")
            out.append("| key | type | default | bounds | description | example |")
            out.append("|---|---|---|---|---|---|")
        bounds = _bounds(field.metadata) + _bounds(_unwrap(field.annotation)[1])
        bounds += _key_bounds(field.annotation)
        cells = [
            f"`{path}`",
            _type_name(field.annotation).replace("|", "\\|").replace("\\\\|", "\\|"),
            _default(field),
            ", ".join(bounds),
            words,
            _example(path, policies),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def missing_descriptions() -> list[str]:
    """Key paths that have no description anywhere (the test wants none)."""
    return [path for path, _, words in _rows(Policy, "") if not words]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/reference/policy.md.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        if current != page:
            print(f"{PAGE} is stale: run make docs", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

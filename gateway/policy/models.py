"""The policy's section models: the server, egress, targets (credential, endpoints, retry,
circuit breaker, idempotency, headers), rate-limit groups and telemetry sections, every
key with its type, default and checks. The other sections have modules of their own; the
root that holds them all, and the checks across sections, is :mod:`gateway.policy.root`.

The policy is the operator's contract with the sidecar: keys may be added, never renamed.
Every model forbids unknown keys and is strictly typed (``port: "8181"`` is an error).
Every optional key has a default, and every number a bound the runtime can honour, each
defined once in :mod:`gateway.policy.defaults` with its reason; ``.inf`` and ``.nan``
are refused wherever a number is taken.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Final, Literal

from pydantic import Field, PlainValidator, StringConstraints, field_validator, model_validator
from pydantic_core import PydanticCustomError

from gateway.envelope import HttpMethod
from gateway.policy import defaults as d
from gateway.policy import desk
from gateway.policy.a2a import A2aSpec, check_a2a_target
from gateway.policy.budgets import Mode
from gateway.policy.chain import CallChainSpec
from gateway.policy.database import DatabaseSpec
from gateway.policy.database import check_target as check_database_target

# Re-exported: gateway.idempotency.memory imports them from here.
from gateway.policy.defaults import (
    DEFAULT_IDEMPOTENCY_MAX_BYTES as DEFAULT_IDEMPOTENCY_MAX_BYTES,
)
from gateway.policy.defaults import (
    DEFAULT_IDEMPOTENCY_MAX_ENTRIES as DEFAULT_IDEMPOTENCY_MAX_ENTRIES,
)
from gateway.policy.failover import FallbackOn, FallbackSpec
from gateway.policy.mcp import McpSpec, check_target
from gateway.policy.modelrules import ModelsSpec
from gateway.policy.refs import check_ref as _check_ref
from gateway.policy.stores import StrictModel as _Strict
from gateway.urls import URL

Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")]
Scope = Literal["local", "cluster"]
InflightBytes = Annotated[int, Field(ge=d.MIN_INFLIGHT_REQUEST_BYTES, le=d.MAX_INFLIGHT_BYTES)]

_KINDS: Final = {bool: "a boolean", int: "a number", float: "a number", dict: "a mapping"}
_RETRY_CONDITIONS: Final = ("timeout", "connect")


def _cidr(value: Any) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    # Only a string is a CIDR: YAML reads ``10`` and ``10.0`` as numbers, and
    # ``ip_network(10)`` is 0.0.0.10/32, which is not what the writer meant.
    if not isinstance(value, str):
        kind = _KINDS.get(type(value), "null" if value is None else f"a {type(value).__name__}")
        message = "a CIDR is written as a string such as '10.0.0.0/8' (got {kind})"
        raise PydanticCustomError("cidr_type", message, {"kind": kind})
    try:
        return ipaddress.ip_network(value)
    except ValueError as exc:
        message = "not a CIDR such as '10.0.0.0/8': {reason}"
        raise PydanticCustomError("cidr", message, {"reason": str(exc)[:200]}) from None


def _retry_on(value: Any) -> int | str:
    # One check instead of an int | Literal union: a union's member names would show in
    # error locations (and YAML's ``true`` is no status).
    if (isinstance(value, int) and not isinstance(value, bool)) or value in _RETRY_CONDITIONS:
        return value  # type: ignore[no-any-return]
    message = "must be an HTTP status (429, 5xx) or 'timeout' or 'connect'"
    raise PydanticCustomError("retry_on", message)


#: A network of ``egress.allow_cidrs`` / ``deny_cidrs``: a string, ``10.0.0.0/8``.
Cidr = Annotated[ipaddress.IPv4Network | ipaddress.IPv6Network, PlainValidator(_cidr)]
#: A ``retry_on`` item: a status (429 or 5xx, checked by the list) or a failure kind.
RetryOn = Annotated[int | Literal["timeout", "connect"], PlainValidator(_retry_on)]
#: A header name: an RFC 9110 token.
HEADER_NAME: Final = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
#: What a header value may not hold: control characters other than HTAB (RFC 9110 5.5).
HEADER_VALUE_FORBIDDEN: Final = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_PATH_PATTERN = re.compile(r"^(/([A-Za-z0-9_.~\-:@!$&'()+,;=]+|\*|\*\*))+/?$|^/$")
#: Headers an envelope may never set, whatever the policy says (hop-by-hop, framing,
#: routing and credentials belong to the sidecar).
FORBIDDEN_FORWARD_HEADERS: Final = frozenset(
    h.lower()
    for h in (
        "Host",
        "Authorization",
        "Proxy-Authorization",
        "Cookie",
        "Content-Length",
        "Transfer-Encoding",
        "Connection",
        "Upgrade",
        "TE",
        "Trailer",
        "Keep-Alive",
        "Expect",
        "X-Api-Key",
        "Api-Key",
        "X-Egress-Agent-Token",  # gateway.agents.identity: the agent's, never an upstream's
    )
)


class ShutdownSpec(_Strict):
    """What the sidecar does between SIGTERM and its exit (docs/running.md).

    ``accept_new_calls``: during ``server.drain_s`` new calls are still served (readiness
    is false all the same), for an agent that got SIGTERM at the same moment and needs
    its last step to go out; false refuses them with SHUTTING_DOWN (retryable). The
    environment variable ``GATEWAY_SHUTDOWN_ACCEPT_NEW_CALLS`` overrides it (the chart
    sets it false for a native sidecar, which Kubernetes stops after the agent exited).
    ``quiet_s``: with ``accept_new_calls``, the process exits once nothing has been in
    flight and no call has arrived for this long (seconds), or when ``drain_s`` runs out.
    """

    accept_new_calls: bool = d.DEFAULT_SHUTDOWN_ACCEPT_NEW_CALLS
    quiet_s: float = Field(d.DEFAULT_SHUTDOWN_QUIET_S, ge=0, le=d.MAX_SHUTDOWN_QUIET_S)


class ServerSpec(_Strict):
    host: str = d.DEFAULT_HOST
    port: int = Field(d.DEFAULT_PORT, ge=0, le=65535)
    # The ops listener serves only /healthz, /readyz and /metrics, so kubelet probes and
    # scrapers can reach it on the pod IP while the calls API stays on loopback.
    ops_host: str = d.DEFAULT_HOST
    ops_port: int | None = Field(d.DEFAULT_OPS_PORT, ge=0, le=65535)
    max_request_bytes: int = Field(d.DEFAULT_MAX_REQUEST_BYTES, ge=1024, le=d.MAX_BODY_BYTES)
    max_response_bytes: int = Field(d.DEFAULT_MAX_RESPONSE_BYTES, ge=1024, le=d.MAX_BODY_BYTES)
    max_inflight_request_bytes: InflightBytes = d.DEFAULT_MAX_INFLIGHT_REQUEST_BYTES
    drain_s: float = Field(d.DEFAULT_DRAIN_S, ge=0, le=d.MAX_WAIT_S)
    shutdown: ShutdownSpec = Field(default_factory=ShutdownSpec)
    reload_interval_s: float = Field(
        d.DEFAULT_RELOAD_INTERVAL_S, ge=0, le=d.MAX_WAIT_S
    )  # 0: SIGHUP
    debug: bool = False  # stack traces in UNKNOWN answers: development only
    # Bounds of the in-memory idempotency store (scope: local): completed answers are
    # evicted closest to their expiry first; the main lever on the sidecar's memory.
    idempotency_max_entries: int = Field(
        d.DEFAULT_IDEMPOTENCY_MAX_ENTRIES, ge=1, le=d.MAX_IDEMPOTENCY_ENTRIES
    )
    idempotency_max_bytes: int = Field(
        d.DEFAULT_IDEMPOTENCY_MAX_BYTES, ge=4096, le=d.MAX_IDEMPOTENCY_STORE_BYTES
    )


class EnvelopeSpec(_Strict):
    unknown_fields: Literal["reject", "warn"] = "reject"


class EgressSpec(_Strict):
    """Which resolved addresses the sidecar may connect to.

    An address is allowed when it is global (``ipaddress.is_global``) or inside
    ``allow_cidrs``, and not inside ``deny_cidrs``: deny wins. So by default loopback,
    RFC 1918, link-local (the cloud metadata service), CGNAT and ULA ranges are refused.
    """

    allow_cidrs: list[Cidr] = Field(default_factory=list)
    deny_cidrs: list[Cidr] = Field(default_factory=list)

    def allows(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        address = _embedded_ipv4(address)
        if any(address in net for net in self.deny_cidrs):
            return False
        if any(address in net for net in self.allow_cidrs):
            return True
        return address.is_global and not address.is_multicast


_NAT64: Final = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052 well-known prefix


def _embedded_ipv4(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The IPv4 address an IPv6 one reaches (mapped, NAT64, 6to4), checked as IPv4: so
    ``64:ff9b::a9fe:a9fe`` is the metadata address 169.254.169.254."""
    if isinstance(address, ipaddress.IPv4Address):
        return address
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    return address


class CredentialSpec(_Strict):
    """How a resolved secret is attached: a header (with ``format``) or a query parameter."""

    header: str | None = None
    query_param: str | None = None
    format: str = "{secret}"
    default_ref: str | None = None
    allowed_refs: list[str] = Field(default_factory=list)
    #: A key pool (gateway.call.keys): used in order, a key cooling after a 429 or a
    #: quota refusal, the next serving; the call's key when it names none.
    refs: list[str] = Field(default_factory=list, max_length=32)

    @field_validator("header")
    @classmethod
    def _header_token(cls, v: str | None) -> str | None:
        if v is not None and not HEADER_NAME.match(v):
            raise ValueError(f"{v!r} is not a valid HTTP header name")
        return v

    @field_validator("format")
    @classmethod
    def _one_placeholder(cls, v: str) -> str:
        if v.count("{secret}") != 1 or v.replace("{secret}", "").count("{") or "\n" in v:
            raise ValueError("must contain '{secret}' exactly once and no other braces")
        return v

    @field_validator("default_ref")
    @classmethod
    def _ref_ok(cls, v: str | None) -> str | None:
        if v is not None:
            _check_ref(v)
        return v

    @field_validator("allowed_refs", "refs")
    @classmethod
    def _refs_ok(cls, v: list[str]) -> list[str]:
        for ref in v:
            _check_ref(ref)
        return v

    @model_validator(mode="after")
    def _placement(self) -> CredentialSpec:
        if (self.header is None) == (self.query_param is None):
            raise ValueError("set exactly one of 'header' or 'query_param'")
        if self.default_ref is None and not self.allowed_refs and not self.refs:
            raise ValueError(
                "set 'default_ref', 'allowed_refs' or 'refs' (which secrets may go here)"
            )
        if self.refs and self.default_ref is not None:
            raise ValueError("set 'refs' (a key pool) or 'default_ref', not both")
        return self

    def permitted_refs(self) -> frozenset[str]:
        refs = set(self.allowed_refs) | set(self.refs)
        if self.default_ref:
            refs.add(self.default_ref)
        return frozenset(refs)


class EndpointRule(_Strict):
    """An allowlisted path pattern: ``*`` matches one segment, a final ``**`` the rest."""

    path: str
    methods: list[HttpMethod] = Field(min_length=1)
    mode: Mode = "enforce"  # shadow: a call only this rule allows is recorded, not refused

    @field_validator("path")
    @classmethod
    def _pattern(cls, v: str) -> str:
        if not _PATH_PATTERN.match(v) or "/../" in v + "/" or "/./" in v + "/":
            raise ValueError(
                f"{v!r} is not a path pattern: use an absolute path of plain segments, "
                "'*' for one segment, a final '**' for any rest"
            )
        if "**" in v and not v.rstrip("/").endswith("/**"):
            raise ValueError("'**' may only be the last segment")
        return v


class RetrySpec(_Strict):
    max_retries: int = Field(d.DEFAULT_POLICY_MAX_RETRIES, ge=0, le=d.MAX_POLICY_MAX_RETRIES)
    backoff_base_s: float = Field(d.DEFAULT_BACKOFF_BASE_S, ge=0, le=d.MAX_BACKOFF_BASE_S)
    backoff_max_s: float = Field(d.DEFAULT_BACKOFF_MAX_S, ge=0, le=d.MAX_CALL_WAIT_S)
    retry_on: list[RetryOn] = Field(default_factory=lambda: list[RetryOn](d.DEFAULT_RETRY_ON))
    #: A request whose connection reset before the answer's head, sent again without an
    #: idempotency key, where a duplicate costs tokens and nothing else (an inference
    #: endpoint of the target's ``usage`` dialect: gateway.providers.resendable). None:
    #: on for a provider dialect's target; ``false``: never (OUTCOME_UNKNOWN, no
    #: fallback); ``true`` needs a provider dialect (``validate`` refuses it on ``none``).
    resend_unanswered: bool | None = None

    @field_validator("retry_on")
    @classmethod
    def _statuses(cls, v: list[RetryOn]) -> list[RetryOn]:
        for item in v:
            if isinstance(item, int) and not (item == 429 or 500 <= item <= 599):
                raise ValueError(
                    f"{item} is not retryable: only 429 and 5xx statuses may be retried "
                    "(other 4xx answers are permanent)"
                )
        return v


class BreakerSpec(_Strict):
    fail_max: int = Field(d.DEFAULT_FAIL_MAX, ge=1, le=d.MAX_FAIL_MAX)
    reset_timeout_s: float = Field(d.DEFAULT_RESET_TIMEOUT_S, gt=0, le=d.MAX_WAIT_S)


class IdempotencySpec(_Strict):
    header: str = "Idempotency-Key"
    methods: list[HttpMethod] = Field(default_factory=lambda: ["POST"])  # type: ignore[arg-type]
    ttl_s: float = Field(d.DEFAULT_IDEMPOTENCY_TTL_S, gt=0, le=d.MAX_IDEMPOTENCY_TTL_S)
    scope: Scope = "local"

    @field_validator("header")
    @classmethod
    def _header_token(cls, v: str) -> str:
        if not HEADER_NAME.match(v):
            raise ValueError(f"{v!r} is not a valid HTTP header name")
        return v


class TargetSpec(_Strict):
    base_url: str | None  # required; a database target has none (it has its DSN)
    credential: CredentialSpec | None = None
    endpoints: list[EndpointRule] | None = Field(None, min_length=1)  # required unless mcp
    rate_limit_group: Name | None = None
    timeout_s: float = Field(d.DEFAULT_TARGET_TIMEOUT_S, gt=0, le=d.MAX_WAIT_S)
    #: Longest gap between two chunks of a relayed stream (the call's deadline still
    #: bounds the whole): reasoning models may think for a while before their first token.
    stream_idle_timeout_s: float = Field(d.DEFAULT_STREAM_IDLE_TIMEOUT_S, gt=0, le=d.MAX_WAIT_S)
    #: Connections to this target open at once (a call, or an open stream, holds one);
    #: a call that finds all busy waits up to ``connection_wait_s``, then gets
    #: CAPACITY_EXCEEDED (retryable, ``details.reason`` "connection_pool_full").
    max_connections: int = Field(d.DEFAULT_MAX_CONNECTIONS, ge=1, le=d.MAX_MAX_CONNECTIONS)
    connection_wait_s: float = Field(d.DEFAULT_CONNECTION_WAIT_S, ge=0, le=d.MAX_WAIT_S)
    retry: RetrySpec = Field(default_factory=RetrySpec)
    circuit_breaker: BreakerSpec | None = Field(default_factory=BreakerSpec)
    usage: Literal["openai", "anthropic", "gemini", "none"] = "none"
    idempotency: IdempotencySpec | None = None
    forward_headers: list[str] = Field(default_factory=list)
    static_headers: dict[str, str] = Field(default_factory=dict)
    mcp: McpSpec | None = None  # an MCP server (gateway.policy.mcp)
    #: Failover (gateway.policy.failover): ordered options, rules, the first-byte limit.
    fallbacks: list[FallbackSpec] = Field(default_factory=list, max_length=8)
    fallback_on: list[FallbackOn] = Field(default_factory=list)
    first_byte_timeout_s: float | None = Field(None, gt=0, le=d.MAX_WAIT_S)
    models: ModelsSpec | None = None  # allow, pin, on_drift (gateway.policy.modelrules)
    approval: desk.ApprovalSpec | None = None  # calls held for a person's yes
    dead_letter: bool = False  # keep calls that failed for good (gateway.policy.desk)
    database: DatabaseSpec | None = None  # named statements (gateway.policy.database)
    call_chain: CallChainSpec = Field(default_factory=CallChainSpec)  # gateway.policy.chain
    _mcp = model_validator(mode="after")(check_target)
    a2a: A2aSpec | None = None  # an A2A agent (gateway.policy.a2a)
    _a2a = model_validator(mode="after")(check_a2a_target)
    _database = model_validator(mode="after")(check_database_target)

    @model_validator(mode="before")
    @classmethod
    def _no_base_url(cls, data: Any) -> Any:
        # A database target's base_url is its DSN: absent, not "Field required".
        if isinstance(data, dict) and "database" in data and "base_url" not in data:
            return {**data, "base_url": None}
        return data

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        # The messages do not echo the URL: user info or a query may hold a credential.
        url = URL(v)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError("must be an absolute http:// or https:// URL with a host")
        host = url.host
        if re.fullmatch(r"[0-9.]+|0[xX][0-9a-fA-F.xX]*", host) and not _canonical_ipv4(host):
            raise ValueError(
                "the host is a numeric form that is not a dotted-quad IPv4 address "
                "(e.g. 2130706433, 127.1, 0177.0.0.1): write the address out in full"
            )
        if url.user or url.password or url.query_string or url.fragment:
            raise ValueError(
                "may hold only scheme, host, port and a base path (no user info, query or "
                "fragment: credentials go in 'credential')"
            )
        return v

    @field_validator("static_headers")
    @classmethod
    def _static(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            if not HEADER_NAME.match(name):
                raise ValueError(f"{name!r} is not a valid HTTP header name")
            if name.lower() in FORBIDDEN_FORWARD_HEADERS:
                raise ValueError(
                    f"{name!r} is set by the sidecar (hosts, framing and credentials never "
                    "come from static headers; credentials belong in 'credential')"
                )
            if HEADER_VALUE_FORBIDDEN.search(value):
                raise ValueError(f"the value of {name!r} contains control characters")
        return v

    @field_validator("forward_headers")
    @classmethod
    def _forwardable(cls, v: list[str]) -> list[str]:
        for name in v:
            if not HEADER_NAME.match(name):
                raise ValueError(f"{name!r} is not a valid HTTP header name")
            if name.lower() in FORBIDDEN_FORWARD_HEADERS:
                raise ValueError(f"{name!r} is set by the sidecar and cannot be forwarded")
        return v


def _canonical_ipv4(host: str) -> bool:
    try:
        return str(ipaddress.IPv4Address(host)) == host
    except ValueError:
        return False


class RateLimitGroupSpec(_Strict):
    """A token bucket: ``burst`` calls at once, refilled at ``requests_per_second``."""

    requests_per_second: float = Field(ge=d.MIN_REQUESTS_PER_SECOND, le=d.MAX_REQUESTS_PER_SECOND)
    burst: int = Field(1, ge=1, le=d.MAX_BURST)
    tokens_per_minute: int | None = Field(None, gt=0, le=d.MAX_TOKENS_PER_MINUTE)
    max_queue_s: float = Field(d.DEFAULT_MAX_QUEUE_S, ge=0, le=d.MAX_CALL_WAIT_S)
    scope: Scope = "local"
    on_redis_error: Literal["fail_open", "fail_closed"] = "fail_open"
    mode: Mode = "enforce"  # shadow: never waits or refuses; a refusal it would give is recorded


#: A model name as ``telemetry.models`` lists it: exact, or a prefix ending in ``*``.
ModelPattern = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+\-]{0,127}\*?$")
]


class TracingSpec(_Strict):
    """OTLP/HTTP trace export (docs/operations.md, "Traces"); the standard ``OTEL_*``
    variables win over these keys. ``endpoint``: the collector's OTLP/HTTP base URL
    (``http://otel-collector:4318``; ``/v1/traces`` is added), none = tracing off.
    ``sample_ratio``: the share of new traces recorded (a parent's sampled flag decides
    for a call that continues the agent's trace)."""

    endpoint: str | None = None
    service_name: Name = d.DEFAULT_SERVICE_NAME
    sample_ratio: float = Field(d.DEFAULT_TRACE_SAMPLE_RATIO, ge=0, le=d.MAX_TRACE_SAMPLE_RATIO)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        url = URL(v) if v is not None else None
        if url is not None and (url.scheme not in ("http", "https") or not url.host):
            raise ValueError("must be an http:// or https:// URL with a host")
        if url is not None and (url.user or url.password or url.query_string):
            raise ValueError("no user info or query: put credentials in OTEL_EXPORTER_OTLP_HEADERS")
        return v


class TelemetrySpec(_Strict):
    """Traces and the model labels of the ``gen_ai_*`` metrics (docs/operations.md).
    ``models``: the model names (or ``prefix*``) that get their own label value; any
    other model is counted as ``_other``."""

    tracing: TracingSpec = Field(default_factory=TracingSpec)
    models: list[ModelPattern] = Field(default_factory=list, max_length=d.MAX_TELEMETRY_MODELS)

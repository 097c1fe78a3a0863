"""The drop-in provider routes, call side (pure, no I/O): an SDK's own HTTP request as an
:class:`ExternalCallRequest` (design.md, "Drop-in provider routes"; docs/api/sdks.md);
what its answer carries back is :mod:`gateway.api.answers`.

``ANY /proxy/{target}/{path}``: ``{path}`` and the query are the endpoint on ``target``,
so an SDK whose ``base_url`` is ``http://127.0.0.1:8181/proxy/openai/v1`` goes through the
same stages as an envelope. :func:`proxy_intake` builds the request:

* body: a JSON object (``application/json``, ``+json`` or untyped) becomes
  ``parameters`` (so token estimates and idempotency fingerprints read it); anything else
  (multipart uploads, audio, a JSON array, text) becomes ``body``, its bytes unchanged
  with their ``Content-Type``. GET, HEAD, DELETE and OPTIONS carry no body.
* headers: the agent's own credentials (``Authorization``, ``x-api-key``, ``api-key``,
  ``x-goog-api-key``; :data:`gateway.providers.CREDENTIAL_HEADERS`) and query items
  named as credentials (:data:`AGENT_QUERY_CREDENTIALS`: ``key``, ``api_key``,
  ``token``, ``access_token``... in any case) are dropped, never forwarded, as are
  hop-by-hop headers (RFC 9110 section 7.6.1) and everything else not listed here
  (:mod:`gateway.call.header_routes` routes them). What passes:
  ``traceparent``/``tracestate``, the target's ``forward_headers`` (as an envelope's
  ``headers``), and, beneath the policy's ``static_headers``, ``Accept`` and the
  headers the providers' SDKs need (:data:`gateway.providers.SDK_HEADERS`:
  ``anthropic-version``, ``anthropic-beta``, ``openai-beta``). SDK telemetry
  (``User-Agent``, ``x-stainless-*``, ``x-goog-api-client``) describes the agent's
  machine and stays here.
* the sidecar's own headers: ``x-egress-secret-ref`` (``api_key_ref``: another of the
  target's ``allowed_refs``), ``x-egress-trace-id`` and ``x-egress-correlation-id`` (else
  the trace-id of a valid ``traceparent``, else generated), ``x-egress-timeout``
  (seconds; else the SDK's own timeout: ``x-stainless-timeout``,
  ``x-stainless-read-timeout``, ``X-Server-Timeout``, at most 600; on a streamed
  request the first two are read timeouts, so 600; else 30, or 600 for a streamed
  request, whose gaps ``stream_idle_timeout_s`` bounds), and
  ``Idempotency-Key`` (the envelope's ``idempotency_key``; for a target without
  ``idempotency`` in the policy it is forwarded as it came, for the upstream to dedupe).
* retries: ``x-stainless-retry-count`` above 0 means the SDK is itself retrying this
  request (the OpenAI and Anthropic SDKs send it on every attempt): the sidecar then
  makes one attempt only, so the two retry loops do not multiply (SDK attempts x sidecar
  attempts). Its first attempt keeps the policy's retries, which know ``Retry-After``,
  the breaker and the deadline; ``max_retries=0`` on the client leaves them all to the
  sidecar.
"""

from __future__ import annotations

import base64
import functools
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from gateway.agents import chain
from gateway.call.bodies import is_json_type, media_type
from gateway.call.header_routes import IDEMPOTENCY_HEADER, split_headers
from gateway.call.intake import decode_json, parse_built, parse_object_fast, printable
from gateway.call.record import CLAIM_LIMIT, Arrival, ArrivalFields
from gateway.envelope import (
    BODY_METHODS,
    DEFAULT_TIMEOUT_S,
    MAX_TIMEOUT_S,
)
from gateway.errors import GatewayError, InvalidPayload
from gateway.policy import PolicySet
from gateway.policy.egress import same_query_name
from gateway.providers import CREDENTIAL_QUERY

#: Methods a drop-in call may use (the envelope's).
METHODS: Final = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
TRACE_ID_HEADER: Final = "x-egress-trace-id"
CORRELATION_ID_HEADER: Final = "x-egress-correlation-id"
_SECRET_REF_HEADER: Final = "x-egress-secret-ref"  # noqa: S105 - a header name
_TIMEOUT_HEADER: Final = "x-egress-timeout"
_SDK_RETRY_HEADER: Final = "x-stainless-retry-count"
#: The SDKs' own timeouts, in seconds (OpenAI and Anthropic; google-genai).
_SDK_TIMEOUT_HEADERS: Final = (
    "x-stainless-timeout",
    "x-stainless-read-timeout",
    "x-server-timeout",
)
_READ_TIMEOUT_HEADERS: Final = frozenset({"x-stainless-timeout", "x-stainless-read-timeout"})
_ALL_TIMEOUT_HEADERS: Final = frozenset({_TIMEOUT_HEADER, *_SDK_TIMEOUT_HEADERS})
OCTETS: Final = "application/octet-stream"
#: Query names under which an agent's own credential may ride (besides the providers'
#: :data:`gateway.providers.CREDENTIAL_QUERY` and the target's own ``query_param``):
#: never forwarded, compared as :func:`gateway.policy.egress.same_query_name` does (any
#: case, ``.`` read as ``_``). The names APIs and OAuth 2.0 (RFC 6750 section 2.3) use.
AGENT_QUERY_CREDENTIALS: Final = frozenset(
    {
        "key",
        "api_key",
        "apikey",
        "api-key",
        "api_token",
        "x-api-key",
        "x-goog-api-key",
        "token",
        "access_token",
        "auth_token",
        "client_secret",
    }
)


class ProxyRequest(NamedTuple):
    """A request on ``/proxy/{target}/{path}`` as the server read it: ``path`` is the rest
    of the path as received (percent-encoded, starting with ``/``), ``query`` its query
    items (decoded), ``headers`` every header line (names in any case, repeats kept).
    A named tuple, not a frozen dataclass: one is made per request, and a frozen
    dataclass sets each field through ``object.__setattr__`` (~1 us for six)."""

    method: str
    target: str
    path: str
    query: tuple[tuple[str, str], ...]
    headers: tuple[tuple[str, str], ...]
    body: bytes


def header_map(headers: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Headers by lower-case name; a repeated name's values joined with ``", "`` (RFC 9110
    section 5.3)."""
    merged = {name.lower(): value for name, value in headers}
    if len(merged) == len(headers):  # no name repeated (the usual request): as built
        return merged
    merged = {}
    for name, value in headers:
        key = name.lower()
        merged[key] = f"{merged[key]}, {value}" if key in merged else value
    return merged


def proxy_intake(
    http: ProxyRequest, policy: PolicySet, refuse: GatewayError | None = None
) -> Arrival | ArrivalFields:
    """The request of a drop-in call (module docstring), validated as an envelope is,
    refused or not: the ids and request line come with a refusal, so that it is audited
    with them. Its refusal: ``refuse`` when given, else :class:`InvalidPayload` (a
    method the sidecar does not forward, a body on GET/HEAD/DELETE/OPTIONS, a bad header
    value)."""
    headers = header_map(http.headers)
    seen = chain.seen_in(headers)
    trace_id, correlation_id = request_ids(headers)
    target, path, method = http.target[:CLAIM_LIMIT], http.path[:CLAIM_LIMIT], http.method
    both = target + path  # _claim's test, inline and on both at once: per call
    if not (both.isascii() and both.isprintable()):
        target, path = printable(target), printable(path)
    claimed = {
        "trace_id": trace_id,
        "correlation_id": correlation_id,
        "target_system": target,
        "endpoint": path,
        "method": method if method in METHODS else _claim(method[:CLAIM_LIMIT]),
    }
    if refuse is not None:
        return Arrival(None, "proxy", claimed, seen, refusal=refuse)
    try:
        raw, parameters, passthrough = _raw(http, policy, headers, trace_id, correlation_id)
    except Exception as exc:  # noqa: BLE001 - the pipeline raises it (ctx.arrived)
        return Arrival(None, "proxy", claimed, seen, refusal=exc)
    warnings = _retrying(headers, raw) if _SDK_RETRY_HEADER in headers else ()
    try:
        intake = parse_built(raw, parameters)
    except Exception as exc:  # noqa: BLE001 - the pipeline raises it (ctx.arrived)
        return Arrival(None, "proxy", claimed, seen, refusal=exc, warnings=warnings)
    # An Arrival's fields as a plain tuple (gateway.call.record.ArrivalFields): per call.
    return (
        intake,
        "proxy",
        claimed,
        seen,
        passthrough,
        warnings,
        None,
        None,
        None,
        None,
        None,
        False,
    )


def _raw(
    http: ProxyRequest,
    policy: PolicySet,
    headers: dict[str, str],
    trace_id: str,
    correlation_id: str,
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, str]]:
    """The envelope (unvalidated) of a drop-in request, less its ``parameters`` (the JSON
    object body, None for none: :func:`gateway.call.intake.parse_built` sets it), and the
    SDK's headers that go upstream. Raises :class:`InvalidPayload` (:func:`proxy_intake`)."""
    method = http.method
    if method not in METHODS:
        raise _method_not_forwarded(method)
    target = policy.targets.get(http.target)
    agent_headers, passthrough = split_headers(headers, target)
    query: dict[str, Any] = {}
    if http.query:
        credential = target.spec.credential if target is not None else None
        dropped = _dropped_query(credential.query_param if credential is not None else None)
        query = _query(http.query, dropped)
    raw: dict[str, Any] = {
        "trace_id": trace_id,
        "correlation_id": correlation_id,
        "target_system": http.target,
        "endpoint": http.path,
        "method": method,
        "headers": agent_headers,
        "query": query,
    }
    parameters = _body(method, http.body, headers.get("content-type"), raw)
    raw["timeout"] = _timeout(headers, streamed=_streamed(parameters, http.path, query))
    ref = headers.get(_SECRET_REF_HEADER)
    if ref is not None:
        raw["api_key_ref"] = ref
    idempotency = target.spec.idempotency if target is not None else None
    # The target's own idempotency header, else the common one.
    key = headers.get(idempotency.header.lower()) if idempotency is not None else None
    if key is None:
        key = headers.get(IDEMPOTENCY_HEADER)
    if key is not None:
        raw["idempotency_key"] = key
    return raw, parameters, passthrough


def _retrying(headers: dict[str, str], raw: dict[str, Any]) -> tuple[str, ...]:
    """An SDK retrying the request (its retry count header above 0) gets one attempt, no
    retries by the sidecar (``raw``'s ``max_retries``: 0), and a warning saying so."""
    retry_count = headers.get(_SDK_RETRY_HEADER, "0").strip()
    if not (retry_count.isdigit() and int(retry_count) > 0):
        return ()
    raw["max_retries"] = 0
    return (
        f"the SDK is retrying this request ({_SDK_RETRY_HEADER}: {retry_count}): one "
        "attempt, no retries by the sidecar",
    )


def request_ids(headers: Mapping[str, str]) -> tuple[str, str]:
    """(trace_id, correlation_id): the ``x-egress-*`` headers, else the trace-id of a
    valid ``traceparent`` (W3C Trace Context 3.2), else generated (UUID4 hex)."""
    given = headers.get(TRACE_ID_HEADER)
    correlation = headers.get(CORRELATION_ID_HEADER)
    if given is None and correlation is None and "traceparent" not in headers:
        return _uuid4_hex_pair()  # none given (an SDK's usual request): both generated
    trace = (given or "").strip()
    if not trace and "traceparent" in headers:
        parts = headers["traceparent"].strip().split("-")
        valid = len(parts) == 4 and len(parts[1]) == 32 and parts[1] != "0" * 32
        trace = parts[1].lower() if valid and _hex(parts[1]) else ""
    correlation = (correlation or "").strip()
    if trace and correlation:
        return _claim(trace[:CLAIM_LIMIT]), _claim(correlation[:CLAIM_LIMIT])
    generated = _uuid4_hex_pair()  # hex digits: nothing to escape
    return (
        _claim(trace[:CLAIM_LIMIT]) if trace else generated[0],
        _claim(correlation[:CLAIM_LIMIT]) if correlation else generated[1],
    )


def _uuid4_hex_pair() -> tuple[str, str]:
    """Two random UUIDs (version 4, RFC 9562 section 5.4) as 32 hex digits each, as
    :func:`uuid.uuid4` makes them (its version and variant bits set on ``os.urandom``),
    from one read of ``os.urandom`` and without its per-UUID checks."""
    raw = bytearray(os.urandom(32))
    # Octet 6 of each: the version (its high nibble: 0100); octet 8: the variant (its two
    # high bits: 10). Written out, not looped: a loop's bytecode doubles the cost.
    raw[6] = raw[6] & 0x0F | 0x40
    raw[22] = raw[22] & 0x0F | 0x40
    raw[8] = raw[8] & 0x3F | 0x80
    raw[24] = raw[24] & 0x3F | 0x80
    text = raw.hex()
    return text[:32], text[32:]


def _claim(text: str) -> str:
    """:func:`gateway.call.intake.printable`, at once for printable ASCII (no control
    character, no surrogate: the text as it came)."""
    return text if text.isascii() and text.isprintable() else printable(text)


def _hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text.lower())


def _method_not_forwarded(method: str) -> InvalidPayload:
    return InvalidPayload(
        f"method {printable(method[:32])} is not forwarded (allowed: {', '.join(sorted(METHODS))})",
        details={"reason": "method", "http_status": 405},
        http_status=405,
    )


@functools.lru_cache(maxsize=16)
def _dropped_query(own: str | None) -> tuple[str, ...]:
    """The query names never forwarded (:func:`_query`), with the target's own
    ``query_param`` (``own``) when it has one."""
    return tuple(CREDENTIAL_QUERY | AGENT_QUERY_CREDENTIALS | ({own} if own else set()))


def _query(items: Iterable[tuple[str, str]], dropped: Iterable[str]) -> dict[str, Any]:
    """The query items as the envelope's ``query`` (a repeated name as a list), without
    those an upstream could read as a credential (:data:`AGENT_QUERY_CREDENTIALS`, the
    SDKs' ``key``, the target's own)."""
    if not items:
        return {}
    names = tuple(dropped)
    query: dict[str, Any] = {}
    for name, value in items:
        if any(same_query_name(name, other) for other in names):
            continue
        if name in query:
            held = query[name]
            query[name] = [*held, value] if isinstance(held, list) else [held, value]
        else:
            query[name] = value
    return query


def _streamed(
    parameters: Mapping[str, Any] | None, endpoint: str, query: Mapping[str, Any]
) -> bool:
    """True when the request asks for a stream: ``"stream": true`` in its JSON body
    (OpenAI, Anthropic), or Gemini's ``:streamGenerateContent`` / ``alt=sse``."""
    if parameters is not None and parameters.get("stream") is True:
        return True
    if endpoint.endswith(":streamGenerateContent"):
        return True
    return bool(query) and query.get("alt") == "sse"


def egress_timeout(headers: Mapping[str, str]) -> float | None:
    """``x-egress-timeout`` in seconds (the envelope's bounds then apply: 0 < t <= 600),
    None when absent. Raises :class:`InvalidPayload` (``invalid_header``) when it is not
    a number."""
    given = headers.get(_TIMEOUT_HEADER)
    if given is None:
        return None
    try:
        return float(given)
    except ValueError:
        raise InvalidPayload(
            f"{_TIMEOUT_HEADER} must be a number of seconds",
            details={"reason": "invalid_header", "header": _TIMEOUT_HEADER},
        ) from None


def _timeout(headers: Mapping[str, str], *, streamed: bool = False) -> Any:
    """The call's deadline in seconds (module docstring). An ``x-egress-timeout`` that is
    not a number is refused; a bad SDK timeout is ignored. The Stainless SDKs' timeouts
    (``x-stainless-*``) are httpx *read* timeouts: on a ``streamed`` request they bound
    each gap between chunks, not the stream (openai-python and anthropic-sdk-python,
    ``_build_headers``), so there they are not the deadline: :data:`MAX_TIMEOUT_S` is,
    and the SDK, which hangs up after such a gap, and ``stream_idle_timeout_s`` bound
    the gaps. A streamed request without any timeout header (a plain HTTP client) gets
    :data:`MAX_TIMEOUT_S` too, not the 30 s default: its stall is found by
    ``stream_idle_timeout_s``, well before."""
    if _ALL_TIMEOUT_HEADERS.isdisjoint(headers):  # none given (a plain client): no lookups
        return MAX_TIMEOUT_S if streamed else DEFAULT_TIMEOUT_S
    given = egress_timeout(headers)
    if given is not None:
        return given
    for name in _SDK_TIMEOUT_HEADERS:
        sdk = headers.get(name)
        if sdk is None:  # not float(""): a raised ValueError costs more than the rest
            continue
        if streamed and name in _READ_TIMEOUT_HEADERS:
            return MAX_TIMEOUT_S
        try:
            seconds = float(sdk)
        except ValueError:
            continue
        if math.isfinite(seconds) and seconds > 0:
            return min(seconds, MAX_TIMEOUT_S)
    # A plain HTTP client's stream: a long generation may outlast 30 s; its gaps are
    # bounded by the target's stream_idle_timeout_s (60 s by default), well under this.
    return MAX_TIMEOUT_S if streamed else DEFAULT_TIMEOUT_S


def _body(
    method: str, body: bytes, content_type: str | None, raw: dict[str, Any]
) -> dict[str, Any] | None:
    """The request's ``parameters`` (a JSON object, returned; the caller sets it), else
    None and its ``body`` (the bytes as they came) set in the request ``raw``."""
    if method not in BODY_METHODS:
        if body:
            raise InvalidPayload(
                f"a {method} request carries no body through the sidecar",
                details={"reason": "body_not_allowed", "method": method},
            )
        return None
    if body and (
        content_type is None or content_type == "application/json" or _json_type(content_type)
    ):
        value = parse_object_fast(body)  # one pass; None: the stdlib's parser decides
        if value is None:
            try:
                value = decode_json(body)
            except InvalidPayload:
                value = None  # not JSON after all: sent as it came, the upstream judges it
        if isinstance(value, dict):
            return value
    content_type = (content_type or "").strip() or (OCTETS if body else "application/json")
    raw["body"] = {"content_type": content_type, "base64": base64.b64encode(body).decode()}
    return None


def _json_type(content_type: str) -> bool:
    """A JSON media type, or none (an empty type: the body is judged by its bytes)."""
    mtype = media_type(content_type)
    return not mtype or is_json_type(mtype)

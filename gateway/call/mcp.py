"""MCP targets, call side (pure, no I/O): an MCP client's HTTP request as an
:class:`ExternalCallRequest`, the tool and argument rules applied before anything is
forwarded, the answers read (``tools/list`` filtered, each request's outcome kept), and
one audit record per JSON-RPC request (design.md, "MCP targets";
docs/api/mcp.md).

``ANY /mcp/{target}``: the agent's MCP client talks to the sidecar as if it were the
server. :func:`mcp_intake` builds the call:

* POST: the body is parsed as JSON-RPC (one message, or a batch: see
  :mod:`gateway.providers.mcp`); ``Mcp-Method`` / ``Mcp-Name`` must describe it; every
  ``tools/call`` is checked against ``mcp.tools`` and ``mcp.arguments``. A refusal is a
  PERMISSION_DENIED (INVALID_PAYLOAD for a body that is not JSON-RPC or headers that do
  not match) and nothing is forwarded. An allowed body goes upstream as its bytes.
* GET (the server's event stream) and DELETE (the end of a session) pass as they are.
* headers: only the transport's (``Accept``, ``Mcp-Session-Id``, ``MCP-Protocol-Version``,
  ``Mcp-Method``, ``Mcp-Name``, ``Mcp-Param-*``, ``Last-Event-ID``) and the trace headers
  go upstream; the agent's ``Authorization`` never does, the target's credential is
  injected. Ids, ``x-egress-timeout`` and ``x-egress-secret-ref`` as on the drop-in
  routes (default deadline :data:`MCP_TIMEOUT_S`: tools may be slow, and a stream open).
* rate-limit groups: a body holding a ``tools/call`` queues in ``mcp.tools_rate_limit_group``
  when the policy names one; everything else in the target's ``rate_limit_group``.
* retries: a body holding a ``tools/call`` is sent once (a tool has side effects, and a
  server's 5xx does not say whether it ran); the protocol's other messages are retried
  as the target's ``retry`` says.

An envelope to an MCP target (``endpoint``: the MCP path, ``parameters``: the JSON-RPC
request) gets the same checks (:func:`check_envelope`) and filtered answers.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, Final

from gateway import fastjson
from gateway.agents import chain
from gateway.audit.schema import Fields as F
from gateway.call.bodies import is_stream_form
from gateway.call.intake import decode_json, parse_request, printable
from gateway.call.proxy import egress_timeout, header_map, request_ids
from gateway.call.record import CLAIM_LIMIT, Arrival, CallContext, Reading
from gateway.envelope import ExternalCallRequest, ExternalCallResponse
from gateway.errors import InvalidPayload, PermissionDenied, StreamInterrupted
from gateway.policy import CompiledTarget, PolicySet
from gateway.policy.compiled import mcp_endpoint
from gateway.policy.mcp import MCP_METHODS, McpSpec
from gateway.providers import mcp as rpc
from gateway.tracing import TRACE_HEADERS

#: The deadline of an MCP exchange without ``x-egress-timeout``, seconds: the ``mcp``
#: SDK's own read timeout for a stream (``sse_read_timeout``, 300 s).
MCP_TIMEOUT_S: Final = 300.0
_SECRET_REF_HEADER: Final = "x-egress-secret-ref"  # noqa: S105 - a header name
#: Method label values of the MCP metrics (anything else is ``_other``).
METHOD_LABELS: Final = frozenset(
    {
        "initialize", "ping", "server/discover", "tools/list", "tools/call", "prompts/list",
        "prompts/get", "resources/list", "resources/read", "resources/templates/list",
        "resources/subscribe", "resources/unsubscribe", "completion/complete",
        "logging/setLevel", "tasks/get", "tasks/list", "tasks/result", "tasks/cancel",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class McpRequest:
    """A request on ``/mcp/{target}`` as the server read it (headers with repeats)."""

    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes


def mcp_intake(http: McpRequest, policy: PolicySet, refuse: Exception | None = None) -> Arrival:
    """The call of one MCP HTTP request (module docstring), refused or not: the ids it
    claims and the parsed exchange come with a refusal, so that it is audited and
    answered per request. Its refusal: ``refuse`` when given, PermissionDenied (not an
    MCP target, a tool or argument refused), InvalidPayload (a method other than POST,
    GET and DELETE; a body that is not JSON-RPC; headers that do not match the body)."""
    headers = header_map(http.headers)
    seen = chain.seen_in(headers)
    trace_id, correlation_id = request_ids(headers)
    target = policy.targets.get(http.target)
    endpoint = mcp_endpoint(target) if target is not None and target.spec.mcp else "/"
    claimed = {
        "trace_id": trace_id,
        "correlation_id": correlation_id,
        "target_system": printable(http.target[:CLAIM_LIMIT]),
        "endpoint": endpoint,
        "method": printable(http.method[:CLAIM_LIMIT]),
    }
    if refuse is None and http.method not in MCP_METHODS:
        refuse = _method_not_mcp(http.method)
    if refuse is not None:
        return Arrival(None, "mcp", claimed, seen, refusal=refuse)
    spec = target.spec.mcp if target is not None else None
    exchange: rpc.McpExchange | None = None
    if http.method == "POST":  # parsed for any target, so that a refusal answers each id
        exchange, problem = _posted(http.body, spec or McpSpec())
        if problem is not None:
            return Arrival(None, "mcp", claimed, seen, refusal=problem, mcp=exchange)
    elif spec is not None:  # a GET's stream may replay answers (resumption): read them
        exchange = rpc.McpExchange(spec, [])
    if target is not None and spec is None:
        return Arrival(
            None, "mcp", claimed, seen, refusal=_not_an_mcp_target(target), decision="denied",
            mcp=exchange,
        )  # fmt: skip
    try:
        raw, refused = _raw(http, target, exchange, headers, endpoint, (trace_id, correlation_id))
        if refused is not None:  # the tool and argument rules
            return Arrival(
                None, "mcp", claimed, seen, refusal=refused, decision="denied", mcp=exchange
            )
        intake = parse_request(raw)
    except Exception as exc:  # noqa: BLE001 - the pipeline raises it (ctx.arrived)
        return Arrival(None, "mcp", claimed, seen, refusal=exc, mcp=exchange)
    return Arrival(intake, "mcp", claimed, seen, _passed_headers(headers), mcp=exchange)


def _raw(
    http: McpRequest,
    target: CompiledTarget | None,
    exchange: rpc.McpExchange | None,
    headers: dict[str, str],
    endpoint: str,
    ids: tuple[str, str],
) -> tuple[dict[str, Any], PermissionDenied | None]:
    """The envelope of an MCP request to ``target`` (None: not in the policy, refused by
    the egress decision), and the refusal of a tool or argument (None: allowed). Raises
    InvalidPayload (a bad ``x-egress-timeout``, headers that do not match the body)."""
    raw: dict[str, Any] = {
        "trace_id": ids[0],
        "correlation_id": ids[1],
        "target_system": http.target,
        "endpoint": endpoint,
        "method": http.method,
        "headers": {k: v for k, v in headers.items() if k in TRACE_HEADERS},
        "timeout": _timeout(headers),
    }
    if _SECRET_REF_HEADER in headers:
        raw["api_key_ref"] = headers[_SECRET_REF_HEADER]
    if exchange is not None and target is not None:
        problem = rpc.header_problem(exchange.messages, headers)
        if problem is not None:
            raise _header_mismatch(problem)
        refused = _refusal(exchange, target)
        if refused is not None:
            return raw, refused
        group = _group(exchange, target)
        if group is not None:
            raw["rate_limit_group"] = group
        if _calls_tools(exchange):
            raw["max_retries"] = 0
    if http.method == "POST":
        raw["body"] = {
            "content_type": "application/json",
            "base64": base64.b64encode(http.body).decode(),
        }
    return raw, None


def _passed_headers(headers: dict[str, str]) -> dict[str, str]:
    """The agent's MCP headers passed to the server as they are (session, protocol
    version, ``Mcp-Param-*``)."""
    return {
        k: v
        for k, v in headers.items()
        if k in rpc.PASSED_HEADERS or k.startswith(rpc.MCP_PARAM_PREFIX)
    }


def _method_not_mcp(method: str) -> InvalidPayload:
    return InvalidPayload(
        f"method {printable(method[:32])} is not part of MCP's streamable HTTP "
        "transport (POST, GET, DELETE)",
        details={"reason": "method", "http_status": 405},
        http_status=405,
    )


def _not_an_mcp_target(target: CompiledTarget) -> PermissionDenied:
    return PermissionDenied(
        f"target {target.name!r} is not an MCP server (it has no 'mcp' section): use "
        f"/proxy/{target.name}/... or an envelope",
        details={"reason": "not_an_mcp_target", "target_system": target.name},
    )


def _header_mismatch(problem: str) -> InvalidPayload:
    return InvalidPayload(
        f"the MCP headers do not match the body: {problem}",
        details={"reason": "mcp_header_mismatch", "jsonrpc_code": rpc.HEADER_MISMATCH},
    )


def _posted(body: bytes, spec: McpSpec) -> tuple[rpc.McpExchange | None, InvalidPayload | None]:
    """The exchange of a POST's ``body`` (None: not JSON-RPC) and its refusal (None: it
    can be read and checked): a body that is not JSON, not JSON-RPC, or holds a key
    twice in one object or in two spellings (forwarded as its bytes: one reading only)."""
    repeated: list[str] = []
    try:
        value = _decode(body, repeated)
    except InvalidPayload as exc:
        return None, exc
    exchange, problem = _exchange(value, spec)
    if problem is None and exchange is not None:
        problem = _refused(repeated_key(repeated))
    return exchange, problem


def _decode(body: bytes, repeated: list[str]) -> Any:
    """The decoded body; the first key found twice in one object goes into ``repeated``."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        if not repeated:
            seen: set[str] = set()
            for key, _ in items:
                if key in seen:
                    repeated.append(key)
                    break
                seen.add(key)
        return dict(items)

    try:
        return decode_json(body, object_pairs_hook=pairs)
    except InvalidPayload as exc:
        exc.details["jsonrpc_code"] = rpc.PARSE_ERROR
        raise


def _exchange(value: Any, spec: McpSpec) -> tuple[rpc.McpExchange | None, InvalidPayload | None]:
    """The exchange of a decoded body (None: not JSON-RPC) and its refusal (None: it can
    be checked; a key in two spellings cannot)."""
    try:
        messages, batch = rpc.parse_messages(value)
    except rpc.McpProtocolError as exc:
        return None, InvalidPayload(
            f"not a JSON-RPC 2.0 message: {exc.message}",
            details={"reason": exc.reason, "jsonrpc_code": exc.code},
        )
    return rpc.McpExchange(spec, messages, batch), _refused(case_variant_key(value))


def _refused(problem: rpc.McpProtocolError | None) -> InvalidPayload | None:
    if problem is None:
        return None
    return InvalidPayload(
        f"not a JSON-RPC 2.0 message the sidecar can check: {problem.message}",
        details={"reason": problem.reason, "jsonrpc_code": problem.code},
    )


def _refusal(exchange: rpc.McpExchange, target: CompiledTarget) -> PermissionDenied | None:
    """The tool and argument rules on every request (each refusal kept in
    ``exchange.refused``): the refusal of the exchange, None when all are allowed."""
    spec = exchange.spec
    messages = exchange.messages
    for index, message in enumerate(messages):
        refusal = rpc.call_refusal(spec, message)
        if refusal is not None:
            exchange.refused[index] = refusal
    if not exchange.refused:
        return None
    first = next(iter(exchange.refused.values()))
    details: dict[str, Any] = {"reason": first.reason, "rule": first.rule}
    if first.argument is not None:
        details["argument"] = first.argument
    more = (
        f" (and {len(exchange.refused) - 1} more of the batch)" if len(exchange.refused) > 1 else ""
    )
    return PermissionDenied(f"{first.message} on target {target.name!r}{more}", details=details)


def _calls_tools(exchange: rpc.McpExchange) -> bool:
    return any(m.method == rpc.TOOLS_CALL for m in exchange.messages)


def _group(exchange: rpc.McpExchange, target: CompiledTarget) -> str | None:
    spec = target.spec.mcp
    if spec is None or spec.tools_rate_limit_group is None:
        return None
    return spec.tools_rate_limit_group if _calls_tools(exchange) else None


def _timeout(headers: dict[str, str]) -> Any:
    given = egress_timeout(headers)
    return MCP_TIMEOUT_S if given is None else given


def check_envelope(
    request: ExternalCallRequest, target: CompiledTarget
) -> tuple[ExternalCallRequest, Reading]:
    """An envelope to an MCP target: a POST's ``parameters`` (the JSON-RPC request) are
    checked as on ``/mcp/{target}``, and ``Accept`` is what an MCP client sends. Returns
    the request, in ``mcp.tools_rate_limit_group`` for a ``tools/call`` when the envelope
    names no group, and what the record learns: the exchange, and its refusal as
    :func:`mcp_intake`'s. Raises PermissionDenied for an envelope with a ``body`` (bytes
    the rules cannot read)."""
    if request.body is not None:  # bytes the rules cannot read
        raise PermissionDenied(
            f"an envelope to MCP target {target.name!r} carries its JSON-RPC request in "
            "'parameters', not 'body'",
            details={"reason": "mcp_body"},
        )
    passed = {"accept": rpc.ACCEPT}
    if request.method != "POST":
        return request, Reading(passthrough_headers=passed)
    assert target.spec.mcp is not None
    exchange, problem = _exchange(request.parameters, target.spec.mcp)
    if problem is not None:
        return request, Reading(passthrough_headers=passed, mcp=exchange, refusal=problem)
    assert exchange is not None
    refused = _refusal(exchange, target)
    if refused is not None:
        return request, Reading(
            passthrough_headers=passed, mcp=exchange, decision="denied", refusal=refused
        )
    update: dict[str, Any] = {"max_retries": 0} if _calls_tools(exchange) else {}
    group = _group(exchange, target)
    if group is not None and request.rate_limit_group is None:
        update["rate_limit_group"] = group
    checked = request.model_copy(update=update) if update else request
    return checked, Reading(passthrough_headers=passed, mcp=exchange)


def read_route_answer(ctx: CallContext, response: ExternalCallResponse) -> ExternalCallResponse:
    """Read a successful answer of the MCP route: each request's outcome into ``ctx.mcp``,
    ``tools/list`` filtered; the upstream's JSON body is read (a rewritten one kept in
    ``ctx.mcp.body``; a stream was read by the relay). Returns ``response``.

    Raises :class:`StreamInterrupted` (``details.reason: ended_without_answer``) when an
    event stream ended, however it ended, with a request of the body unanswered: the
    client would otherwise wait for an answer that will not come, and the audit record
    say success. Not retryable when a ``tools/call`` is among them (the tool may have
    run)."""
    exchange = ctx.mcp
    if exchange is None or not response.success:
        return response
    answer = ctx.attempt_log.answer
    if answer is not None and answer.stream is not None:
        _check_answered(exchange, ctx)
    if answer is None or answer.stream is not None or not answer.body:
        return response
    try:
        value = json.loads(answer.body)
    except (ValueError, RecursionError):
        return response
    value, changed = exchange.read(value)
    if changed:
        exchange.body = fastjson.compact(value)
    return response


def read_envelope_answer(ctx: CallContext, response: ExternalCallResponse) -> ExternalCallResponse:
    """Read a successful answer of an envelope to an MCP target: each request's outcome
    into ``ctx.mcp``; its ``data`` filtered in place (its assembled events too). Raises
    as :func:`read_route_answer` when its events lack the answer to a request."""
    exchange = ctx.mcp
    if exchange is None or not response.success:
        return response
    data = response.data
    if is_stream_form(data):
        events = [exchange.read(event)[0] for event in data["events"]]
        _check_answered(exchange, ctx)
        return response.model_copy(update={"data": {**data, "events": events}})
    return response.model_copy(update={"data": exchange.read(data)[0]})


def _check_answered(exchange: rpc.McpExchange, ctx: CallContext) -> None:
    """Raise :class:`StreamInterrupted` if a request of ``exchange`` got no answer on
    the stream that ended (:func:`read_route_answer`, :func:`read_envelope_answer`)."""
    pending = [m for m in exchange.requests if m.id not in exchange.outcomes]
    if not pending:
        return
    target = ctx.target.name if ctx.target is not None else None
    raise StreamInterrupted(
        f"the MCP server's event stream ended without the answer to {len(pending)} "
        "request(s) of this body",
        details={"reason": "ended_without_answer", "target": target},
        retryable=not any(m.method == rpc.TOOLS_CALL for m in pending),
    )


# -- keys that parsers read differently ----------------------------------------------

#: The keys the rules read, per level of a message: a key that differs from one of them
#: only in case (or Unicode folding) is read as that key by some parsers.
_MESSAGE_KEYS: Final = frozenset({"jsonrpc", "id", "method", "params", "result", "error"})
_PARAMS_KEYS: Final = frozenset({"name", "arguments", "uri"})


def repeated_key(repeated: list[str]) -> rpc.McpProtocolError | None:
    """The refusal of a body with a key twice in one object (``repeated``: the first such
    key, as :func:`_decode` found it), or None. JSON leaves repeated names' meaning open
    (RFC 8259 section 4): the sidecar's parser keeps the last, others the first, so a
    server could run another tool than the one the rules allowed."""
    if not repeated:
        return None
    return _ambiguous(f"the key {repeated[0][:64]!r} appears twice in one object")


def case_variant_key(value: Any) -> rpc.McpProtocolError | None:
    """The refusal of a decoded body with keys that differ only in case or Unicode folding
    (``Name`` and ``name``; ``params`` spelt with a long s, U+017F) in a message, its
    ``params`` or a tool call's ``arguments``, or None. Go's encoding/json matches keys
    that way (and MCP servers in Go use it), so such a server would read the other key."""
    for message in value if isinstance(value, list) else [value]:
        if not isinstance(message, dict):
            continue
        params = message.get("params")
        arguments = params.get("arguments") if isinstance(params, dict) else None
        for obj, known in ((message, _MESSAGE_KEYS), (params, _PARAMS_KEYS), (arguments, None)):
            if not isinstance(obj, dict):
                continue
            folded: dict[str, str] = {}
            for key in obj:
                fold = key.casefold()
                other = folded.setdefault(fold, key)
                if other != key:
                    shown = f"{other[:64]!r} and {key[:64]!r}"
                    return _ambiguous(f"the keys {shown} differ in case only")
                if known is not None and fold in known and key not in known:
                    return _ambiguous(f"the key {key[:64]!r} is {fold!r} in another case")
    return None


def _ambiguous(message: str) -> rpc.McpProtocolError:
    return rpc.McpProtocolError(rpc.INVALID_REQUEST, "ambiguous_key", message)


def audit_records(ctx: CallContext, record: dict[str, Any]) -> list[dict[str, Any]]:
    """One audit record per JSON-RPC request of the exchange (the call's record with the
    request's ``mcp_*`` fields); one record for a body without requests, a GET or DELETE."""
    exchange = ctx.mcp
    if exchange is None:
        return [record]
    named = exchange.requests or [m for m in exchange.messages if m.method is not None]
    if not named:
        return [record]
    out = []
    for message in named:
        is_error, code = exchange.outcomes.get(message.id, (None, None))
        if message.kind != "request":
            is_error = code = None
        out.append(
            {
                **record,
                F.MCP_METHOD: message.method[:CLAIM_LIMIT] if message.method else None,
                F.MCP_TOOL: message.tool[:CLAIM_LIMIT] if message.tool else None,
                F.MCP_REQUEST_ID: printable(str(message.id)[:CLAIM_LIMIT])
                if message.kind == "request"
                else None,
                F.MCP_IS_ERROR: is_error,
                F.MCP_ERROR_CODE: code,
            }
        )
    return out


def metric_labels(ctx: CallContext, record: dict[str, Any]) -> tuple[str, str, str]:
    """``(method, tool, outcome)`` of one MCP audit record, for the MCP metrics: a method
    outside :data:`METHOD_LABELS` is ``_other``; a tool not named literally by the policy
    ``_other`` (agents choose names: the series count stays bounded); outcome ``ok``,
    ``tool_error`` (``isError``), ``rpc_error`` (a JSON-RPC error), ``refused`` (by the
    sidecar's rules) or ``failed`` (no answer: the sidecar's error)."""
    method = record.get(F.MCP_METHOD) or "_none"
    tool = record.get(F.MCP_TOOL)
    spec = ctx.mcp.spec if ctx.mcp is not None else None
    named = set(spec.tools.allow) | set(spec.tools.deny) | set(spec.arguments) if spec else set()
    if record.get(F.DECISION) == "denied":
        outcome = "refused"
    elif record.get(F.MCP_IS_ERROR) is True:
        outcome = "tool_error"
    elif record.get(F.MCP_ERROR_CODE) is not None:
        outcome = "rpc_error"
    elif record.get(F.SUCCESS):
        outcome = "ok"
    else:
        outcome = "failed"
    return (
        method if method in METHOD_LABELS or method == "_none" else "_other",
        tool
        if tool is not None and tool in named and "*" not in tool
        else "_other"
        if tool
        else "_none",
        outcome,
    )

"""A2A targets, call side (pure, no I/O): an A2A client's HTTP request as an
:class:`ExternalCallRequest`, the method rules applied before anything is forwarded, the
call chain written into the message's ``metadata``, the answers read (task and context
ids, a stream's final event, the Agent Card checked), and one audit record per JSON-RPC
request (design.md, "Agents calling agents";
docs/api/a2a.md).

``/a2a/{target}`` is the agent's JSON-RPC endpoint as its A2A client sees it, and
``/a2a/{target}/.well-known/agent-card.json`` (or ``agent.json``) its card.
:func:`a2a_intake` builds the call:

* POST: the body is one JSON-RPC request (no batches); its method must be allowed by
  ``a2a.methods``; a PERMISSION_DENIED (``details.reason: method_not_allowed``) or an
  INVALID_PAYLOAD (not JSON-RPC) is answered and nothing is forwarded. A request for a
  task older than ``a2a.task_ttl_s`` (since the sidecar first saw it) is AGENT_TIMEOUT
  (``details.reason: task_ttl_expired``); a call's deadline is at most what is left of
  its task's. A request that sends a message is sent once (the agent may have acted).
* GET of a card path: the card is fetched through the same stages, parsed and, under
  ``a2a.card.verify``, its signature checked (:mod:`gateway.agents.card`).
* headers: ``Accept``, ``A2A-Version``, ``A2A-Extensions``, ``X-A2A-Extensions`` and the
  trace headers pass; the agent's ``Authorization`` never does, the target's credential
  is injected. Ids, ``x-egress-timeout`` and ``x-egress-secret-ref`` as on the drop-in
  routes (default deadline :data:`A2A_TIMEOUT_S`).
* the chain: the request's chain headers, else the chain in its message's ``metadata``;
  the target agent is ``a2a.agent_id``; the chain decided goes out as headers and in
  the message's ``metadata`` (:func:`checked`).

``/a2a/in/{path}`` (``A2aRequest.inbound``) is the other way round: a call *to* this
sidecar's agent, forwarded to the policy's ``inbound.agent_url`` (the implicit target
:data:`~gateway.policy.compiled.INBOUND_TARGET`) with its chain admitted, not extended
(``ctx.chain_inbound``; :func:`gateway.call.chain.chain_stage`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final

from gateway import fastjson
from gateway.agents import card as cards
from gateway.agents import chain
from gateway.audit.schema import Fields as F
from gateway.call.intake import parse_request, printable
from gateway.call.proxy import egress_timeout, header_map, request_ids
from gateway.call.record import CLAIM_LIMIT, Arrival, CallContext
from gateway.call.relay import Relay
from gateway.envelope import ExternalCallRequest, ExternalCallResponse, RequestBody
from gateway.errors import (
    DeadlineExceeded,
    InvalidPayload,
    PermissionDenied,
    StreamInterrupted,
)
from gateway.policy import CompiledTarget, PolicySet
from gateway.policy.a2a import CARD_PATHS
from gateway.policy.compiled import INBOUND_TARGET
from gateway.providers import a2a as rpc
from gateway.tracing import TRACE_HEADERS

#: The deadline of an A2A request without ``x-egress-timeout``, seconds (a task stream
#: may stay open a while; ``a2a.task_ttl_s`` bounds the task).
A2A_TIMEOUT_S: Final = 300.0
_SECRET_REF_HEADER: Final = "x-egress-secret-ref"  # noqa: S105 - a header name
#: Request headers an A2A client sends that the agent needs (lower case).
PASSED_HEADERS: Final = frozenset({"accept", "a2a-version", "a2a-extensions", "x-a2a-extensions"})
#: Tasks whose first sighting is remembered (for ``a2a.task_ttl_s``): the oldest go first.
MAX_TASKS: Final = 10_000


@dataclass(frozen=True, slots=True)
class A2aRequest:
    """A request on ``/a2a/{target}`` (``card``: the well-known path asked, or ""), or,
    with ``inbound``, on ``/a2a/in/{path}`` (``card``: then the path, query included)."""

    method: str
    target: str
    card: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    inbound: bool = False


#: Request headers that reach the agent's own server on the inbound route (its callers'
#: credentials for it included: the agent checks them).
INBOUND_HEADERS: Final = PASSED_HEADERS | {"authorization", "content-type"}


@dataclass(slots=True)
class CardFetch:
    """A card fetched for an agent (``ctx.a2a`` of a card GET): the check to make
    (``key``: the resolved public key when the policy asks to verify) and the card read."""

    target: str
    verify: bool
    key: str | None
    algorithms: tuple[str, ...]
    card: dict[str, Any] | None = None


class TaskClock:
    """When the sidecar first saw each task id (monotonic seconds), per target, for
    ``a2a.task_ttl_s``: bounded (:data:`MAX_TASKS`, the oldest dropped first), and
    forgotten with the runtime that owns it."""

    def __init__(self, limit: int = MAX_TASKS) -> None:
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._limit = limit

    def left_s(self, target: str, task_id: str | None, ttl_s: float, now: float) -> float:
        """Seconds the task may still live (``ttl_s`` for a task not seen before)."""
        if task_id is None:
            return ttl_s
        key = (target, task_id)
        first = self._seen.get(key)
        if first is None:
            first = self._seen[key] = now
            if len(self._seen) > self._limit:
                self._seen.popitem(last=False)
        return ttl_s - (now - first)

    def seen(self, target: str, task_id: str, now: float) -> None:
        """Start the task's clock (a task id learned from an answer)."""
        self.left_s(target, task_id, 0.0, now)


def a2a_intake(
    http: A2aRequest,
    policy: PolicySet,
    tasks: TaskClock,
    refuse: Exception | None = None,
    card_key: str | None = None,
) -> Arrival:
    """The call of one A2A HTTP request (module docstring), refused or not: the ids it
    claims and the request read come with a refusal, so that it is audited and answered
    as JSON-RPC. Its refusal: ``refuse`` when given; PermissionDenied (not an A2A target,
    a method refused: the intake's decision, ``denied``), InvalidPayload (not one
    JSON-RPC request, a method other than POST and a card's GET), DeadlineExceeded (the
    task outlived ``a2a.task_ttl_s``)."""
    if http.inbound:
        return _inbound_intake(http, refuse)
    headers = header_map(http.headers)
    seen = chain.seen_in(headers)
    ids = request_ids(headers)
    target = policy.targets.get(http.target)
    spec = target.spec.a2a if target is not None else None
    endpoint = http.card or (spec.rpc_path if spec is not None else "/")
    claimed = {
        "trace_id": ids[0],
        "correlation_id": ids[1],
        "target_system": printable(http.target[:CLAIM_LIMIT]),
        "endpoint": printable(endpoint[:CLAIM_LIMIT]),
        "method": printable(http.method[:CLAIM_LIMIT]),
    }
    exchange = None
    if http.method == "POST" and not http.card:  # read for any target: the refusal's id
        try:
            exchange = _parse(http.body, refuse)
        except Exception as exc:  # noqa: BLE001 - the pipeline raises it (ctx.arrived)
            return Arrival(None, "a2a", claimed, seen, refusal=exc)
        seen = seen or rpc.chain_in_body(exchange.body)
    if refuse is not None:
        return Arrival(None, "a2a", claimed, seen, refusal=refuse, a2a=exchange)
    read: Any = exchange
    try:
        raw, read = _outbound_raw(http, target, exchange, headers, endpoint, ids, tasks, card_key)
        intake = parse_request(raw)
    except Exception as exc:  # noqa: BLE001 - the pipeline raises it (ctx.arrived)
        # Every PermissionDenied here is the intake's decision: the target, the method.
        denied = "denied" if isinstance(exc, PermissionDenied) else None
        return Arrival(None, "a2a", claimed, seen, refusal=exc, decision=denied, a2a=read)
    passed = {k: v for k, v in headers.items() if k in PASSED_HEADERS}
    agent = spec.agent_id if spec is not None and target is not None else None
    return Arrival(intake, "a2a", claimed, seen, passed, a2a=read, target_agent=agent)


def _outbound_raw(
    http: A2aRequest,
    target: CompiledTarget | None,
    exchange: rpc.A2aExchange | None,
    headers: dict[str, str],
    endpoint: str,
    ids: tuple[str, str],
    tasks: TaskClock,
    card_key: str | None,
) -> tuple[dict[str, Any], Any]:
    """The envelope (unvalidated) of a request to A2A target ``target`` (None: not in the
    policy, refused by the egress decision), and what the call reads: ``exchange``, or
    a card fetch (:class:`CardFetch`). Raises as :func:`a2a_intake`."""
    _check_route(http)
    spec = target.spec.a2a if target is not None else None
    if target is not None and spec is None:
        raise PermissionDenied(
            f"target {target.name!r} is not an A2A agent (it has no 'a2a' section): use "
            f"/proxy/{target.name}/... or an envelope",
            details={"reason": "not_an_a2a_target", "target_system": target.name},
        )
    timeout = egress_timeout(headers)
    raw: dict[str, Any] = {
        "trace_id": ids[0],
        "correlation_id": ids[1],
        "target_system": http.target,
        "endpoint": endpoint,
        "method": http.method,
        "headers": {k: v for k, v in headers.items() if k in TRACE_HEADERS},
        "timeout": A2A_TIMEOUT_S if timeout is None else timeout,
    }
    if _SECRET_REF_HEADER in headers:
        raw["api_key_ref"] = headers[_SECRET_REF_HEADER]
    read: Any = exchange
    if spec is not None and target is not None:
        if exchange is not None:
            _check_method(exchange, target)
            left = tasks.left_s(target.name, exchange.task_id, spec.task_ttl_s, time.monotonic())
            _check_task(exchange, left)
            raw["timeout"] = min(raw["timeout"], left)
            if exchange.method in rpc.MESSAGE_METHODS:
                raw["max_retries"] = 0
        else:
            card = spec.card
            read = CardFetch(target.name, card.verify, card_key, tuple(card.algorithms))
    if exchange is not None:
        raw["body"] = _body(http.body)
    return raw, read


def _inbound_intake(http: A2aRequest, refuse: Exception | None) -> Arrival:
    """A call *to* this sidecar's agent (``/a2a/in/{path}``, design.md "Agents calling
    agents"): forwarded to ``inbound.agent_url`` as it came (a JSON-RPC body read for its
    chain, task and context ids), its chain admitted (``chain_inbound``). Refused by
    ``refuse``; PermissionDenied when the policy has no ``inbound`` section."""
    headers = header_map(http.headers)
    trace_id, correlation_id = request_ids(headers)
    claimed = {
        "trace_id": trace_id,
        "correlation_id": correlation_id,
        "target_system": INBOUND_TARGET,
        "endpoint": printable(http.card[:CLAIM_LIMIT]),
        "method": printable(http.method[:CLAIM_LIMIT]),
    }
    seen = chain.seen_in(headers)
    exchange = None
    if http.method == "POST":
        try:
            exchange = rpc.parse_request(http.body)
        except rpc.A2aProtocolError:
            pass  # the agent's server answers what it cannot read
        else:
            seen = seen or rpc.chain_in_body(exchange.body)
    if refuse is not None:
        return Arrival(None, "a2a", claimed, seen, refusal=refuse, a2a=exchange, chain_inbound=True)
    try:
        intake = parse_request(_inbound_raw(http, headers, (trace_id, correlation_id)))
    except Exception as exc:  # noqa: BLE001 - the pipeline raises it (ctx.arrived)
        return Arrival(None, "a2a", claimed, seen, refusal=exc, a2a=exchange, chain_inbound=True)
    passed = {k: v for k, v in headers.items() if k in INBOUND_HEADERS}
    return Arrival(intake, "a2a", claimed, seen, passed, a2a=exchange, chain_inbound=True)


def _inbound_raw(http: A2aRequest, headers: dict[str, str], ids: tuple[str, str]) -> dict[str, Any]:
    """The envelope (unvalidated) of a call to this sidecar's agent. Raises InvalidPayload
    (a bad ``x-egress-timeout``)."""
    raw: dict[str, Any] = {
        "trace_id": ids[0],
        "correlation_id": ids[1],
        "target_system": INBOUND_TARGET,
        "endpoint": http.card,
        "method": http.method,
        "headers": {k: v for k, v in headers.items() if k in TRACE_HEADERS},
        "timeout": egress_timeout(headers) or A2A_TIMEOUT_S,
        "max_retries": 0,
    }
    if http.body:
        raw["body"] = _body(http.body)
    return raw


def _body(data: bytes) -> dict[str, str]:
    return {"content_type": "application/json", "base64": base64.b64encode(data).decode()}


def _parse(body: bytes, refuse: Exception | None = None) -> rpc.A2aExchange:
    """The JSON-RPC request of ``body``. Raises ``refuse`` when the body cannot be read and
    the request is refused anyway (who calls, the body's size: settled first), else
    InvalidPayload."""
    try:
        return rpc.parse_request(body)
    except rpc.A2aProtocolError as exc:
        if refuse is not None:
            raise refuse from None
        raise InvalidPayload(
            f"not an A2A JSON-RPC request: {exc.message}",
            details={"reason": exc.reason, "jsonrpc_code": exc.code},
        ) from None


def _check_route(http: A2aRequest) -> None:
    if (http.method, bool(http.card)) not in (("POST", False), ("GET", True)):
        raise InvalidPayload(
            f"{printable(http.method[:32])} is not part of A2A's JSON-RPC binding: POST "
            f"/a2a/{{target}}, or GET its card at /a2a/{{target}}{CARD_PATHS[0]}",
            details={"reason": "method", "http_status": 405},
            http_status=405,
        )


def _check_method(exchange: rpc.A2aExchange, target: CompiledTarget) -> None:
    assert target.spec.a2a is not None
    rule = rpc.method_refusal(target.spec.a2a, exchange.method)
    if rule is not None:
        raise PermissionDenied(
            f"A2A method {printable(exchange.method[:64])!r} is not allowed on target "
            f"{target.name!r} (a2a.methods)",
            details={"reason": "method_not_allowed", "rule": rule},
        )


def _check_task(exchange: rpc.A2aExchange, left_s: float) -> None:
    if left_s <= 0:
        raise DeadlineExceeded(
            f"task {printable(exchange.task_id or '')[:64]!r} outlived a2a.task_ttl_s",
            details={"reason": "task_ttl_expired", "task_id": exchange.task_id},
        )


def checked(
    request: ExternalCallRequest, ctx: CallContext, relay: Relay | None
) -> tuple[ExternalCallRequest, Relay | None]:
    """After the egress decision: a message goes with the chain in its ``metadata``
    (the chain decided, as its headers); a card's answer is read whole (it is checked
    and rewritten), a task stream relayed."""
    exchange = ctx.a2a
    if isinstance(exchange, CardFetch):
        return request, None
    if exchange is None or ctx.chain is None:
        return request, relay
    rewritten = rpc.with_chain(exchange, ctx.chain.headers())
    if rewritten is None:
        return request, relay
    body = RequestBody(content_type="application/json", base64=base64.b64encode(
        fastjson.compact(rewritten)).decode())  # fmt: skip
    return request.model_copy(update={"body": body}), relay


def read_answer(ctx: CallContext, response: ExternalCallResponse) -> ExternalCallResponse:
    """Read a successful answer: a card parsed and checked (raises the refusal:
    :func:`gateway.agents.card.check`); a JSON-RPC answer's task and context ids; a task
    stream that ended before its final event raises :class:`StreamInterrupted`
    (``details.reason: no_final_event``)."""
    exchange = ctx.a2a
    answer = ctx.attempt_log.answer
    if exchange is None or not response.success or answer is None:
        return response
    if isinstance(exchange, CardFetch):
        exchange.card = cards.check(
            answer.body, verify=exchange.verify, key=exchange.key, algorithms=exchange.algorithms
        )
        return response
    if answer.stream is None:
        with contextlib.suppress(ValueError, RecursionError):
            exchange.read(json.loads(answer.body))
        return response
    if exchange.streams and not exchange.final:
        raise StreamInterrupted(
            f"the A2A task stream of {exchange.method!r} ended after {exchange.events} "
            "events without its final event",
            details={"reason": "no_final_event", "events": exchange.events},
        )
    return response


def audit_records(ctx: CallContext, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The call's one record, with the JSON-RPC request's ``a2a_*`` fields."""
    exchange = ctx.a2a
    if not isinstance(exchange, rpc.A2aExchange):
        return [record]
    return [
        {
            **record,
            F.A2A_METHOD: printable(exchange.method[:CLAIM_LIMIT]),
            F.A2A_REQUEST_ID: printable(str(exchange.id)[:CLAIM_LIMIT]),
            F.A2A_TASK_ID: printable(exchange.task_id) if exchange.task_id else None,
            F.A2A_CONTEXT_ID: printable(exchange.context_id) if exchange.context_id else None,
            F.A2A_ERROR_CODE: exchange.error_code,
        }
    ]

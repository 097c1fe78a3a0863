"""The operator's routes on the ops listener: approvals, dead letters, and what the
console shows (docs/features/approvals.md and docs/console.md).

======  ====================================  =================================================
GET     /v1/approvals                         ``{"approvals": [...]}`` newest first (``?state=``)
GET     /v1/approvals/{id}                    one request (404 unknown)
POST    /v1/approvals/{id}/approve            decide; 404 unknown, 409 decided before, 410
POST    /v1/approvals/{id}/deny               expired, 403 not among the request's approvers
GET     /v1/dead-letters                      ``{"dead_letters": [...]}`` newest first
GET     /v1/dead-letters/{id}                 one dead letter (404 unknown)
POST    /v1/dead-letters/{id}/replay          run it again with its idempotency key:
                                              ``{"dead_letter", "status", "response"}``; 404
                                              unknown or replayed before; 409 its target is no
                                              longer in the policy (kept: discard it)
POST    /v1/dead-letters/{id}/discard         drop it; 404 unknown
GET     /v1/desk/overview                     breakers, budgets, stop switches, operators
GET     /v1/desk/calls                        recent call records from the audit file
                                              (``?agent=``, ``?trace=``, ``?limit=``)
======  ====================================  =================================================

Every route needs ``Authorization: Bearer TOKEN``, the token of one of the policy's
``operators`` or the stop switch's ``controls.operator_token_ref`` (operator
``operator``), read from its secret reference and compared in constant time: the agent
shares the pod's loopback but holds no operator token, so it cannot approve its own
calls. No token, a wrong one, or no ``operators`` in the policy: 401, audited
(``desk_refused``). Errors are ``{"error": ErrorPayload}``. Decisions, replays and
discards are audit events with the operator's name.
"""

from __future__ import annotations

import hmac
import json
import time
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from gateway.agents.approvals import effective_state
from gateway.audit.query.filters import Filters
from gateway.audit.query.reader import records
from gateway.errors import GatewayError, InvalidPayload, PermissionDenied
from gateway.policy.desk import all_operators
from gateway.policy.refs import parse_ref

if TYPE_CHECKING:
    from gateway.agents.approvals import Verdict
    from gateway.call.pipeline import Pipeline
    from gateway.server.runtime import Gateway

_GATEWAY: Final = web.AppKey("desk_gateway", object)
#: Bodies of the POST routes are a few short strings.
MAX_BODY_BYTES: Final = 16_384
#: Call records a ``/v1/desk/calls`` answer holds at most.
MAX_CALLS: Final = 500


def install(app: web.Application, gateway: Gateway) -> web.Application:
    """Add the desk's routes to the ops application; returns it."""
    app[_GATEWAY] = gateway
    add = app.router.add_route
    add("GET", "/v1/approvals", _approvals)
    add("GET", "/v1/approvals/{id}", _approval)
    add("POST", "/v1/approvals/{id}/{verdict:approve|deny}", _decide)
    add("GET", "/v1/dead-letters", _letters)
    add("GET", "/v1/dead-letters/{id}", _letter)
    add("POST", "/v1/dead-letters/{id}/replay", _replay)
    add("POST", "/v1/dead-letters/{id}/discard", _discard)
    add("GET", "/v1/desk/overview", _overview)
    add("GET", "/v1/desk/calls", _calls)
    return app


def _gw(request: web.Request) -> Gateway:
    return request.app[_GATEWAY]  # type: ignore[return-value]


def _pipeline(request: web.Request) -> Pipeline:
    pipeline = _gw(request).pipeline
    if pipeline is None:
        raise GatewayError("the sidecar is not started", http_status=503, retryable=True)
    return pipeline


def _refusal(exc: GatewayError) -> web.Response:
    body = {"error": exc.to_payload().model_dump(mode="json", exclude_none=True)}
    return web.json_response(body, status=exc.http_status)


def _unauthorized(message: str, reason: str) -> PermissionDenied:
    return PermissionDenied(message, http_status=401, details={"reason": reason})


async def operator(request: web.Request) -> str:
    """The name of the operator whose token the request carries. Raises 401."""
    policy = _gw(request).policy.policy
    operators = all_operators(policy.operators, policy.controls.operator_token_ref)
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if not operators:
        raise _unauthorized(
            "the operator routes are off: the policy names no operators", "no_operators"
        )
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized(
            "an operator token is required (Authorization: Bearer ...)", "operator_token_missing"
        )
    resolvers, given, found = _pipeline(request).resolvers, token.strip().encode(), None
    for name, spec in sorted(operators.items()):  # every one compared: constant time
        expected = (await resolvers.resolve(parse_ref(spec.token_ref))).secret.reveal()
        if hmac.compare_digest(given, expected.encode()) and found is None:
            found = name
    if found is None:
        raise _unauthorized("the operator token is wrong", "operator_token_wrong")
    return found


def _handler(inner: Any) -> Any:
    """Authorize, run ``inner(request, who)``, answer errors as ``{"error": ...}``."""

    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            who = await operator(request)
        except GatewayError as exc:
            audit = _gw(request).audit
            if audit is not None:
                audit.event(
                    "desk_refused",
                    path=request.path,
                    method=request.method,
                    peer=request.remote or "",
                    reason=exc.details.get("reason"),
                )
            return _refusal(exc)
        try:
            result = await inner(request, who)
        except GatewayError as exc:
            return _refusal(exc)
        return result if isinstance(result, web.StreamResponse) else web.json_response(result)

    return handle


def _shown(record: dict[str, str]) -> dict[str, Any]:
    """A request as the routes show it: times as numbers, arguments as JSON."""
    shown: dict[str, Any] = dict(record)
    shown["state"] = _state(record)
    shown["arguments"] = json.loads(record.get("arguments") or "null")
    shown["approvers"] = [a for a in record.get("approvers", "").split(",") if a]
    for key in ("requested_at", "expires_at", "decided_at", "used_at", "ttl_s"):
        if record.get(key):
            shown[key] = float(record[key])
    return shown


def _state(record: dict[str, str]) -> str:
    return effective_state(record, time.time())


async def _list_approvals(request: web.Request, _who: str) -> dict[str, Any]:
    wanted = request.query.get("state")
    rows = await _pipeline(request).approvals.store.recent(MAX_CALLS)
    shown = [_shown(r) for r in rows]
    return {"approvals": [r for r in shown if wanted is None or r["state"] == wanted]}


async def _get_approval(request: web.Request, _who: str) -> dict[str, Any]:
    record = await _pipeline(request).approvals.store.get(request.match_info["id"])
    if record is None:
        raise InvalidPayload(
            f"no approval request {request.match_info['id'][:64]!r}",
            details={"reason": "unknown_approval"},
            http_status=404,
        )
    return _shown(record)


async def _decide_approval(request: web.Request, who: str) -> dict[str, Any]:
    verdict: Verdict = "approved" if request.match_info["verdict"] == "approve" else "denied"
    approvals = _pipeline(request).approvals
    record = await approvals.decide(request.match_info["id"], verdict, who)
    return _shown(record)


async def _list_letters(request: web.Request, _who: str) -> dict[str, Any]:
    return {"dead_letters": [d.summary() for d in _pipeline(request).dead_letters.list()]}


def _unknown_letter(letter_id: str) -> InvalidPayload:
    return InvalidPayload(
        f"no dead letter {letter_id[:64]!r} (unknown, replayed or discarded)",
        details={"reason": "unknown_dead_letter"},
        http_status=404,
    )


async def _get_letter(request: web.Request, _who: str) -> dict[str, Any]:
    letter = _pipeline(request).dead_letters.get(request.match_info["id"])
    if letter is None:
        raise _unknown_letter(request.match_info["id"])
    return letter.summary()


async def _replay_letter(request: web.Request, who: str) -> dict[str, Any]:
    pipeline, letter_id = _pipeline(request), request.match_info["id"]
    letter = pipeline.dead_letters.get(letter_id)
    if letter is None:
        raise _unknown_letter(letter_id)
    if letter.target not in pipeline.policy.targets:
        raise InvalidPayload(
            f"dead letter {letter_id}'s target {letter.target!r} is no longer in the policy; "
            "it is kept: discard it, or restore the target and replay",
            details={"reason": "target_removed", "target_system": letter.target},
            http_status=409,
        )
    # As the agent whose call it was (its claim in the kept envelope then matches), held
    # to what the policy lets it call now: checked before the letter is taken, so that a
    # replay refused so keeps it, as one whose target was removed does.
    identity = _gw(request).agents.acting_for(letter.agent)
    try:
        identity.admit(letter.target)
    except GatewayError as exc:
        raise InvalidPayload(
            f"dead letter {letter_id} cannot be replayed now: {exc.message}; it is kept: "
            "discard it, or change the policy and replay",
            details={**exc.details, "target_system": letter.target},
            http_status=409,
        ) from None
    if pipeline.dead_letters.take(letter_id, who) is None:  # another replay took it
        raise _unknown_letter(letter_id)
    status, response = await _gw(request).call(letter.replay_envelope(), identity=identity)
    return {
        "dead_letter": letter_id,
        "status": status,
        "response": response.model_dump(mode="json", exclude_none=True),
    }


async def _discard_letter(request: web.Request, who: str) -> dict[str, Any]:
    letter_id = request.match_info["id"]
    if _pipeline(request).dead_letters.discard(letter_id, who) is None:
        raise _unknown_letter(letter_id)
    return {"discarded": letter_id}


async def _overview_of(request: web.Request, who: str) -> dict[str, Any]:
    gateway, pipeline = _gw(request), _pipeline(request)
    policy = gateway.policy.policy
    breakers = {}
    for name in sorted(policy.targets):
        breaker = pipeline.breakers.get(name)
        breakers[name] = None if breaker is None else str(breaker.state)
    return {
        "operator": who,
        "agent_id": policy.agent_id,
        "breakers": breakers,
        "budgets": pipeline.budgets.snapshot(),
        "stops": _stops(pipeline),
        "approvals_scope": policy.approvals.scope,
        "dead_letters": len(pipeline.dead_letters.list()),
    }


def _stops(pipeline: Pipeline) -> list[dict[str, Any]] | None:
    """The stop switches in force (``pipeline.controls.stops.stops``: the stop switch's
    Stops, each with ``to_json``), read-only; None when this build has no stop switch."""
    switch = getattr(getattr(pipeline, "controls", None), "stops", None)
    stops = getattr(switch, "stops", None)
    if not isinstance(stops, dict):
        return None
    return [json.loads(stop.to_json()) for stop in stops.values()]


async def _recent_calls(request: web.Request, _who: str) -> dict[str, Any]:
    audit = _gw(request).policy.policy.audit
    if audit.sink != "file" or audit.path is None:
        return {"calls": [], "source": None, "note": "the audit log goes to stdout"}
    query = request.query
    agent, trace = query.get("agent"), query.get("trace")
    limit = min(int(query.get("limit", "50") or 50), MAX_CALLS)
    match = Filters(
        agent=(agent,) if agent else (), trace=(trace,) if trace else ()
    ).call_predicate()
    found = [r for r in records([audit.path]) if match(r)]
    return {"calls": found[-limit:][::-1], "source": audit.path}


_approvals = _handler(_list_approvals)
_approval = _handler(_get_approval)
_decide = _handler(_decide_approval)
_letters = _handler(_list_letters)
_letter = _handler(_get_letter)
_replay = _handler(_replay_letter)
_discard = _handler(_discard_letter)
_overview = _handler(_overview_of)
_calls = _handler(_recent_calls)

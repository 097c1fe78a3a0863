"""The operator's routes on the ops listener: the stop switch (docs/features/stopping.md).

``POST /v1/controls/stop``   ``{"scope": "agent"|"target"|"all", "name": ..., "reason": ...,
                             "by": ...}``: puts a stop in force (here at once; with
                             ``controls.stop_switch.scope: cluster``, on every sidecar
                             sharing the Redis within 2 s). 200 ``{"stop": {...},
                             "propagated": bool}`` (``propagated: false``: Redis could not
                             be written; the stop holds here and is written when it answers).
``POST /v1/controls/resume`` the same body (``reason`` says why): lifts the stop.
                             200 ``{"resumed": bool, "propagated": bool}``.
``GET /v1/controls/stops``   the stops in force here.

Every request carries ``Authorization: Bearer TOKEN``, the operator token read from the
policy's ``controls.operator_token_ref`` (compared in constant time). The agent shares
the pod's loopback but never holds that token, so it cannot lift a stop: no token or a
wrong one is 401 (audited, nothing changes); no ``operator_token_ref`` in the policy,
401 too. A scope or name the policy does not know, or a reason with control characters,
is 400. Every stop and resume, and every refusal, is an audit event (``agent_stop``,
``agent_resume``, ``agent_stop_refused``: who, why, scope, the peer's address) and a
metric (``agent_stop_changes_total``). Readiness is not affected: a stopped agent's pod
must not be restarted into a loop.
"""

from __future__ import annotations

import hmac
import json
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from gateway.agents.controls import SCOPES, Stop, check_reason, now
from gateway.errors import GatewayError, InvalidPayload, PermissionDenied
from gateway.policy.refs import parse_ref

if TYPE_CHECKING:
    from gateway.server.runtime import Gateway

STOP_PATH: Final = "/v1/controls/stop"
RESUME_PATH: Final = "/v1/controls/resume"
STOPS_PATH: Final = "/v1/controls/stops"
#: A stop request is a few short strings.
MAX_BODY_BYTES: Final = 16_384
_GATEWAY: Final = web.AppKey("ops_gateway", object)


def install(app: web.Application, gateway: Gateway) -> None:
    """Add the stop switch's routes to the ops application."""
    app[_GATEWAY] = gateway
    app.router.add_post(STOP_PATH, _stop)
    app.router.add_post(RESUME_PATH, _resume)
    app.router.add_get(STOPS_PATH, _list)


def _gw(request: web.Request) -> Gateway:
    return request.app[_GATEWAY]  # type: ignore[return-value]


def _refusal(exc: GatewayError) -> web.Response:
    body = {"error": exc.to_payload().model_dump(mode="json", exclude_none=True)}
    return web.json_response(body, status=exc.http_status)


async def _authorize(request: web.Request) -> None:
    """Raise 401 unless the request carries the operator token."""
    gateway = _gw(request)
    ref = gateway.policy.policy.controls.operator_token_ref
    given = request.headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    if ref is None:
        raise PermissionDenied(
            "the stop switch's ops routes are off: the policy sets no controls.operator_token_ref",
            http_status=401,
            details={"reason": "operator_token_not_configured"},
        )
    if scheme.lower() != "bearer" or not token:
        raise PermissionDenied(
            "an operator token is required (Authorization: Bearer ...)",
            http_status=401,
            details={"reason": "operator_token_missing"},
        )
    pipeline = gateway.pipeline
    if pipeline is None:
        raise GatewayError("the sidecar is not started", http_status=503)
    expected = (await pipeline.resolvers.resolve(parse_ref(ref))).secret.reveal()
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise PermissionDenied(
            "the operator token is wrong",
            http_status=401,
            details={"reason": "operator_token_wrong"},
        )


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.content.read(MAX_BODY_BYTES + 1)
    if len(raw) > MAX_BODY_BYTES:
        raise InvalidPayload("the request body is too large", http_status=413)
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise InvalidPayload("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise InvalidPayload("the request body is not a JSON object")
    return body


def _scope(gateway: Gateway, body: dict[str, Any]) -> tuple[Any, str]:
    """``(scope, name)`` of a request, checked against the policy. Raises 400."""
    scope, name = body.get("scope"), body.get("name") or ""
    if scope not in SCOPES:
        raise InvalidPayload("scope must be one of agent, target, all", details={"scope": scope})
    if not isinstance(name, str):
        raise InvalidPayload("name must be a string")
    policy = gateway.policy.policy
    known: set[str] = set()
    if scope == "agent":
        known = {policy.agent_id, *policy.agents}
    elif scope == "target":
        known = set(policy.targets)
    if scope != "all" and name not in known:
        raise InvalidPayload(
            f"no {scope} {name[:64]!r} in this sidecar's policy",
            details={"reason": f"unknown_{scope}", "known": sorted(known)},
        )
    if scope == "all" and name:
        raise InvalidPayload("scope all takes no name")
    return scope, name


def _text(body: dict[str, Any], key: str, default: str) -> str:
    value = body.get(key, default)
    if not isinstance(value, str):
        raise InvalidPayload(f"{key} must be a string")
    try:
        return check_reason(value)
    except ValueError as exc:
        raise InvalidPayload(f"{key}: {exc}", details={"reason": f"bad_{key}"}) from None


async def _change(request: web.Request, action: str) -> web.Response:
    gateway = _gw(request)
    peer = request.remote or ""
    audit = gateway.audit
    try:
        await _authorize(request)
        body = await _body(request)
        scope, name = _scope(gateway, body)
        reason = _text(body, "reason", "" if action == "stop" else "resumed by an operator")
        by = _text(body, "by", "operator")
    except GatewayError as exc:
        if audit is not None:
            audit.event(
                "agent_stop_refused",
                action=action,
                peer=peer,
                code=exc.code.value,
                reason=exc.details.get("reason"),
                status=exc.http_status,
            )
        return _refusal(exc)
    assert gateway.pipeline is not None
    stops = gateway.pipeline.controls.stops
    answer: dict[str, Any]
    if action == "stop":
        stop = Stop(scope=scope, name=name, reason=reason, by=by, at=now())
        propagated = await stops.stop(stop)
        answer = {"stop": _shape(stop), "propagated": propagated}
    else:
        existed, propagated = await stops.resume(scope, name)
        answer = {"resumed": existed, "propagated": propagated}
    gateway.metrics.observe_agent_stop_change(action, scope)
    if audit is not None:
        audit.event(
            f"agent_{action}",
            scope=scope,
            stopped=name or None,
            why=reason,
            by=by,
            peer=peer,
            propagated=propagated,
        )
    return web.json_response(answer)


async def _stop(request: web.Request) -> web.Response:
    return await _change(request, "stop")


async def _resume(request: web.Request) -> web.Response:
    return await _change(request, "resume")


async def _list(request: web.Request) -> web.Response:
    gateway = _gw(request)
    try:
        await _authorize(request)
    except GatewayError as exc:
        return _refusal(exc)
    assert gateway.pipeline is not None
    stops = gateway.pipeline.controls.stops.stops
    return web.json_response({"stops": [_shape(s) for s in stops.values()]})


def _shape(stop: Stop) -> dict[str, Any]:
    return {
        "scope": stop.scope,
        "name": stop.name or None,
        "reason": stop.reason,
        "by": stop.by,
        "at": stop.at,
    }

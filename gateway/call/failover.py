"""Failover: a call sent to its target, then to each of its ``fallbacks`` in turn.

:func:`fail_over` sends each option through :func:`gateway.call.send.forward` inside the
call's one deadline, and moves on only as :func:`gateway.call.retry.next_option` allows:
while nothing reached the agent, for the causes the target's ``fallback_on`` names. What
each option tried goes into the call's record (``tried``); the answer names the option
that served it (``served_by``, the ``x-egress-served-by`` header). docs/failover.md has
the rules.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

from gateway.call.attempts import AttemptLog, tried_entry
from gateway.call.record import CallContext
from gateway.call.relay import Relay
from gateway.call.retry import next_option, unanswered_resendable
from gateway.call.send import forward
from gateway.envelope import ExternalCallRequest, ExternalCallResponse, ServedBy
from gateway.errors import GatewayError
from gateway.policy import CompiledTarget, PolicySet
from gateway.policy import egress as egress_rules
from gateway.policy.egress import Decision
from gateway.policy.failover import FallbackSpec
from gateway.policy.models import TargetSpec
from gateway.providers import request_model, with_model

if TYPE_CHECKING:
    from gateway.call.pipeline import Pipeline


async def fail_over(
    pipe: Pipeline,
    policy: PolicySet,
    request: ExternalCallRequest,
    decision: Decision,
    ctx: CallContext,
    deadline: float,
    relay: Relay | None = None,
) -> ExternalCallResponse:
    """The call sent to its target, then to each fallback that
    :func:`gateway.call.retry.next_option` allows, all inside ``deadline``: only while
    nothing reached the agent. When every option failed, raises the target's own error
    (a fallback's refusal never masks the cause), or, once bytes were relayed, the
    error that cut them. Each attempt of each option goes into ``ctx.tried``."""
    spec = decision.target.spec
    original, tried = request, 0
    first: tuple[GatewayError, AttemptLog] | None = None
    ctx.failing_over()
    while True:
        model = request_model(decision.target.spec.usage, request.endpoint, request.parameters)
        # This option's log (forward's attempts replace it): what failed before them is
        # told apart from the last option's; who serves it: a stream's head.
        # The first option keeps the call's log, which nothing wrote before the send
        # stage (a dataclass of three lists less per call answered at once).
        ctx.option(_served_by(decision.target.name, model), AttemptLog(tried=[]) if tried else None)
        try:
            response = await forward(pipe, policy, request, decision, ctx, deadline, relay)
        except GatewayError as exc:
            _option_tried(ctx, decision.target, request, exc)
            first = first or (exc, ctx.attempt_log)
            relayed = relay is not None and relay.started
            moved = _next_fallback(
                pipe, policy, spec, original, decision.target.name, exc, tried, relayed, ctx,
                deadline,
            )  # fmt: skip
            if moved is None:
                ctx.option(None)
                if relayed or not tried:
                    raise
                # The target's own error and answer (a drop-in route passes it on), the
                # record counting every option's attempts.
                ctx.fell_back(ctx.attempt_log.attempts - first[1].attempts, first[1])
                raise first[0] from None
            tried, request, decision = moved
            ctx.fell_back(
                ctx.attempt_log.attempts, None, decision.api_key_ref,
                decision.target.spec.rate_limit_group,
            )  # fmt: skip
        else:
            _option_tried(ctx, decision.target, request, None)
            return response  # built naming ctx.served_by (_answered): no copy


@functools.lru_cache(maxsize=256)
def _cached_served_by(target: str, model: str | None) -> ServedBy:
    return ServedBy(target=target, model=model)


def _served_by(target: str, model: str | None) -> ServedBy:
    """``ServedBy(target=target, model=model)``, validated once per pair: it is frozen,
    so calls may share one. The model is the agent's: only a name of at most 256
    characters is kept, so the cache holds at most 256 x that."""
    if model is not None and len(model) > 256:
        return ServedBy(target=target, model=model)
    return _cached_served_by(target, model)


def _option_tried(
    ctx: CallContext,
    target: CompiledTarget,
    request: ExternalCallRequest,
    error: GatewayError | None,
) -> None:
    """An option's attempts into ``ctx.tried``; one that failed before any attempt (its
    secret, its budget, every key of its pool resting) as one entry of 0 attempts."""
    made = ctx.attempt_log.tried or []
    if not made and error is not None:
        made = [tried_entry(target, request, ctx.api_key_ref, error.code.value, sent=False)]
    ctx.option_tried(made)


def _next_fallback(
    pipe: Pipeline,
    policy: PolicySet,
    spec: TargetSpec,
    original: ExternalCallRequest,
    source: str,
    error: GatewayError,
    tried: int,
    relayed: bool,
    ctx: CallContext,
    deadline: float,
) -> tuple[int, ExternalCallRequest, Decision] | None:
    """The next fallback of ``spec`` after option ``tried`` (0: the target) failed with
    ``error``, as :func:`gateway.call.retry.next_option` decides: ``(options tried, its
    request, its decision)``, or None to stop. A fallback the egress rules refuse
    (the endpoint not allowed there) or a stop holds (AGENT_STOPPED: the stop switch's
    ``target`` scope covers fallbacks) is recorded in ``ctx.tried`` and passed over; the
    call's stop-switch registration follows it to the fallback it moves to."""
    while True:
        option = next_option(
            error,
            tried,
            len(spec.fallbacks),
            relayed=relayed,
            fallback_on=spec.fallback_on,
            now=time.monotonic(),
            deadline=deadline,
            resend_unanswered=unanswered_resendable(
                spec.retry.resend_unanswered, spec.usage, original.endpoint, original.parameters
            ),
        )
        if option.action == "stop" or option.reason is None:
            return None
        tried += 1
        chosen = spec.fallbacks[option.choice]
        pipe.metrics.observe_failover(source, chosen.target, option.reason)
        try:
            request, decision = fallback_call(policy, original, chosen)
            pipe.controls.stops.moved(ctx.agent_id, chosen.target)  # a stop holds it too
        except GatewayError as refused:  # never sent: the egress rules or a stop refused it
            ctx.option_tried(
                (
                    {
                        "target": chosen.target,
                        "model": chosen.model,
                        "api_key_ref": None,
                        "attempts": 0,
                        "outcome": refused.code.value,
                        "upstream_status": None,
                        "reason": refused.details.get("reason"),
                        "response_bytes": None,
                        "duration_ms": 0.0,
                    },
                )
            )
            continue
        return tried, request, decision


def fallback_call(
    policy: PolicySet, request: ExternalCallRequest, option: FallbackSpec
) -> tuple[ExternalCallRequest, Decision]:
    """``request`` sent to fallback ``option`` instead: its target, its model named
    (:func:`gateway.providers.with_model`, the dialect's own place), its default secret
    and rate-limit group; decided by the egress rules like any call (raises
    PermissionDenied when the endpoint is not allowed there)."""
    target = policy.targets.get(option.target)
    endpoint, parameters = request.endpoint, request.parameters
    if target is not None and option.model is not None and isinstance(parameters, dict):
        endpoint, named = with_model(target.spec.usage, endpoint, parameters, option.model)
        parameters = dict(named)
    moved = request.model_copy(
        update={
            "target_system": option.target,
            "endpoint": endpoint,
            "parameters": parameters,
            "api_key_ref": None,
            "rate_limit_group": None,
        }
    )
    return moved, egress_rules.decide(policy, moved)

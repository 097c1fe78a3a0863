"""An agent's own rate-limit group: the policy's ``agents.NAME.rate_limit_group``.

Every call of an established agent (``agent_auth`` ``uid`` or ``token``) whose entry names
a group takes one request from it, and its token estimate when the group has
``tokens_per_minute``: once per call (retries and fallbacks are the sidecar's, not the
agent's), when it is sent: after the call's approval and its idempotency store (an
answer replayed by its key takes nothing), before its secret, its budgets and its own
group (the target's ``rate_limit_group``, or the envelope's), which each attempt still
takes. A call whose own group is the agent's takes it once. Several
agents naming one group share its bucket.

The group is an ordinary group of ``rate_limit_groups``: it queues a call within its
``max_queue_s`` and the call's deadline, refuses with CAPACITY_EXCEEDED (HTTP 429,
``Retry-After``, ``details.group``) when it cannot admit in time, may be ``scope:
cluster`` or ``mode: shadow``, and is counted in ``ratelimit_wait_seconds`` and
``ratelimit_rejections_total`` under its name. The audit record names it
(``agent_rate_limit_group``) and, when it refused the call, ``rate_limit_refused``; the
wait is part of ``rate_limit_wait_ms``. A policy's own ``agent_id`` (no ``agents:``)
has no group of its own.

An envelope may name its call's group (``rate_limit_group``), but never another agent's
own group (one no target or MCP tool rule assigns): that would spend the other agent's
pace. Such a call is refused PERMISSION_DENIED (``details.reason:
rate_limit_group_not_allowed``) before any I/O (:func:`named_refusal`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from gateway import telemetry
from gateway.agents.identity import Identity
from gateway.call.record import CallContext
from gateway.envelope import ExternalCallRequest
from gateway.errors import CapacityExceeded, PermissionDenied
from gateway.policy import PolicySet
from gateway.providers import estimate_tokens

if TYPE_CHECKING:
    from gateway.call.pipeline import Pipeline


def group_of(policy: PolicySet, identity: Identity | None) -> str | None:
    """The rate-limit group of the agent ``identity`` established, under ``policy`` (pure):
    its ``agents.NAME.rate_limit_group``, None when it names none, when the caller is
    the policy's ``agent_id`` (no ``agents:``) or was not recognised."""
    if identity is None or identity.agent_auth not in ("uid", "token"):
        return None
    spec = policy.policy.agents.get(identity.agent_id)
    return spec.rate_limit_group if spec is not None else None


def named_refusal(
    policy: PolicySet, identity: Identity | None, named: str
) -> PermissionDenied | None:
    """The PermissionDenied (``rate_limit_group_not_allowed``) of a call whose envelope
    names group ``named`` when that is the own group of an agent other than the caller
    (``identity``) and no target or MCP tool rule of ``policy`` assigns it; else None
    (pure)."""
    spec = policy.policy
    owners = [n for n, a in spec.agents.items() if a.rate_limit_group == named]
    if not owners or group_of(policy, identity) == named:
        return None
    for target in spec.targets.values():
        tools = target.mcp.tools_rate_limit_group if target.mcp is not None else None
        if named in (target.rate_limit_group, tools):
            return None
    return PermissionDenied(
        f"rate-limit group {named!r} is agent {owners[0]!r}'s own: a call may not spend "
        "another agent's pace; name no group, or one of the targets'",
        details={"reason": "rate_limit_group_not_allowed", "group": named},
    )


@asynccontextmanager
async def taken(
    pipe: Pipeline,
    policy: PolicySet,
    request: ExternalCallRequest,
    ctx: CallContext,
    deadline: float,
) -> AsyncIterator[None]:
    """Hold the calling agent's group for the call's body: admitted on entry (raises
    :class:`CapacityExceeded` when it cannot admit by ``deadline``, a ``time.monotonic()``
    instant), its token estimate settled with the call's usage on exit. Does nothing
    without a group of the agent's own (:func:`group_of`), or when it is the call's."""
    name = group_of(policy, ctx.identity)
    group = pipe.groups.get(name) if name is not None else None
    if group is None or name == ctx.rate_limit_group:
        yield
        return
    ctx.agent_rate_limit_group = group.name
    reserved = estimate_tokens(request.parameters) if group.spec.tokens_per_minute else 0
    shadow: list[str] = []
    try:
        with telemetry.current().span(telemetry.RATE_LIMIT_WAIT, group.name):
            waited = await group.acquire(
                tokens=reserved, deadline=deadline, warnings=ctx.warnings, shadow=shadow
            )
    except CapacityExceeded:
        pipe.metrics.observe_ratelimit_rejection(group.name)
        ctx.rate_limit_refused = group.name
        raise
    ctx.agent_rate_limit_wait_s = waited
    pipe.metrics.observe_ratelimit_wait(group.name, waited)
    ctx.shadow_denied.extend(f"rate_limit_group:{g}" for g in shadow)
    failed = True
    try:
        yield
        failed = False
    finally:
        if reserved:
            group.reconcile(reserved, _used(ctx, reserved, failed=failed))


def _used(ctx: CallContext, reserved: int, *, failed: bool) -> int:
    """The tokens the call spent, for settling ``reserved``: its usage; none when it was
    replayed, nothing was sent, or it ``failed`` without a usage (as the target's group
    settles it: no answer, no usage); an answer without a usage keeps the reservation
    (the upstream spent tokens: a refund could overspend)."""
    if ctx.replayed:
        return 0
    if ctx.usage is not None:
        return ctx.usage.total
    sent = ctx.attempt_log.sent or ctx.prior_attempts > 0
    return reserved if sent and not failed else 0

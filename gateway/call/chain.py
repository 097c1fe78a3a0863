"""The call chain stage of every call (envelope, drop-in, MCP): resolve the fleet's
signing keys, then :func:`gateway.agents.chain.decide`, before any upstream I/O.

The decision itself is pure and lives in :mod:`gateway.agents.chain`; this stage only
gathers its inputs (the envelope's ``call_chain``, else the chain headers the route
saw in ``ctx.chain_seen``; the wall clock; the keys) and raises the refusal.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from gateway.agents import chain
from gateway.call.record import CallContext
from gateway.envelope import ExternalCallRequest
from gateway.policy.chain import ChainSpec
from gateway.policy.refs import SecretRef, parse_ref
from gateway.secrets import ResolvedSecret

#: How the pipeline resolves a secret reference within a deadline (monotonic seconds).
Resolve = Callable[[SecretRef, CallContext, float], Awaitable[ResolvedSecret | None]]


async def chain_stage(
    spec: ChainSpec, request: ExternalCallRequest, ctx: CallContext, resolve: Resolve
) -> chain.ChainDecision:
    """The call's chain decision (``ctx.chain`` is set to it, refused or not). Resolves
    ``chain.signing_key_ref`` (and the previous key) first when the policy names one:
    cached like any secret, and their errors (SECRET_NOT_FOUND, DEPENDENCY_FAILED...)
    are the call's. Raises :class:`~gateway.errors.CallChainRefused` (409)."""
    seen = request.call_chain if request.call_chain is not None else ctx.chain_seen
    if seen is None and spec.signing_key_ref is None:  # the common case: a chain starts
        started = chain.start(ctx.agent_id, int(time.time() * 1000), request.timeout, spec)
        if started is not None:
            ctx.chain = started
            return started
    keys = chain.NO_KEYS
    if spec.signing_key_ref is not None:
        deadline = ctx.started + request.timeout
        resolved = [await resolve(parse_ref(ref), ctx, deadline) for ref in spec.key_refs()]
        keys = chain.SigningKeys(*(r.secret for r in resolved if r is not None))
    ctx.chain = chain.decide(
        seen,
        own_agent=ctx.agent_id,
        target_agent=None,  # A2A targets (a later step) name the agent they call
        now_ms=int(time.time() * 1000),
        timeout_s=request.timeout,
        spec=spec,
        keys=keys,
    )
    if ctx.chain.error is not None:
        raise ctx.chain.error
    return ctx.chain

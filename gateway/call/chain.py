"""The call chain stage of every call (envelope, drop-in, MCP): resolve the fleet's
signing keys, then :func:`gateway.agents.chain.decide`, before any upstream I/O.

The decision itself is pure and lives in :mod:`gateway.agents.chain`; this stage only
gathers its inputs (the envelope's ``call_chain``, else the chain headers the route
saw in ``ctx.chain_seen``; the wall clock; the keys) and raises the refusal.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable

from gateway.agents import chain
from gateway.agents.chain_memory import ChainMemory
from gateway.call.record import CallContext
from gateway.envelope import ExternalCallRequest
from gateway.policy.chain import ChainSpec
from gateway.policy.refs import SecretRef, parse_ref
from gateway.secrets import ResolvedSecret, SecretResolvers
from gateway.tracing import trace_id_of

#: How the pipeline resolves a secret reference within a deadline (monotonic seconds).
Resolve = Callable[[SecretRef, CallContext, float], Awaitable[ResolvedSecret | None]]


class ChainKeys:
    """The fleet's signing keys as last resolved (one pipeline's, so one policy's at a
    time), kept while their secrets are unchanged: like Vault Agent's cache, an
    unchanged key costs a ``stat`` (a ``file://`` key; a look at the environment for
    ``env://``), not a resolution, a :class:`~gateway.agents.chain.SigningKeys` and
    its HMAC states per call.

    Kept only what went through the resolvers' whole :meth:`SecretResolvers.resolve`
    (its checks), and only while :meth:`SecretResolvers.unchanged` says each secret is
    still the very one resolved: a rotated key (a rewritten or swapped file, a changed
    variable) or an invalidated one is resolved again on the next call, as before. A
    ``vault://`` key is resolved per call (its own cache decides)."""

    __slots__ = ("_checks", "_kept", "_registered", "_resolvers")

    def __init__(self, resolvers: SecretResolvers) -> None:
        self._resolvers = resolvers
        #: (the references, what each resolved to, the keys made of them, and each
        #: reference's check of SecretResolvers.unchanged, looked up once when kept)
        self._kept: tuple[tuple[SecretRef, ...], tuple[ResolvedSecret, ...], chain.SigningKeys]
        self._kept = ((), (), chain.NO_KEYS)
        self._checks: tuple[Callable[[SecretRef, ResolvedSecret], object], ...] = ()
        self._registered = resolvers.registered

    def kept(self, refs: tuple[SecretRef, ...]) -> chain.SigningKeys | None:
        """The keys kept for ``refs`` while each secret is unchanged, else None (to be
        resolved: :meth:`keys`)."""
        kept_refs, kept, keys = self._kept
        if kept_refs is not refs or self._registered != self._resolvers.registered:
            return None
        for check, ref, resolved in zip(self._checks, refs, kept, strict=True):
            if check(ref, resolved) is not True:
                return None
        return keys

    async def keys(
        self, refs: tuple[SecretRef, ...], ctx: CallContext, deadline: float, resolve: Resolve
    ) -> chain.SigningKeys:
        """The keys ``refs`` (current first) name: the kept ones while unchanged, else
        resolved through ``resolve`` (its errors raised) and kept."""
        keys = self.kept(refs)
        if keys is not None:
            return keys
        resolved = [await resolve(ref, ctx, deadline) for ref in refs]
        found = tuple(r for r in resolved if r is not None)
        keys = chain.SigningKeys(*(r.secret for r in found))
        if len(found) == len(refs):
            self._checks = tuple(map(self._resolvers.unchanged_check, refs))
            self._registered = self._resolvers.registered
            self._kept = (refs, found, keys)
        return keys


async def chain_stage(
    spec: ChainSpec,
    request: ExternalCallRequest,
    ctx: CallContext,
    resolve: Resolve,
    memory: ChainMemory | None = None,
    cache: ChainKeys | None = None,
) -> chain.ChainDecision:
    """The call's chain decision, refused or not (its ``error``, a
    :class:`~gateway.errors.CallChainRefused` (409), is for the caller to record, then
    raise). Resolves ``chain.signing_key_ref`` (and the previous key) first when the
    policy names one: cached like any secret, and their errors (SECRET_NOT_FOUND,
    DEPENDENCY_FAILED...) are the call's, raised.

    A call gets the chain ``memory`` remembers for its W3C trace, whatever chain it
    carries (an agent that leaves the chain out, or sends one of its own, keeps its
    depth); its own only when none is remembered. A call to this sidecar's agent
    (``ctx.chain_inbound``: the inbound route) is admitted, not extended
    (:func:`gateway.agents.chain.admit`), and remembered in ``memory``.

    ``cache``: the keys as last resolved (:class:`ChainKeys`), used again while their
    secrets are unchanged; without one they are resolved per call."""
    keys = chain.NO_KEYS
    if spec.signing_key_ref is not None:  # checked per call: a rotated key is taken up
        deadline = ctx.started + request.timeout
        refs = _parsed(spec.signing_key_ref, spec.previous_signing_key_ref)
        if cache is not None:
            keys = await cache.keys(refs, ctx, deadline, resolve)
        else:
            resolved = [await resolve(ref, ctx, deadline) for ref in refs]
            keys = chain.SigningKeys(*(r.secret for r in resolved if r is not None))
    return _decided(spec, request, ctx, keys, memory)


def chain_here(
    spec: ChainSpec,
    request: ExternalCallRequest,
    ctx: CallContext,
    memory: ChainMemory | None = None,
    cache: ChainKeys | None = None,
) -> chain.ChainDecision | None:
    """:func:`chain_stage`'s decision without a coroutine when no signing key is to be
    resolved (none named, or ``cache`` keeps them unchanged: :meth:`ChainKeys.kept`).
    None otherwise, having resolved nothing: the caller then awaits :func:`chain_stage`."""
    keys = chain.NO_KEYS
    if spec.signing_key_ref is not None:  # checked per call: a rotated key is taken up
        if cache is None:
            return None
        kept = cache.kept(_parsed(spec.signing_key_ref, spec.previous_signing_key_ref))
        if kept is None:
            return None
        keys = kept
    return _decided(spec, request, ctx, keys, memory)


def _decided(
    spec: ChainSpec,
    request: ExternalCallRequest,
    ctx: CallContext,
    keys: chain.SigningKeys,
    memory: ChainMemory | None,
) -> chain.ChainDecision:
    """The call's chain decision with its signing keys resolved (:func:`chain_stage`)."""
    seen = request.call_chain if request.call_chain is not None else ctx.chain_seen
    now_ms = int(time.time() * 1000)
    if ctx.chain_inbound:
        return _admitted(spec, request, ctx, keys, memory, now_ms)
    if memory:  # empty (no inbound call yet): no trace id derived
        # The chain the inbound route saw for this trace, whatever the agent sent: an
        # agent resets its depth no more by replacing the chain than by leaving it out.
        seen = memory.recall([("trace", trace_key(request))], now_ms) or seen
    if seen is None and ctx.target_agent is None:
        # The common case, a chain that starts here: decide()'s decision without its
        # header rules (gateway.agents.chain.start).
        started = chain.start(ctx.agent_id, now_ms, request.timeout, spec, keys)
        if started is not None:
            return started
    return chain.decide(
        seen,
        own_agent=ctx.agent_id,
        target_agent=ctx.target_agent,  # an A2A target's a2a.agent_id
        now_ms=now_ms,
        timeout_s=request.timeout,
        spec=spec,
        keys=keys,
    )


@functools.lru_cache(maxsize=16)  # one pair per policy: parsed once, not per call
def _parsed(current: str, previous: str | None) -> tuple[SecretRef, ...]:
    """The signing keys' references, parsed (current first)."""
    return tuple(parse_ref(ref) for ref in (current, previous) if ref is not None)


def _admitted(
    spec: ChainSpec,
    request: ExternalCallRequest,
    ctx: CallContext,
    keys: chain.SigningKeys,
    memory: ChainMemory | None,
    now_ms: int,
) -> chain.ChainDecision:
    """The inbound route's decision: the chain that came (else the one remembered for
    the task or context asked about) admitted, and remembered for the trace and task
    (a refused one is returned, not remembered)."""
    ids = ctx.a2a_ids()
    seen = ctx.chain_seen
    if seen is None and memory is not None:
        seen = memory.recall([("task", ids[0]), ("context", ids[1])], now_ms)
    admitted = chain.admit(
        seen, own_agent=ctx.agent_id, now_ms=now_ms, timeout_s=request.timeout, spec=spec,
        keys=keys,
    )  # fmt: skip
    if admitted.error is None and memory is not None:
        keys_ = [("trace", trace_key(request)), ("task", ids[0]), ("context", ids[1])]
        memory.remember(keys_, admitted)
    return admitted


def trace_key(request: ExternalCallRequest) -> str:
    """The W3C trace id of ``request``: its ``traceparent``'s, else the one its
    ``trace_id`` maps to (:func:`gateway.tracing.trace_id_of`)."""
    parent = next((v for k, v in request.headers.items() if k.lower() == "traceparent"), "")
    parts = parent.strip().split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and parts[1] != "0" * 32:
        return parts[1].lower()
    return trace_id_of(request.trace_id)

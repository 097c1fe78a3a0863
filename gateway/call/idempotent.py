"""One upstream effect per idempotency key: replay a stored answer, wait for an identical
call in flight, or refuse a reused key whose request differs (docs/features/idempotency.md;
the rules of Stripe's idempotent requests).

What is stored is the answer the agent got (its HTTP status and envelope): successes and
the upstream's own 4xx verdicts (UPSTREAM_REJECTED), never a failure that a resend might
not meet again (5xx, 429, timeouts: the key is abandoned and a resend goes upstream).
Once the upstream has acted, nothing can leave the key in flight: the answer is stored
even when its data cannot be written as JSON (a note replaces it) or the store fails.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.audit import get_logger
from gateway.call.attempts import deadline_error
from gateway.call.bodies import parse_sse
from gateway.call.record import CallContext
from gateway.call.relay import AgentGone, Relay
from gateway.envelope import ExternalCallRequest, ExternalCallResponse
from gateway.errors import GatewayError, IdempotencyConflict, UpstreamRejected
from gateway.fastjson import answer_json
from gateway.idempotency.base import Conflict, IdempotencyStore, InFlight, Replay
from gateway.idempotency.keys import fingerprint, store_key

_log = get_logger("gateway.pipeline")


class Rendered:
    """The JSON bytes of the answer :func:`once_per_key` stored last on the envelope
    route, kept so that the server sends them as they are instead of writing the same
    answer a second time (one serialisation per call). One slot, held by the pipeline
    (gone with it): the server takes it in the same step of the event loop (no await
    between the pipeline's return and the answer's writing), so calls cannot overwrite
    each other's; an answer the server does not write after all (a failure replaced
    it) leaves its bytes here until the next one: at most one answer's."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        #: (a weak reference to the answer, its JSON bytes: ``answer_json``), or None.
        self.last: tuple[weakref.ref[ExternalCallResponse], bytes] | None = None

    def take(self, response: ExternalCallResponse) -> bytes | None:
        """The JSON bytes of ``response`` (``answer_json``) if they were kept for this answer
        (the same object, not an equal one), else None. Taken once."""
        last = self.last
        if last is None or last[0]() is not response:
            return None
        self.last = None
        return last[1]

    @property
    def empty(self) -> bool:
        """Nothing kept (or what was kept was taken)."""
        return self.last is None


class Learned:
    """What :func:`once_per_key` learns for the call's record, kept here rather than
    written into the call's context (the pipeline does that): whether the answer is a
    replay, and its warnings (a key the store failed to settle, an answer JSON could
    not hold)."""

    # Class defaults and no __init__: made once per keyed call, without a Python frame.
    replayed: bool = False
    json_data: bool = False  # the stored data was a JSON body's value reading like a form
    warnings: tuple[str, ...] = ()  # rare: a tuple, grown when there is one

    def warn(self, note: str) -> None:
        self.warnings = (*self.warnings, note)


async def once_per_key(
    store: IdempotencyStore,
    request: ExternalCallRequest,
    target: str,
    ctx: CallContext,
    *,
    deadline: float,
    ttl_s: float,
    forward: Callable[[], Awaitable[ExternalCallResponse]],
    failure: Callable[[GatewayError], ExternalCallResponse],
    relay: Relay | None = None,
    rendered: Rendered | None = None,
    learned: Learned | None = None,
) -> tuple[int, ExternalCallResponse]:
    """Run ``forward`` at most once for ``ctx.idempotency_key`` on ``target``; returns
    (HTTP status, answer). Raises :class:`IdempotencyConflict` for a reused key, AGENT_
    TIMEOUT when an identical call in flight outlasts the deadline, and whatever
    ``forward`` raises (``failure`` builds the answer stored for an UPSTREAM_REJECTED).
    A stored streamed answer is replayed to ``relay`` as its stream when one is given;
    the JSON of a stored envelope answer is kept in ``rendered`` for the server. What
    the record learns goes to ``learned`` (``ctx`` is only read)."""
    assert ctx.idempotency_key is not None
    if learned is None:
        learned = Learned()
    key = store_key(target, ctx.idempotency_key)
    fp = fingerprint(
        target,
        request.method,
        request.endpoint,
        request.parameters,
        query=request.query,
        body=request.body.model_dump() if request.body is not None else None,
    )
    while True:
        outcome = await store.begin(key, fp, lease_s=max(deadline - time.monotonic(), 0.001))
        if isinstance(outcome, Replay):
            return await replay(outcome.answer, request, ctx, relay, learned)
        if isinstance(outcome, Conflict):
            raise IdempotencyConflict(
                f"idempotency key {ctx.idempotency_key!r} was already used on target "
                f"{target!r} with a different request (method, endpoint or "
                "parameters differ); use a new key for a new request",
                details={"reason": "key_reused", "idempotency_key": ctx.idempotency_key},
            )
        if isinstance(outcome, InFlight):
            stored = await store.wait(key, fp, deadline=deadline)
            if stored is not None:
                return await replay(stored, request, ctx, relay, learned)
            if time.monotonic() >= deadline:
                raise deadline_error("waiting for an identical call in flight")
            continue
        break
    token = outcome.token
    try:
        response = await forward()
    except UpstreamRejected as exc:
        # The upstream's definitive answer to this request: replay it, like Stripe.
        await settle(
            store, key, token, stored_answer(answer_status(exc), failure(exc)), ttl_s, ctx, learned
        )
        raise
    except BaseException:
        await asyncio.shield(store.abandon(key, token))
        raise
    # From here on the upstream has acted: whatever fails, the key is completed with
    # the answer the agent gets, so that a resend replays it and never acts twice.
    try:
        body = answer_json(response)
    except ValueError as exc:  # a value the JSON writer refuses (bodies.py rules it out)
        response = _unrenderable(response, exc, learned)
        body = answer_json(response)
    if rendered is not None and ctx.api == "envelope" and ctx.mcp is None:
        # The agent gets these same bytes. Not for an MCP exchange, whose data would be
        # filtered in place after this (the policy refuses idempotency on MCP targets
        # today), nor the other routes, which write answers of their own.
        rendered.last = (weakref.ref(response), body)  # taken by Rendered.take
    stored = _stored(200, body, ctx.stream_body, json_data=ctx.json_data)
    await settle(store, key, token, stored, ttl_s, ctx, learned)
    return 200, response


async def replay(
    stored: bytes,
    request: ExternalCallRequest,
    ctx: CallContext,
    relay: Relay | None = None,
    learned: Learned | None = None,
) -> tuple[int, ExternalCallResponse]:
    """A stored answer as the answer to ``request`` (its ids, ``replayed``, this latency).

    A stored streamed answer (its events kept) is sent again as a stream to ``relay``
    when the agent asked for one; otherwise its ``data`` is the stream's assembled form."""
    doc = json.loads(stored)
    if learned is not None:
        learned.replayed = True
        learned.json_data = doc.get("json") is True
    response = ExternalCallResponse.model_validate(doc["response"])
    update: dict[str, Any] = {
        "replayed": True,
        "trace_id": request.trace_id,
        "correlation_id": request.correlation_id,
    }
    stream = doc.get("stream")
    if stream is not None:
        body = base64.b64decode(stream)
        if relay is not None:
            with contextlib.suppress(AgentGone):  # nobody left to replay to: still audited
                await relay.start()
                await relay.send(body)
            update["data"] = None
        else:
            update["data"] = parse_sse(body)
    update["latency_ms"] = round((time.monotonic() - ctx.started) * 1000, 3)
    return int(doc["status"]), response.model_copy(update=update)


def answer_status(exc: GatewayError) -> int:
    """The HTTP status of the sidecar's answer for ``exc`` (an upstream 4xx is passed on)."""
    if isinstance(exc, UpstreamRejected) and exc.status_code and 400 <= exc.status_code < 500:
        return exc.status_code
    return exc.http_status


async def settle(
    store: IdempotencyStore,
    key: str,
    token: str,
    stored: bytes,
    ttl_s: float,
    ctx: CallContext,
    learned: Learned,
) -> None:
    """Complete the idempotency key with the answer. A store that fails here (Redis gone)
    must not turn the upstream's answer into an error: the agent still gets it, the audit
    record says the key is unsettled (it frees itself when its lease runs out)."""
    try:
        await store.complete(key, token, stored, ttl_s=ttl_s)
    except Exception as exc:  # noqa: BLE001 - the answer exists; report, do not lose it
        _log.error(
            "idempotency_key_not_settled",
            idempotency_key=ctx.idempotency_key,
            error=type(exc).__name__,
            trace_id=ctx.request.trace_id if ctx.request else None,
            correlation_id=ctx.request.correlation_id if ctx.request else None,
        )
        learned.warn(
            f"idempotency key not settled ({type(exc).__name__}): a resend after this call's "
            "deadline may reach the upstream again"
        )


def _unrenderable(
    response: ExternalCallResponse, exc: Exception, learned: Learned
) -> ExternalCallResponse:
    """``response`` with a ``data`` the JSON writer refused replaced by a note saying so."""
    note = f"the upstream's answer could not be written as JSON ({str(exc)[:200]})"
    learned.warn(note)
    return response.model_copy(update={"data": {"content_type": None, "text": note}})


def stored_answer(
    status: int, response: ExternalCallResponse, stream: bytes | None = None
) -> bytes:
    """An answer as the idempotency store keeps it: its HTTP status, the envelope, and
    for a streamed answer its events (the stream's bytes, base64), to replay them."""
    return _stored(status, answer_json(response), stream)


def _stored(status: int, body: bytes, stream: bytes | None, *, json_data: bool = False) -> bytes:
    """:func:`stored_answer` from the envelope's JSON ``body``; ``json_data``: its data
    is a JSON body's value that reads like a form (``"json": true``, read by
    :func:`replay`)."""
    if json_data:
        return b'{"status":%d,"response":%s,"json":true}' % (status, body)
    if stream is None:
        return b'{"status":%d,"response":%s}' % (status, body)
    return b'{"status":%d,"response":%s,"stream":"%s"}' % (
        status,
        body,
        base64.b64encode(stream),
    )

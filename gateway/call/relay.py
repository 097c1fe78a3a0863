"""Relaying an upstream event stream to the agent as it arrives (design.md, "Streaming to
the agent").

The upstream's bytes go to the agent unchanged, whole event by whole event, as they
arrive (an event cut by the network waits for its end, so a cut stream never leaves a
half event for the final one to run into, and each event is scrubbed whole); the
stream is read at the same time by :class:`gateway.call.stream.StreamJudge`, which keeps
the verdict and the usage. Memory is bounded whatever the stream's length: one chunk in
hand, one event's text in the decoder, the usage-bearing events; a slow agent slows the
relay (the write to the agent waits for its socket to drain), and
``server.max_response_bytes`` bounds the total.

Time: each gap between two chunks is bounded by the target's ``stream_idle_timeout_s``
(STREAM_INTERRUPTED, reason ``idle_timeout``), the whole call by its deadline
(AGENT_TIMEOUT), writes to the agent included: an agent that stops reading (its TCP
window shut, the write waiting for it to drain) is cut at the deadline with reason
``agent_stalled``, and its connection is dropped rather than written to again. The agent
hanging up closes the upstream request at once.

The HTTP side is :class:`gateway.api.http.Stream`, framed by the call's API: it hands in
a :class:`Relay`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.call.sse import EventTooLarge, SseDecoder, complete_events
from gateway.call.stream import StreamJudge
from gateway.errors import DeadlineExceeded, GatewayError, ResponseTooLarge, StreamInterrupted
from gateway.upstream import TransportError

#: An ``event:`` line naming one of the sidecar's own events (at a line start).
_OWN_EVENT = re.compile(rb"((?:^|[\r\n])event: ?)egress\.")


class AgentGone(Exception):
    """The agent closed its connection while its stream was being relayed."""


#: ``details.reason`` of the AGENT_TIMEOUT raised when the agent stopped reading: the
#: server drops its connection instead of writing it a last event it would not read.
AGENT_STALLED = "agent_stalled"


class Relay(Protocol):
    """Where a streamed answer goes: the agent's answer, framed by its API
    (:class:`gateway.api.http.Stream`).

    ``start`` sends the agent its 200 and headers (once); ``send`` writes one chunk and
    returns when the agent's connection can take more (backpressure); both raise
    :class:`AgentGone` when the agent hung up."""

    @property
    def started(self) -> bool: ...

    async def start(self) -> None: ...

    async def send(self, chunk: bytes) -> None: ...


@dataclass(slots=True)
class Relayed:
    """What a relayed stream was: bytes and events relayed, seconds from the start of the
    call to the first relayed byte, and the judge that read it."""

    judge: StreamJudge
    bytes: int = 0
    first_byte_s: float | None = None
    #: The relayed bytes, when they are to be stored (a keyed call), else None.
    kept: bytearray | None = None
    #: The drift check of a call under ``models:`` rules (:func:`gateway.call.models.
    #: drift`): given the model the stream's first events name, the error that refuses
    #: the stream, or None. While set, whole events are held (not relayed) until an
    #: event names a model (the judge's ``model``) or the stream ends.
    gate: Callable[[str], GatewayError | None] | None = None
    #: The events held by ``gate``, not relayed yet.
    waiting: bytearray = field(default_factory=bytearray)


async def relay_stream(
    stream: Any,
    relay: Relay,
    done: Relayed,
    *,
    started: float,
    deadline: float,
    idle_timeout_s: float,
    max_bytes: int,
) -> Relayed:
    """Relay ``stream`` (an open :class:`gateway.upstream.client.UpstreamStream`) to
    ``relay`` until its end, recording in ``done`` what was relayed (also when it fails).
    Raises the GatewayError its end calls for (a judged failure, STREAM_INTERRUPTED,
    AGENT_TIMEOUT, RESPONSE_TOO_LARGE); the agent hanging up is STREAM_INTERRUPTED with
    reason ``agent_disconnected``. The upstream stream is always closed on return."""
    judge = done.judge
    decoder = SseDecoder(max_bytes)
    held = bytearray()  # bytes after the last whole event, not relayed yet
    # One timer for the whole relay, moved only when its bound changes: the gap to the
    # next chunk is bounded by min(idle timeout, deadline), a write to the agent by the
    # deadline. With a deadline nearer than the idle timeout (the usual case) both are
    # the deadline and the timer never moves; two timers per chunk were ~40% of the
    # relay's own cost per chunk.
    loop_deadline = _loop_time(deadline)
    loop = asyncio.get_running_loop()
    sending = False
    tail = bytearray()  # events a gate held to the stream's end
    try:
        try:
            async with asyncio.timeout_at(loop_deadline) as timer:
                while True:
                    if deadline - time.monotonic() <= 0:
                        raise _deadline(judge)
                    sending = False
                    _arm(timer, min(loop.time() + idle_timeout_s, loop_deadline))
                    try:
                        chunk = await stream.read()
                    except TransportError as exc:
                        raise StreamInterrupted(
                            f"{exc.message} after {judge.events} events",
                            details={"reason": "reset", "target": judge.target},
                        ) from None
                    if not chunk:
                        for event in decoder.close():
                            judge.observe(event)
                        tail = _ungated(done, judge)  # held to the end: no model named
                        break
                    done.bytes += len(chunk)
                    if done.bytes > max_bytes:
                        raise _too_large(judge, max_bytes)
                    searched = len(held)  # held has no event end: a new one is in chunk
                    held += chunk
                    cut = complete_events(held, searched)
                    gone = False
                    fed = done.gate is not None
                    if fed:  # judged before it is relayed: the model decides
                        _feed(decoder, judge, chunk, max_bytes)
                    if cut:  # else no whole event yet: nothing is relayed half-way
                        whole, held = bytes(held[:cut]), held[cut:]
                        if fed:
                            done.waiting += whole
                            whole = _released(done, judge)
                    if cut and whole:
                        # Relayed before it is judged: the verdict is only read at the
                        # end, and judging first made the agent's first byte wait for
                        # the parse of every event in the chunk (often all of a fast
                        # upstream's).
                        sending = True
                        _arm(timer, loop_deadline)
                        try:
                            await _send(relay, done, whole, started)
                        except AgentGone:
                            gone = True
                    if not fed:
                        _feed(decoder, judge, chunk, max_bytes)
                    if gone:
                        raise StreamInterrupted(
                            f"the agent hung up after {judge.events} events; the upstream "
                            "request was closed",
                            details={"reason": "agent_disconnected", "target": judge.target},
                        )
        except TimeoutError:
            if sending:
                raise _stalled(judge) from None
            if timer.when() == loop_deadline:
                raise _deadline(judge) from None
            raise StreamInterrupted(
                f"the stream from target {judge.target!r} sent nothing for "
                f"{idle_timeout_s:.3g} s (stream_idle_timeout_s)",
                details={"reason": "idle_timeout", "target": judge.target},
            ) from None
    finally:
        await stream.aclose()
    error = judge.verdict(status=200)
    if error is not None:
        raise error  # an unfinished last event is dropped: the final event says why
    if tail:
        with contextlib.suppress(AgentGone):  # the call ended well; the agent just left
            try:
                async with asyncio.timeout_at(loop_deadline):
                    await _send(relay, done, bytes(tail), started)
            except TimeoutError:
                raise _stalled(judge) from None
    if held.strip():
        # A last event without its blank line that still completed the stream (``data:
        # [DONE]`` right before the close): closed here, so it cannot run into ours.
        with contextlib.suppress(AgentGone):  # the call ended well; the agent just left
            try:
                async with asyncio.timeout_at(loop_deadline):
                    await _send(relay, done, bytes(held) + b"\n\n", started)
            except TimeoutError:
                raise _stalled(judge) from None
    return done


def _feed(decoder: SseDecoder, judge: StreamJudge, chunk: bytes, max_bytes: int) -> None:
    """Decode ``chunk``'s events and have ``judge`` observe each."""
    try:
        for event in decoder.feed(chunk):
            judge.observe(event)
    except EventTooLarge:
        raise _too_large(judge, max_bytes) from None


def _released(done: Relayed, judge: StreamJudge) -> bytes:
    """The held events to relay now: all of them once an event named a model that
    ``done.gate`` lets pass (then the gate is lifted), none before. Raises the gate's
    error for a model it refuses (nothing of the stream was relayed)."""
    if done.gate is None or judge.model is None:
        return b""
    return bytes(_ungated(done, judge))


def _ungated(done: Relayed, judge: StreamJudge) -> bytearray:
    """Lift the gate (the stream ended, or its model passed): the held events. A model
    named only by the stream's last events is judged here too."""
    gate, done.gate = done.gate, None
    if gate is not None and judge.model is not None and (error := gate(judge.model)):
        raise error
    waiting, done.waiting = done.waiting, bytearray()
    return waiting


def _arm(timer: asyncio.Timeout, when: float) -> None:
    if timer.when() != when:
        timer.reschedule(when)


async def _send(relay: Relay, done: Relayed, whole: bytes, started: float) -> None:
    """Relay whole events: open the agent's stream on the first, keep them for the
    idempotency store when asked. An upstream event named like the sidecar's own
    (``egress.*``) is renamed ``upstream.egress.*``: only the sidecar ends a stream.
    The write waits for the agent to take the bytes (backpressure); the caller bounds
    it by the call's deadline (past it, :func:`_stalled`)."""
    if b"egress." in whole:
        whole = _OWN_EVENT.sub(rb"\1upstream.egress.", whole)
    if done.kept is not None:
        done.kept += whole
    if not relay.started:
        await relay.start()
        done.first_byte_s = time.monotonic() - started
    await relay.send(whole)


def _stalled(judge: StreamJudge) -> GatewayError:
    return DeadlineExceeded(
        "the call's deadline passed while the agent was not reading its stream "
        "(its connection took no more bytes); the upstream request was closed",
        details={"reason": AGENT_STALLED, "target": judge.target},
    )


def _loop_time(deadline: float) -> float:
    """``deadline`` (on ``time.monotonic``) on the running loop's clock."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


def _deadline(judge: StreamJudge) -> GatewayError:
    return DeadlineExceeded(
        f"the call's deadline passed while target {judge.target!r} was streaming "
        f"({judge.events} events relayed)",
        details={"reason": "deadline", "target": judge.target},
    )


def _too_large(judge: StreamJudge, limit: int) -> GatewayError:
    return ResponseTooLarge(
        f"the stream from target {judge.target!r} passed {limit} bytes (server.max_response_bytes)",
        details={"limit_bytes": limit, "target": judge.target},
        status_code=200,
    )

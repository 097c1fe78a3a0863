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

The HTTP side is :class:`gateway.api.writer.Stream`, framed by the call's API: it hands in
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

from gateway.call.sse import EVENT_ENDS, EventTooLarge, SseDecoder, complete_events
from gateway.call.stream import StreamJudge, malformed_error
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
    (:class:`gateway.api.writer.Stream`).

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
    first_event_timeout_s: float | None = None,
    rewrite: Callable[[bytes], bytes] | None = None,
) -> Relayed:
    """Relay ``stream`` (an open :class:`gateway.upstream.client.UpstreamStream`) to
    ``relay`` until its end, recording in ``done`` what was relayed (also when it fails).
    Raises the GatewayError its end calls for (a judged failure, STREAM_INTERRUPTED,
    AGENT_TIMEOUT, RESPONSE_TOO_LARGE); the agent hanging up is STREAM_INTERRUPTED with
    reason ``agent_disconnected``. The upstream stream is always closed on return.
    ``first_event_timeout_s`` (a target's ``first_byte_timeout_s``) bounds the wait for
    the first whole event instead of ``idle_timeout_s``: past it, STREAM_INTERRUPTED
    with reason ``first_byte_timeout``, nothing relayed (a fallback may serve).
    ``rewrite`` (whole events -> what the agent gets of them) removes what the sidecar
    added to the request (:func:`gateway.providers.asking_usage`); the events are
    judged as the upstream sent them. A malformed event (:attr:`StreamJudge.malformed`)
    ends the stream after the read that carried it.

    Whole events are relayed before they are judged: the verdict is only read at the
    end, and judging first made the agent's first byte wait for the parse of every event
    in the chunk (often all of a fast upstream's)."""
    judge = done.judge
    decoder = SseDecoder(max_bytes)
    held = bytearray()  # bytes after the last whole event, not relayed yet
    loop_deadline = _loop_time(deadline)
    loop = asyncio.get_running_loop()
    tail = bytearray()  # events a gate held to the stream's end
    gap = idle_timeout_s if first_event_timeout_s is None else first_event_timeout_s
    first = first_event_timeout_s is not None  # no whole event came yet
    dog = _Watchdog(loop, loop_deadline, gap)
    try:
        try:
            while True:
                if deadline - time.monotonic() <= 0:
                    raise _deadline(judge)
                dog.reading(loop.time(), gap)
                try:
                    chunk = await stream.read()
                except TransportError as exc:
                    tail, held = _broken(done, exc), bytearray()  # a half event dropped
                    break
                if not chunk:
                    tail = _ended(decoder, judge, done)
                    break
                done.bytes += len(chunk)
                if done.bytes > max_bytes:
                    raise _too_large(judge, max_bytes)
                gone, fed = False, done.gate is not None
                if fed:  # judged before it is relayed: the model decides
                    _feed(decoder, judge, chunk, max_bytes)
                whole, held = _whole(held, chunk)  # b"": no whole event yet, none relayed
                if whole:
                    gap, first = idle_timeout_s, False
                    if fed:
                        whole = _released(done, judge, whole)
                    if whole and rewrite is not None:
                        whole = rewrite(whole)
                    if whole:
                        dog.sending = True
                        try:  # relayed before judged (see above)
                            await _send(relay, done, whole, started)
                        except AgentGone:
                            gone = True
                if not fed:
                    _feed(decoder, judge, chunk, max_bytes)
                if judge.malformed:  # ended there: its SDK raises on such an event
                    raise malformed_error(judge.target, judge.events)
                if gone:
                    raise _agent_gone(judge)
        except asyncio.CancelledError:
            if not dog.expired():
                raise
            tail = _after_timer(done, dog, idle_timeout_s, first, first_event_timeout_s)
            held = bytearray()  # a half event after the marker is dropped
        finally:
            dog.close()
    finally:
        await stream.aclose()
    await _finish(relay, done, tail, held, started, loop_deadline, rewrite)
    return done


def _whole(held: bytearray, chunk: bytes) -> tuple[bytes, bytearray]:
    """``(whole events to relay now, bytes held after them)`` once ``chunk`` is added to
    ``held`` (bytes after the last whole event, no event end among them)."""
    if not held and chunk.endswith(EVENT_ENDS):
        return chunk, held  # the usual: the read is whole events; no copy
    searched = len(held)  # held has no event end: a new one is in chunk
    held += chunk
    cut = complete_events(held, searched)
    if not cut:
        return b"", held
    return bytes(held[:cut]), held[cut:]


class _Watchdog:
    """The relay's one timer: it cancels the relaying task when the upstream sent
    nothing for ``gap`` seconds while being read (:meth:`reading`), or at the deadline
    (loop clock), writes to the agent (``sending``) included.

    Moved lazily: a chunk only records when its read began; the timer, when it goes
    off, compares the bound that time gives with the time it was set for and, the bound
    having moved on, is set again for it. So a relayed chunk costs two attribute
    stores instead of two reschedules of an ``asyncio.timeout`` (each a cancelled timer
    handle and a new one on the loop's heap; ~20 % of the relay's own cost per chunk).
    Bounds are the same: it goes off at min(read start + gap, deadline) while reading,
    at the deadline while sending; a bound that came nearer than the timer (a shorter
    gap after the first event, a read after a long write) sets it again at once."""

    __slots__ = ("_at", "_cancelling", "_deadline", "_handle", "_loop", "_task", "at_deadline",
                 "fired", "gap", "sending", "since")  # fmt: skip

    def __init__(self, loop: asyncio.AbstractEventLoop, deadline: float, gap: float) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._loop, self._task, self._deadline = loop, task, deadline
        self._cancelling = task.cancelling()
        self.since, self.gap, self.sending = loop.time(), gap, False
        self.fired = self.at_deadline = False
        self._at = self._bound()
        self._handle: asyncio.TimerHandle | None = loop.call_at(self._at, self._check)

    def reading(self, now: float, gap: float) -> None:
        """A read begins at ``now`` (loop clock), bounded by ``gap`` seconds."""
        self.since, self.gap, self.sending = now, gap, False
        if now + gap < self._at and self._handle is not None:
            self._set(self._bound())

    def _bound(self) -> float:
        if self.sending:
            return self._deadline
        return min(self.since + self.gap, self._deadline)

    def _set(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._at = when
        self._handle = self._loop.call_at(when, self._check)

    def _check(self) -> None:
        bound = self._bound()
        if bound > self._at:  # a read began, or a write, since it was set: not yet
            self._set(bound)
            return
        self._handle = None
        self.fired, self.at_deadline = True, self._at >= self._deadline
        self._task.cancel()

    def expired(self) -> bool:
        """Whether the CancelledError being handled is this timer's (and only its)."""
        return self.fired and self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _after_timer(
    done: Relayed,
    dog: _Watchdog,
    idle_timeout_s: float,
    first: bool,
    first_event_timeout_s: float | None,
) -> bytearray:
    """The relay's timer went off: raise the error it means (:func:`_timed_out`), unless
    the terminal marker had arrived and no write to the agent was waiting: then the
    stream is whole (its upstream fell silent after the marker without ending its
    response), and the events a gate held are returned."""
    judge = done.judge
    if dog.sending or not judge.marked_complete:
        raise _timed_out(
            judge, dog.sending, dog.at_deadline, idle_timeout_s, first, first_event_timeout_s
        ) from None
    return _ungated(done, judge)


def _timed_out(
    judge: StreamJudge,
    sending: bool,
    at_deadline: bool,
    idle_timeout_s: float,
    first: bool,
    first_event_timeout_s: float | None,
) -> GatewayError:
    """What the relay's one timer firing means: the agent stalled a write (``sending``),
    the deadline passed (the timer stood at it), no first event came in time (``first``),
    or the upstream went idle."""
    if sending:
        return _stalled(judge)
    if at_deadline:
        return _deadline(judge)
    if first:
        return _no_first_event(judge, first_event_timeout_s)
    return _idle(judge, idle_timeout_s)


async def _finish(
    relay: Relay,
    done: Relayed,
    tail: bytearray,
    held: bytearray,
    started: float,
    loop_deadline: float,
    rewrite: Callable[[bytes], bytes] | None,
) -> None:
    """The upstream closed: raise the stream's verdict if it failed, else relay what is
    left (the events a gate held to the end, then an unterminated last event), each
    through ``rewrite`` when given."""
    error = done.judge.verdict(status=200)
    if error is not None:
        raise error  # an unfinished last event is dropped: the final event says why
    if tail and rewrite is not None:
        tail = bytearray(rewrite(bytes(tail)))
    if rewrite is not None and held.strip():
        held = bytearray(rewrite(bytes(held) + b"\n\n").rstrip(b"\r\n"))
    if tail:
        await _send_last(relay, done, bytes(tail), started, loop_deadline)
    if held.strip():
        # A last event without its blank line that still completed the stream (``data:
        # [DONE]`` right before the close): closed here, so it cannot run into ours.
        await _send_last(relay, done, bytes(held) + b"\n\n", started, loop_deadline)


def _ended(decoder: SseDecoder, judge: StreamJudge, done: Relayed) -> bytearray:
    """The upstream closed: ``judge`` observes the decoder's last events; returns the
    events a gate held to the end (no model named), to relay after the verdict."""
    for event in decoder.close():
        judge.observe(event)
    return _ungated(done, judge)


async def _send_last(
    relay: Relay, done: Relayed, data: bytes, started: float, loop_deadline: float
) -> None:
    """Relay ``data`` after a good verdict, by the deadline (else AGENT_STALLED)."""
    with contextlib.suppress(AgentGone):  # the call ended well; the agent just left
        try:
            async with asyncio.timeout_at(loop_deadline):
                await _send(relay, done, data, started)
        except TimeoutError:
            raise _stalled(done.judge) from None


def _broken(done: Relayed, exc: TransportError) -> bytearray:
    """The upstream's connection broke: STREAM_INTERRUPTED, unless the terminal marker
    had arrived; then the stream is complete, as an assembled one is judged (the agent
    has the whole answer), and the events a gate held are returned."""
    if not done.judge.marked_complete:
        raise _reset(done.judge, exc) from None
    return _ungated(done, done.judge)


def _reset(judge: StreamJudge, exc: TransportError) -> GatewayError:
    return StreamInterrupted(
        f"{exc.message} after {judge.events} events",
        details={"reason": "reset", "target": judge.target},
    )


def _agent_gone(judge: StreamJudge) -> GatewayError:
    return StreamInterrupted(
        f"the agent hung up after {judge.events} events; the upstream request was closed",
        details={"reason": "agent_disconnected", "target": judge.target},
    )


def _idle(judge: StreamJudge, idle_timeout_s: float) -> GatewayError:
    return StreamInterrupted(
        f"the stream from target {judge.target!r} sent nothing for "
        f"{idle_timeout_s:.3g} s (stream_idle_timeout_s)",
        details={"reason": "idle_timeout", "target": judge.target},
    )


def _feed(decoder: SseDecoder, judge: StreamJudge, chunk: bytes, max_bytes: int) -> None:
    """Decode ``chunk``'s events and have ``judge`` observe each."""
    whole = decoder.feed_whole(chunk)
    if whole is not None:  # one event alone, the usual read: its data not decoded
        judge.observe_raw(*whole)
        return
    try:
        for event in decoder.feed(chunk):
            judge.observe(event)
    except EventTooLarge:
        raise _too_large(judge, max_bytes) from None


def _released(done: Relayed, judge: StreamJudge, whole: bytes) -> bytes:
    """Hold ``whole`` (events the gate sees before they are relayed); the held events to
    relay now: all of them once an event named a model that ``done.gate`` lets pass
    (then the gate is lifted), none before. Raises the gate's error for a model it
    refuses (nothing of the stream was relayed)."""
    done.waiting += whole
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


async def _send(relay: Relay, done: Relayed, whole: bytes, started: float) -> None:
    """Relay whole events: open the agent's stream on the first, keep them for the
    idempotency store when asked. An upstream event named like the sidecar's own
    (``egress.*``) is renamed ``upstream.egress.*``: only the sidecar ends a stream.
    The write waits for the agent to take the bytes (backpressure); the caller bounds
    it by the call's deadline (past it, :func:`_stalled`)."""
    if whole.find(b"egress.") >= 0:  # not ``in``: see redaction._scrub_forms_bytes
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


def _no_first_event(judge: StreamJudge, timeout_s: float | None) -> GatewayError:
    return StreamInterrupted(
        f"the stream from target {judge.target!r} sent no event within "
        f"{timeout_s or 0:.3g} s (first_byte_timeout_s)",
        details={"reason": "first_byte_timeout", "target": judge.target},
    )


def _too_large(judge: StreamJudge, limit: int) -> GatewayError:
    return ResponseTooLarge(
        f"the stream from target {judge.target!r} passed {limit} bytes (server.max_response_bytes)",
        details={"limit_bytes": limit, "target": judge.target},
        status_code=200,
    )

"""Judging a stream by the stream itself (pure, no I/O).

A 200 ``text/event-stream`` answer is a success only when the provider's terminal marker
arrived; an error event inside it is a failure with the mapped code; a stream that ends
without its marker is STREAM_INTERRUPTED (design.md, "Streaming to the agent"). What each
provider sends is its dialect's knowledge (:mod:`gateway.providers`, ``stream_signal``);
this module keeps the verdict while the events pass, with bounded memory: only the
events that carry usage are kept, at most :data:`MAX_USAGE_EVENTS` of them.

Targets with ``usage: none`` have no dialect: their streams are judged by HTTP framing.
"""

from __future__ import annotations

import json
from typing import Any, Final

from gateway.call.bodies import is_json_type, media_type, parse_sse
from gateway.call.sse import SseEvent, decode_all
from gateway.errors import (
    CapacityExceeded,
    DependencyFailed,
    GatewayError,
    QuotaExhausted,
    StreamInterrupted,
    UpstreamRejected,
)
from gateway.fastjson import loads_fast
from gateway.providers import DIALECTS, Dialect, TokenUsage
from gateway.providers.base import END, StreamFailure

#: Usage-bearing events kept per stream (the first, for Anthropic's ``message_start``,
#: and the latest others): a stream of any length keeps at most this many.
MAX_USAGE_EVENTS: Final = 64
_JSON_STARTS: Final = ("{", "[")
_JSON_BYTE_STARTS: Final = (b"{", b"[")


def _judged_data(data: str) -> Any:
    """An event's data as the judge reads it: JSON when it is JSON, else the text. Only
    read here (the relay sends the upstream's bytes), so the plain parser will do: the
    rules that keep written-back data exact (:func:`gateway.call.bodies.event_data`)
    cost three times as much per event."""
    if not data or data[0] not in "{[":
        return data
    try:
        return loads_fast(data)  # several times the stdlib's speed, once per event
    except ValueError:
        pass  # NaN, numbers past a double, deep nesting: the stdlib decides
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return data


def _not_json(text: str) -> bool:
    """True when ``text`` (an event's data that the judge could not read as JSON) is not
    JSON at all; JSON too deep to read is JSON (kept as its text, not malformed)."""
    try:
        json.loads(text)
    except RecursionError:
        return False
    except ValueError:
        return True
    return False  # pragma: no cover - the judge's reader had failed on it


class StreamJudge:
    """Feed it every event with :meth:`observe`; at the end, :meth:`verdict` says whether
    the stream is a success (None) or the error to answer with."""

    __slots__ = (
        "_dialect",
        "_usage_events",
        "complete",
        "events",
        "failure",
        "malformed",
        "model",
        "target",
        "watch_model",
    )

    def __init__(self, provider: str, target: str) -> None:
        self._dialect: Dialect | None = DIALECTS.get(provider)
        self._usage_events: list[Any] = []
        self.target = target
        #: The terminal marker arrived.
        self.complete = self._dialect is None
        #: The first error event, if any.
        self.failure: StreamFailure | None = None
        self.events = 0
        #: Events of a provider dialect whose data looked like JSON and was not.
        self.malformed = 0
        #: With ``watch_model`` set: the model the first event that names one names
        #: (OpenAI's first chunk, Anthropic's ``message_start``, Gemini's first chunk),
        #: for the drift check (:mod:`gateway.call.models`); None until then.
        self.watch_model = False
        self.model: str | None = None

    def observe(self, event: SseEvent) -> Any:
        """Judge one event; returns its ``data``, parsed as JSON when it is JSON. A
        provider's event whose data starts like JSON and is not (a malformed event) is
        counted in :attr:`malformed`: its SDK would raise on it."""
        data: Any = event.data
        if data[:1] in _JSON_STARTS:
            try:  # the usual, once per event relayed: one C call
                data = loads_fast(data)
            except ValueError:
                data = self._unread(data)
        return self.observe_data(event.event, data)

    def observe_raw(self, name: str | None, raw: bytes) -> Any:
        """:meth:`observe` for an event given as its type and the UTF-8 bytes of its data
        (:meth:`gateway.call.sse.SseDecoder.feed_whole`): the same judgement, the same
        data; JSON is parsed from the bytes, not from a decoded copy."""
        if raw[:1] in _JSON_BYTE_STARTS:
            try:
                data = loads_fast(raw)
            except ValueError:  # not JSON, or not UTF-8: read as observe reads its text
                data = self._unread(raw.decode("utf-8", "replace"))
        else:
            data = raw.decode("utf-8", "replace")
        return self.observe_data(name, data)

    def _unread(self, text: str) -> Any:
        """Data that starts like JSON and that the fast parser refused: what the stdlib
        reads of it, else the text (counted malformed for a provider, but for OpenAI's
        ``[DONE]``, not JSON by design)."""
        data = _judged_data(text)
        if data.__class__ is str and data != "[DONE]" and self._dialect is not None:
            self.malformed += _not_json(data)
        return data

    def observe_data(self, name: str | None, data: Any) -> Any:
        """Judge one event given its type and parsed data (a JSON-array stream's item)."""
        self.events += 1
        dialect = self._dialect
        if dialect is None:
            return data
        if self.watch_model and self.model is None:
            self.model = dialect.response_model(data)
        signal = dialect.stream_signal(name, data)
        if signal is None:  # the usual: a delta
            pass
        elif signal is END:
            self.complete = True
        elif isinstance(signal, StreamFailure) and self.failure is None:
            self.failure = signal
        if dialect.usage_event(data):
            kept = self._usage_events
            if len(kept) >= MAX_USAGE_EVENTS:
                del kept[1]  # keep the first (message_start) and the latest
            kept.append(data)
        return data

    @property
    def marked_complete(self) -> bool:
        """The provider's terminal marker arrived with no error or malformed event before
        it: the stream is whole, whatever its framing does next (never for a target
        without a dialect, which is judged by its framing)."""
        return (
            self.complete
            and self._dialect is not None
            and self.failure is None
            and not self.malformed
        )

    def usage(self) -> TokenUsage | None:
        """The usage the stream reported so far (None when it reported none)."""
        if self._dialect is None or not self._usage_events:
            return None
        return self._dialect.stream_usage(self._usage_events)

    def response_model(self) -> str | None:
        """The model the stream's usage-bearing events name (None when none does)."""
        if self._dialect is None:
            return None
        read = self._dialect.response_model
        return next((m for e in self._usage_events if (m := read(e)) is not None), None)

    def verdict(self, *, status: int | None = None) -> GatewayError | None:
        """None for a complete stream; else the error its end calls for."""
        failure = self.failure
        details: dict[str, Any] = {"target": self.target, "events": self.events}
        if status is not None:
            details["upstream_status"] = status
        if failure is not None:
            return stream_failure_error(failure, details)
        if self.malformed:
            return malformed_error(self.target, self.events)
        if self.complete:
            return None
        return StreamInterrupted(
            f"the stream from target {self.target!r} ended after {self.events} events "
            "without its terminal marker: the answer is incomplete",
            details={**details, "reason": "no_terminal_marker"},
        )


def malformed_error(target: str, events: int) -> StreamInterrupted:
    """A provider stream that carried a malformed event (data that starts like JSON and
    is not): the stream ends there with an error, never judged a success (the agent's
    SDK would raise on the event)."""
    return StreamInterrupted(
        f"the stream from target {target!r} carried a malformed event (not JSON) after "
        f"{events - 1} events; the stream was ended there",
        details={"target": target, "events": events, "reason": "malformed_event"},
    )


def judge_body(
    provider: str,
    target: str,
    content_type: str | None,
    body: bytes,
    status: int,
    *,
    cut: bool = False,
    idle: bool = False,
    head: bool = False,
) -> tuple[GatewayError | None, Any]:
    """Judge a whole answer ``body``: ``(error or None, its data)``. Only an SSE body is
    judged (its data is the SSE form of :func:`gateway.call.bodies.parse_sse`); any other
    body gives ``(None, None)`` and is parsed by the caller as usual. An SSE answer that
    ended before its first byte is judged too (no marker: STREAM_INTERRUPTED, however
    its connection ended), unless it has no body by definition (``head``: the answer to
    a HEAD request; a 204 or 205). ``cut``: the body's connection broke, or it fell
    silent past the idle bound (``idle``)."""
    if not body and not cut and (head or status in (204, 205)):
        return None, None
    mtype = media_type(content_type)
    if not body and not cut and mtype != "text/event-stream":
        return None, None
    data: Any
    if cut and mtype != "text/event-stream":  # pragma: no cover - only streams are cut
        return None, None
    if mtype == "text/event-stream":
        judge = StreamJudge(provider, target)
        for event in decode_all(body, len(body) + 1):
            judge.observe(event)
        error = judge.verdict(status=status)
        # The connection broke or fell silent (``idle``): cut, unless the provider's
        # terminal marker had arrived (targets without a dialect are judged by framing,
        # and this framing failed).
        reason, why = (
            ("idle_timeout", "it fell silent") if idle else ("reset", "the connection broke")
        )
        if error is None and cut and not judge.marked_complete:
            error = StreamInterrupted(
                f"the stream from target {target!r} was cut after {judge.events} events ({why})",
                details={"reason": reason, "target": target, "events": judge.events},
            )
        elif cut and isinstance(error, StreamInterrupted):
            error.details["reason"] = reason  # more than no marker: the connection broke
        data = parse_sse(body) if error is not None else None
    elif provider == "gemini" and body[:1] == b"[" and is_json_type(mtype):
        # streamGenerateContent without alt=sse: a JSON array of chunks, judged as one
        # stream; anything that is not such an array is an ordinary JSON answer.
        items = _judged_data(body.decode("utf-8", "replace"))
        if not (isinstance(items, list) and items and isinstance(items[0], dict)):
            return None, None
        if "candidates" not in items[0] and "error" not in items[0]:
            return None, None
        judge = StreamJudge(provider, target)
        for item in items:
            judge.observe_data(None, item)
        error = judge.verdict(status=status)
        data = items
    else:
        return None, None
    if error is None:
        return None, None
    error.status_code = status
    error.data = data
    return error, data


def stream_failure_error(failure: StreamFailure, details: dict[str, Any]) -> GatewayError:
    """The error for an error event inside a 200 stream."""
    details = {**details, "reason": "stream_error_event", "upstream_reason": failure.reason}
    said = f"the upstream sent an error event mid-stream ({failure.reason}): {failure.message}"
    if failure.kind == "quota":
        return QuotaExhausted(said, details=details)
    if failure.kind == "rate_limited":
        return CapacityExceeded(said, details={**details, "source": "upstream"})
    if failure.kind == "rejected":
        return UpstreamRejected(said, details=details, http_status=502)
    return DependencyFailed(said, details=details)

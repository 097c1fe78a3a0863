"""Server-sent events, parsed as the WHATWG HTML standard says (section 9.2.6,
"Interpreting an event stream"), incrementally: bytes may be cut anywhere.

* The stream is UTF-8 (invalid bytes become U+FFFD); one leading BOM is dropped.
* Lines end at CRLF, LF or a lone CR (a CR at the end of a chunk waits for the next one,
  which may start with its LF).
* A line starting with ``:`` is a comment (keep-alives): ignored.
* ``field: value`` (one space after the colon removed; a line without a colon is a field
  with an empty value): ``event`` sets the type, ``data`` appends a line, ``id`` sets the
  last event id (unless it contains NUL), ``retry`` the reconnection time when all
  ASCII digits; other fields are ignored.
* A blank line dispatches the event; one with no ``data`` line is not dispatched. An
  event not ended by a blank line when the stream ends is discarded.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    """One event: ``event`` its type (``"message"`` when the stream named none),
    ``data`` its data lines joined by ``\\n``, ``id`` the last event id seen so far in
    the stream (``""`` when none), ``retry`` the reconnection time in milliseconds that
    this event's block set, if any."""

    event: str = "message"
    data: str = ""
    id: str = ""
    retry: int | None = None

    def json(self) -> Any:
        """``data`` parsed as JSON (raises ``json.JSONDecodeError`` when it is not)."""
        return json.loads(self.data)


class SSEDecoder:
    """Feed bytes as they arrive; get back the events they complete.

    ``max_event_chars`` bounds one event's buffered text (its data lines and the line
    being read), so a stream without blank lines cannot grow memory without end:
    :class:`ValueError` past it.
    """

    def __init__(self, *, max_event_chars: int = 16 * 1024 * 1024) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._max = max_event_chars
        self._pending = ""  # text not yet ended by a line break
        self._growing: list[str] = []  # more of it, in pieces: no line break among them
        self._growing_chars = 0
        self._started = False
        self._event = ""
        self._data: list[str] = []
        self._data_chars = 0
        self._last_id = ""
        self._retry: int | None = None
        self._error: ValueError | None = None

    def _take_pending(self) -> str:
        """The unterminated text, its pieces joined (once per line end)."""
        if self._growing:
            self._pending += "".join(self._growing)
            self._growing.clear()
            self._growing_chars = 0
        pending, self._pending = self._pending, ""
        return pending

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise self._error

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """The events that ``chunk`` completes, in order. An event over the bound raises
        :class:`ValueError` once the events completed before it have been returned."""
        self._raise_pending()
        events: list[ServerSentEvent] = []
        try:
            events.extend(self._lines(self._text.decode(chunk)))
        except ValueError as exc:
            if not events:
                raise
            self._error = exc  # for the next call: first hand over what is complete
        return events

    def close(self) -> list[ServerSentEvent]:
        """End of stream: the last line is ended; an event without its blank line is
        dropped (WHATWG), so this only returns an event when the final line break was cut
        between CR and LF."""
        self._raise_pending()
        events = list(self._lines(self._text.decode(b"", final=True)))
        pending = self._take_pending()
        if pending:
            line = pending.removesuffix("\r")
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def _lines(self, text: str) -> Iterator[ServerSentEvent]:
        if not self._started and text:
            self._started = True
            text = text.removeprefix("\ufeff")
        if "\n" not in text and "\r" not in text and not self._pending.endswith("\r"):
            # A line still growing: kept in pieces and scanned once it ends (joined and
            # scanned at every chunk, one long line would cost its length per chunk).
            self._growing.append(text)
            self._growing_chars += len(text)
            if len(self._pending) + self._growing_chars + self._data_chars > self._max:
                raise ValueError(f"a server-sent event is over {self._max} characters")
            return
        buffer = self._take_pending() + text
        start = 0
        size = len(buffer)
        while True:
            cr = buffer.find("\r", start)
            lf = buffer.find("\n", start)
            if cr == -1 and lf == -1:
                break
            if cr != -1 and (lf == -1 or cr < lf):
                if cr + 1 == size:  # a CR that may be the first half of CRLF
                    break
                end, nxt = cr, cr + 2 if buffer[cr + 1] == "\n" else cr + 1
            else:
                end, nxt = lf, lf + 1
            event = self._line(buffer[start:end])
            start = nxt
            if event is not None:
                yield event
        self._pending = buffer[start:]
        if len(self._pending) + self._data_chars > self._max:
            raise ValueError(f"a server-sent event is over {self._max} characters")

    def _line(self, line: str) -> ServerSentEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
            self._data_chars += len(value) + 1
            if self._data_chars > self._max:
                raise ValueError(f"a server-sent event is over {self._max} characters")
        elif name == "id":
            if "\x00" not in value:
                self._last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        data, kind, retry = self._data, self._event, self._retry
        self._data, self._data_chars, self._event, self._retry = [], 0, "", None
        if not data:
            return None
        return ServerSentEvent(
            event=kind or "message", data="\n".join(data), id=self._last_id, retry=retry
        )

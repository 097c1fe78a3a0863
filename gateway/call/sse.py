"""Server-sent events, decoded incrementally (pure, no I/O).

The grammar is WHATWG HTML, "Server-sent events", section 9.2.6 ("Interpreting an event
stream"): lines end with CRLF, LF or CR; a line starting with ``:`` is a comment; a
field line is ``name: value`` (one space after the colon is dropped); a blank line
dispatches the event whose ``data`` lines were seen (joined with LF); a UTF-8 BOM at the
very start is skipped. An event without a ``data`` line is not dispatched (id-only
blocks, ``event: ping`` alone), but its comments and fields never break the next one.

:class:`SseDecoder` takes the bytes as they arrive, in any cut (a CRLF split between two
chunks included), and returns the events completed so far. Memory is bounded: an event
may not grow past ``max_event_bytes`` (:class:`EventTooLarge`), whatever the stream's
length. The relay sends the upstream's bytes unchanged; this decoder only reads them.
"""

from __future__ import annotations

import codecs
from typing import Final, NamedTuple

_BOM: Final = "\ufeff"


class SseEvent(NamedTuple):
    """One dispatched event: its ``event`` type (None for the default ``message``), its
    ``data`` (the data lines joined with LF) and the last ``id`` seen (or None).
    Immutable; a tuple because one is made per event relayed (a frozen dataclass costs
    three ``object.__setattr__`` calls to make)."""

    event: str | None
    data: str
    id: str | None = None


class EventTooLarge(ValueError):
    """One event grew past the decoder's ``max_event_bytes``."""


class SseDecoder:
    """Feed it bytes with :meth:`feed`; it returns the events each chunk completed.

    ``max_event_bytes`` bounds the text buffered for one event (its pending line and its
    data lines), in UTF-8 bytes as received. Bytes that are not UTF-8 are read as U+FFFD
    here (for judging the stream only; the relayed bytes are the upstream's).
    """

    __slots__ = ("_cr", "_data", "_event", "_idle", "_last_id", "_line_chars", "_max",
                 "_parts", "_size", "_started", "_utf8", "events")  # fmt: skip

    def __init__(self, max_event_bytes: int) -> None:
        self._max = max_event_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []  # the current, unterminated line, in pieces
        self._line_chars = 0
        self._cr = False  # the last chunk ended with CR: a following LF belongs to it
        self._data: list[str] = []
        self._event: str | None = None
        self._last_id: str | None = None
        self._size = 0
        self._started = False
        # Holding nothing between events (no line, data, event type, CR or cut
        # character; past the BOM): what lets :meth:`feed_whole` read a chunk alone.
        self._idle = False
        #: Events dispatched in all (for the audit record).
        self.events = 0

    def feed_whole(self, chunk: bytes) -> tuple[str | None, bytes] | None:
        """``(event type, data)`` when ``chunk`` is exactly one event that :meth:`feed`
        would dispatch alone: the decoder holds nothing, and the chunk is one ``data:``
        line, after at most one ``event:`` line, and its blank line (LF line ends; CRLF
        for a ``data:`` line alone). The data is the line's bytes, not decoded (an SSE
        value is the UTF-8 of its text; a caller that decodes it with ``errors="replace"``
        reads what :meth:`feed` would have read). Else None, and nothing was consumed:
        :meth:`feed` reads the chunk. What a paced upstream sends in each read, read
        without decoding, splitting or joining the chunk's text (nearly half the judge's
        cost per event). The event's ``id`` is the last one seen, as before it: the
        chunk has no ``id`` line."""
        if not self._idle:
            return None
        end = len(chunk) - 2
        if chunk.endswith(b"\n\n"):
            cr_at = -1  # no CR at all
        elif chunk.endswith(b"\r\n\r\n"):
            end -= 2
            cr_at = end  # only the CRLF after the data line, then the blank line's
        else:
            return None
        name: str | None = None
        if chunk.startswith(b"data:"):
            start = 5
        elif chunk.startswith(b"event:"):
            at = chunk.find(b"\n", 6)
            if at < 0 or chunk.find(b"data:", at + 1, at + 6) < 0:
                return None
            raw = chunk[7:at] if chunk[6:7] == b" " else chunk[6:at]
            name = raw.decode("utf-8", "replace") or None
            start = at + 6
        else:
            return None
        if chunk[start : start + 1] == b" ":
            start += 1
        if chunk.find(b"\n", start) != end + (cr_at >= 0) or chunk.find(b"\r") != cr_at:
            return None  # another line, or a CR line end somewhere else
        if end - start + 1 > self._max:
            return None  # feed decides, counting characters
        self.events += 1
        return name, chunk[start:end]

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """The events completed by ``chunk``. Raises :class:`EventTooLarge`."""
        utf8 = self._utf8
        if utf8.buffer:  # a character cut at the last chunk's end
            text = utf8.decode(chunk)
        else:
            try:  # whole characters, the usual: one C call
                text = chunk.decode()
            except UnicodeDecodeError:  # a cut character or bytes that are not UTF-8
                text = utf8.decode(chunk)
        if not self._started and text:
            self._started = True
            text = text.removeprefix(_BOM)
        if self._cr and text.startswith("\n"):
            text = text[1:]  # the LF of a CRLF split across chunks
        out: list[SseEvent] = []
        if "\r" in text:
            self._cr = text.endswith("\r")
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        else:
            self._cr = False
        parts = self._parts
        if "\n" not in text:
            # A line still growing: kept in pieces, joined once when it ends (a long
            # line joined at every chunk would cost its length per chunk).
            if text:
                parts.append(text)
                self._line_chars += len(text)
        else:
            lines = text.split("\n")
            last = lines.pop()
            if parts:
                lines[0] = "".join(parts) + lines[0]
                parts.clear()
            for line in lines:
                if line[:5] == "data:":  # the usual line, read here (not by _field)
                    value = line[6:] if line[5:6] == " " else line[5:]
                    self._data.append(value)
                    self._size += len(value) + 1
                    if self._size > self._max:
                        raise EventTooLarge(f"one event passed {self._max} bytes")
                else:
                    self._field(line, out)
            if last:
                parts.append(last)
            self._line_chars = len(last)
        if self._size + self._line_chars > self._max:
            raise EventTooLarge(f"one event passed {self._max} bytes")
        self._idle = (
            self._started
            and self._event is None
            and not (parts or self._data or self._cr or utf8.buffer)
        )
        return out

    def close(self) -> list[SseEvent]:
        """At the end of the stream: the last line counts even without its line end, and
        an event left without its blank line is still dispatched. (The spec discards it;
        the providers' SDKs, e.g. openai-python's ``SSEDecoder``, read it, and so does
        this decoder, so that ``data: [DONE]`` right before the close is not lost.)"""
        out: list[SseEvent] = []
        tail = self._utf8.decode(b"", final=True)
        line = "".join(self._parts) + tail
        self._parts.clear()
        self._idle = False
        self._line_chars = 0
        if line:
            self._field(line, out)
        self._field("", out)
        return out

    @property
    def pending(self) -> bool:
        """True while an event has data lines but no blank line yet."""
        return bool(self._data)

    def _field(self, line: str, out: list[SseEvent]) -> None:
        if not line:
            if self._data:
                self.events += 1
                out.append(SseEvent(self._event, "\n".join(self._data), self._last_id))
            self._data = []
            self._event = None
            self._size = 0
            return
        if line.startswith(":"):
            return  # a comment (": ping" keep-alives)
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._size += len(value) + 1
            if self._size > self._max:
                raise EventTooLarge(f"one event passed {self._max} bytes")
        elif name == "event":
            self._event = value or None
        elif name == "id" and "\x00" not in value:
            self._last_id = value
        # "retry" and unknown fields are ignored (the spec's rule).


#: The ends of an event: a blank line, after LF, CRLF or CR line ends (mixed ones too).
#: ``chunk.endswith(EVENT_ENDS)``: ``chunk`` is whole events (``complete_events(chunk) ==
#: len(chunk)``), what a paced upstream sends in each read; one test, no copy.
EVENT_ENDS: Final = (b"\n\n", b"\r\r", b"\r\n\r\n", b"\n\r\n", b"\r\n\n")


def complete_events(buffer: bytes | bytearray, searched: int = 0) -> int:
    """How many leading bytes of ``buffer`` are whole events (0: none yet): the offset
    just after its last blank line. The relays send only whole events, so that a stream
    cut mid-event never leaves half an event for the next one to run into.

    ``searched``: how many leading bytes are known to hold no event end (the held bytes
    before the chunk just added): only the rest is searched, so that one event growing
    chunk by chunk costs its length once, not its length per chunk (quadratic: seconds
    of a blocked event loop for an event of a few MiB)."""
    end = 0
    for mark in EVENT_ENDS:
        at = buffer.rfind(mark, max(0, searched - len(mark) + 1))
        if at >= 0:
            end = max(end, at + len(mark))
    return end


def decode_all(body: bytes, max_event_bytes: int) -> list[SseEvent]:
    """Every event of a complete stream ``body``."""
    decoder = SseDecoder(max_event_bytes)
    return decoder.feed(body) + decoder.close()

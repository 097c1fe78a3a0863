"""A bounded on-disk spool of audit lines waiting to be shipped (``audit.otlp``): what
makes the OTLP sink at-least-once.

Layout: a directory of segment files ``000000000001.jsonl``, ... (JSON lines, appended,
one ``write(2)`` per line, so a killed process loses nothing written) and a ``cursor``
file ``SEGMENT OFFSET``: where the next unshipped line starts, replaced atomically
(temporary file and rename) after each batch the collector accepted. A line is removed
only after its batch was accepted, so a crash between the two sends it again (at least
once: a receiver deduplicates by ``sidecar_id`` and ``seq``).

Bound: past ``max_bytes`` of unshipped segments the oldest segment is deleted and its
lines counted in :attr:`Spool.dropped` (they remain in the file or stdout sink). Size it
for the longest collector outage to ride out: calls per second x record size x seconds.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Final

#: A segment is closed and a new one started past this size (bytes).
SEGMENT_BYTES: Final = 1024 * 1024
_SUFFIX: Final = ".jsonl"


@dataclass(frozen=True, slots=True)
class Position:
    """Where a batch ends: segment number and byte offset in it."""

    segment: int
    offset: int


class Spool:
    """The spool in ``directory`` (created if missing), resumed from its cursor; thread
    safe (one writer thread, one shipping thread). Raises OSError if it cannot be used."""

    def __init__(self, directory: str | Path, max_bytes: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.dropped = 0
        self._lock = threading.Lock()
        self._sizes = {
            int(p.name.removesuffix(_SUFFIX)): p.stat().st_size
            for p in self.directory.glob("*" + _SUFFIX)
        }
        self._cursor = self._read_cursor()
        for number in [n for n in self._sizes if n < self._cursor.segment]:
            self._delete(number)  # shipped before a crash, not yet removed
        self._current = max(self._sizes, default=self._cursor.segment)
        self._fd = self._open(self._current)

    def _path(self, number: int) -> Path:
        return self.directory / f"{number:012d}{_SUFFIX}"

    def _read_cursor(self) -> Position:
        try:
            segment, offset = (self.directory / "cursor").read_text().split()
            return Position(int(segment), int(offset))
        except (OSError, ValueError):
            return Position(min(self._sizes, default=1), 0)

    def _open(self, number: int) -> int:
        self._sizes.setdefault(number, 0)
        return os.open(self._path(number), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def _delete(self, number: int) -> None:
        self._sizes.pop(number, None)
        self._path(number).unlink(missing_ok=True)

    @property
    def pending_bytes(self) -> int:
        """Bytes not yet shipped."""
        with self._lock:
            return sum(self._sizes.values()) - self._cursor.offset

    def append(self, line: str) -> None:
        """Add one line (without its newline). Never raises for a full spool: the oldest
        segment goes (counted in :attr:`dropped`)."""
        data = (line + "\n").encode("utf-8", "surrogateescape")
        with self._lock:
            if self._fd < 0:
                return  # closed: the file or stdout sink has the line
            if self._sizes[self._current] + len(data) > SEGMENT_BYTES:
                os.close(self._fd)
                self._current += 1
                self._fd = self._open(self._current)
            while sum(self._sizes.values()) + len(data) > self.max_bytes and len(self._sizes) > 1:
                self._drop_oldest()
            os.write(self._fd, data)
            self._sizes[self._current] += len(data)

    def _drop_oldest(self) -> None:
        oldest = min(self._sizes)
        with self._path(oldest).open("rb") as f:
            if oldest == self._cursor.segment:
                f.seek(self._cursor.offset)
            self.dropped += f.read().count(b"\n")
        self._delete(oldest)
        self._cursor = Position(min(self._sizes), 0)

    def read(self, max_lines: int) -> tuple[list[str], Position]:
        """Up to ``max_lines`` whole unshipped lines and where they end (give it to
        :meth:`commit` once they were shipped)."""
        with self._lock:
            at = self._cursor
            while at.segment < self._current and at.offset >= self._sizes.get(at.segment, 0):
                at = Position(at.segment + 1, 0)  # a closed segment read to its end
            with self._path(at.segment).open("rb") as f:
                f.seek(at.offset)
                raw = f.read()  # a segment is about SEGMENT_BYTES (one long line more)
        whole = raw[: raw.rfind(b"\n") + 1]
        lines = whole.split(b"\n")[:-1][:max_lines]
        end = at.offset + sum(len(line) + 1 for line in lines)
        return [line.decode("utf-8", "surrogateescape") for line in lines], Position(
            at.segment, end
        )

    def commit(self, position: Position) -> None:
        """Mark everything before ``position`` shipped: the cursor moves (atomically on
        disk) and fully shipped segments are deleted."""
        with self._lock:
            if (position.segment, position.offset) <= (self._cursor.segment, self._cursor.offset):
                return  # the oldest segment was dropped meanwhile
            tmp = self.directory / "cursor.tmp"
            tmp.write_text(f"{position.segment} {position.offset}\n")
            os.replace(tmp, self.directory / "cursor")
            self._cursor = position
            for number in [n for n in self._sizes if n < position.segment]:
                self._delete(number)

    def close(self) -> None:
        """Close the open segment (idempotent)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

"""The audit file sink: one line per record, appended and flushed, rotated by size.

Rotation follows the standard library's ``RotatingFileHandler`` step for step: a line
that would bring the file to ``max_bytes`` or past it (its length counted in characters,
as there) first rolls the file over, ``path.<n-1>`` -> ``path.<n>`` ... ``path`` ->
``path.1``, keeping ``backup_count`` old files (0: the same file is reopened and grows);
``max_bytes`` 0 never rolls; a path that is not a regular file (``/dev/null``) never
rolls. What is left out is the logging machinery around it, which cost a quarter of the
audit's time per call: no LogRecord, no second formatting of the line to measure it, the
file size kept in memory instead of a seek and a tell, and the regular-file test made
when the file is opened instead of two ``stat`` calls per line. So appends by another
process are not counted toward ``max_bytes``.

A line that cannot be written (disk full, a lone surrogate from an agent's metadata)
does not fail the call: like the logging handler, the error is reported on stderr (the
line itself is not), and lone surrogates are written as their JSON escapes. A file that
does not end with a newline (a line cut short by a crash) gets one before the first new
line, so that the new lines are whole and only the cut one is malformed.

:func:`last_line` reads a file's last whole line back (a new start continues the hash
chain its audit file ended with).
"""

from __future__ import annotations

import os
import stat
import sys
import threading
from typing import BinaryIO, Final

#: Read-back bound of :func:`last_line`: a last line longer than this is not read.
MAX_LAST_LINE_BYTES: Final = 16 * 1024 * 1024
_BLOCK: Final = 64 * 1024


class RotatingFile:
    """Appends lines to ``path`` (created if missing), rotating past ``max_bytes``."""

    def __init__(self, path: str, max_bytes: int, backup_count: int) -> None:
        self.path = os.path.abspath(path)
        self.max_bytes = max_bytes
        self.backup_count = backup_count
        self._lock = threading.Lock()
        self._fh: BinaryIO | None = None
        self._size = 0
        self._regular = False
        #: Lines that could not be written (for the metrics: an audit sink failing).
        self.failures = 0
        self._open()

    def _open(self) -> None:
        self._fh = open(self.path, "ab")  # noqa: SIM115 - kept open until close()
        self._size = self._fh.seek(0, os.SEEK_END)
        self._regular = os.path.isfile(self.path)
        if self._regular and self._size and not _ends_with_newline(self.path):
            self._fh.write(b"\n")
            self._size += 1

    def write(self, line: str) -> None:
        """Append ``line`` and a newline, rolling over first if it would not fit."""
        data = (line + "\n").encode("utf-8", "backslashreplace")
        with self._lock:
            try:
                if (
                    self.max_bytes > 0
                    and self._regular
                    and self._size + len(line) + 1 >= self.max_bytes
                ):
                    self._rollover()
                if self._fh is None:
                    self._open()
                assert self._fh is not None
                self._fh.write(data)
                self._fh.flush()
                self._size += len(data)
            except OSError as exc:
                self.failures += 1
                print(
                    f"egress-gateway: audit file {self.path}: {exc.strerror or exc}",
                    file=sys.stderr,
                )

    def _rollover(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self.backup_count > 0:
            for i in range(self.backup_count - 1, 0, -1):
                older, newer = f"{self.path}.{i}", f"{self.path}.{i + 1}"
                if os.path.exists(older):
                    if os.path.exists(newer):
                        os.remove(newer)
                    os.rename(older, newer)
            first = f"{self.path}.1"
            if os.path.exists(first):
                os.remove(first)
            if os.path.exists(self.path):
                os.rename(self.path, first)
        self._open()

    def close(self) -> None:
        with self._lock:
            fh, self._fh = self._fh, None
            if fh is None:
                return
            try:
                fh.close()  # flushes what a failed write left buffered: may fail again
            except OSError as exc:
                self.failures += 1
                print(
                    f"egress-gateway: audit file {self.path}: {exc.strerror or exc}",
                    file=sys.stderr,
                )


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def last_line(path: str, *, limit: int = MAX_LAST_LINE_BYTES) -> bytes | None:
    """The last whole (newline-terminated) line of the regular file ``path``, without its
    newline; a cut-short line after it is ignored. ``None`` if there is none, the file
    is missing or not a regular file, it cannot be read, or the line is longer than
    ``limit`` bytes."""
    try:
        with open(path, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            pos = fh.seek(0, os.SEEK_END)
            tail = b""
            end = -1  # index in tail of the newline that ends the last whole line
            while pos > 0:
                step = min(_BLOCK, pos)
                pos -= step
                fh.seek(pos)
                tail = fh.read(step) + tail
                if end < 0:
                    end = tail.rfind(b"\n")
                    if end < 0:
                        if len(tail) > limit:
                            return None
                        continue
                else:
                    end += step
                start = tail.rfind(b"\n", 0, end) + 1
                if start > 0 or pos == 0:
                    line = tail[start:end]
                    return line if len(line) <= limit and line else None
                if end > limit:
                    return None
            return None
    except OSError:
        return None

"""Streaming reader of audit logs: JSON lines from files, stdin (``-``) or gzip.

Records are yielded one at a time as plain dicts, never the whole file. A line that is
not a JSON object is reported through ``on_malformed`` with its source and line number
(1-based) and skipped; blank lines are skipped silently. gzip input is recognised by its
magic bytes (RFC 1952), whatever the file is called.

Lines are parsed by :mod:`gateway.fastjson` (orjson when installed) exactly as the stdlib
parses them: lines orjson refuses (``NaN``, lone surrogates) or would read otherwise
(integers past 64 bits) are read by the stdlib, so that both give the same records.
Only ``records(..., exact=False)`` (``summary``: sums and percentiles) takes orjson's
reading of an integer past 64 bits, a float.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Final

from gateway import fastjson

Record = dict[str, Any]
#: (source name, line number, record)
Entry = tuple[str, int, Record]

STDIN: Final = "-"
_GZIP_MAGIC: Final = b"\x1f\x8b"


@dataclass(frozen=True, slots=True)
class Malformed:
    """A line that is not a JSON object: where it is and why."""

    source: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: malformed line: {self.reason}"


OnMalformed = Callable[[Malformed], None]


def _ignore(_: Malformed) -> None:
    pass


loads = fastjson.loads
dumps = fastjson.dumps_line


def _reason(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"not valid JSON ({exc.msg} at column {exc.colno})"
    return f"not valid JSON ({exc})"


def parse_line(raw: bytes, source: str, number: int, on_malformed: OnMalformed) -> Record | None:
    """The record on one raw line, or ``None`` (blank, or reported as malformed)."""
    try:
        obj = loads(raw)
    except ValueError as exc:
        if raw.strip():
            on_malformed(Malformed(source, number, _reason(exc)))
        return None
    if type(obj) is dict:
        return obj
    on_malformed(Malformed(source, number, f"not a JSON object ({type(obj).__name__})"))
    return None


def parse_lines(lines: Iterable[bytes], source: str, on_malformed: OnMalformed) -> Iterator[Entry]:
    """Entries of ``lines`` (raw, newline-terminated or not), numbered from 1."""
    for number, raw in enumerate(lines, 1):
        record = parse_line(raw, source, number, on_malformed)
        if record is not None:
            yield source, number, record


@contextlib.contextmanager
def open_source(source: str, stdin: IO[bytes] | None = None) -> Iterator[IO[bytes]]:
    """A binary stream of ``source`` (a path, or ``-`` for stdin), gunzipped if needed.

    Raises ``OSError`` if the file cannot be opened, ``gzip.BadGzipFile`` (an
    ``OSError``) while reading a corrupt gzip stream.
    """
    with contextlib.ExitStack() as stack:
        if source == STDIN:
            raw: IO[bytes] = stdin if stdin is not None else sys.stdin.buffer
        else:
            raw = stack.enter_context(open(source, "rb"))
        if _peek(raw, 2) == _GZIP_MAGIC:
            raw = stack.enter_context(gzip.GzipFile(fileobj=raw, mode="rb"))  # type: ignore[arg-type]
        yield raw


def _peek(stream: IO[bytes], size: int) -> bytes:
    peek = getattr(stream, "peek", None)
    if peek is not None:
        return bytes(peek(size)[:size])
    if stream.seekable():
        head = stream.read(size)
        stream.seek(-len(head), os.SEEK_CUR)
        return head
    raise OSError("input must be seekable or buffered to detect gzip")


def entries(
    sources: Iterable[str],
    on_malformed: OnMalformed = _ignore,
    *,
    stdin: IO[bytes] | None = None,
) -> Iterator[Entry]:
    """(source, line, record) of every record of ``sources``, in order."""
    for source in sources:
        name = "<stdin>" if source == STDIN else source
        with open_source(source, stdin) as stream:
            yield from parse_lines(stream, name, on_malformed)


def records(
    sources: Iterable[str],
    on_malformed: OnMalformed = _ignore,
    *,
    stdin: IO[bytes] | None = None,
    exact: bool = True,
) -> Iterator[Record]:
    """Every record of ``sources``, in order (see :func:`entries`).

    The hot path of ``summary``: one generator, the parser called directly; with
    ``exact=False`` the fastest (:data:`gateway.fastjson.loads_fast`).
    """
    fast = fastjson.loads if exact else fastjson.loads_fast
    for source in sources:
        name = "<stdin>" if source == STDIN else source
        with open_source(source, stdin) as stream:
            for number, raw in enumerate(stream, 1):
                try:
                    obj = fast(raw)
                except ValueError:
                    obj = parse_line(raw, name, number, on_malformed)
                    if obj is None:
                        continue
                if type(obj) is dict:
                    yield obj
                else:
                    on_malformed(
                        Malformed(name, number, f"not a JSON object ({type(obj).__name__})")
                    )


def follow(
    path: str,
    stop: threading.Event,
    on_malformed: OnMalformed = _ignore,
    *,
    poll_s: float = 0.2,
) -> Iterator[Entry]:
    """Entries of ``path`` from its start, then as lines are appended, until ``stop``.

    Like ``tail -F``: a partial last line waits for its newline; when the file is
    rotated (renamed and recreated, as ``RotatingFileHandler`` does) or truncated, the
    rest of the old file is read and the new one followed from its first line. A
    missing file is waited for. ``poll_s`` is the wait between checks at end of file.
    """
    stream: IO[bytes] | None = None
    number = 0
    pending = b""
    draining = False
    try:
        while not stop.is_set():
            if stream is None:
                try:
                    stream = open(path, "rb")  # noqa: SIM115
                except FileNotFoundError:
                    stop.wait(poll_s)
                    continue
                number, pending = 0, b""
            chunk = stream.readline()
            if chunk:
                pending += chunk
                if pending.endswith(b"\n"):
                    number += 1
                    record = parse_line(pending, path, number, on_malformed)
                    pending = b""
                    if record is not None:
                        yield path, number, record
                continue
            if draining:
                if pending:
                    on_malformed(Malformed(path, number + 1, "truncated last line"))
                stream.close()
                stream, draining = None, False
                continue
            if _replaced(stream, path):
                # Lines written before the rename may have landed since the last read.
                draining = True
                continue
            stop.wait(poll_s)
    finally:
        if stream is not None:
            stream.close()


def _replaced(stream: IO[bytes], path: str) -> bool:
    try:
        current = os.stat(path)
    except FileNotFoundError:
        return False  # rotation in progress: the new file is not there yet
    opened = os.fstat(stream.fileno())
    return (current.st_ino, current.st_dev) != (opened.st_ino, opened.st_dev) or (
        current.st_size < stream.tell()
    )

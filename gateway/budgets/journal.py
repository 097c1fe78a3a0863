"""Local budget spend kept across a restart of the sidecar: an append-only journal on the
pod's volume (``GATEWAY_BUDGET_JOURNAL``; the chart sets it on the ``/tmp`` emptyDir,
which lives as long as the pod).

Format: one line per change, ``BUDGET BUCKET TOTAL`` (the budget's name, the bucket id of
:mod:`gateway.budgets.windows`, the bucket's new total in nano-USD). A later line for the
same bucket replaces an earlier one, so replay is "last line wins" and a torn last line
(a crash mid-write) is skipped. Each booking is one ``write(2)`` to an ``O_APPEND`` file
before the call is sent: a process killed at any point (``kill -9``) loses nothing
booked, so after a restart at most the calls then in flight are counted at their
reservation instead of their real cost. ``fsync`` runs at most every
:data:`FSYNC_INTERVAL_S`, which bounds what a crash of the node (not of the process)
can lose.

The file is compacted (current totals only, written to a temporary file, fsynced and
renamed over it: atomic) when opened and after :data:`COMPACT_AFTER_LINES` appends.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Final

#: Seconds between two fsyncs of the journal at most (node crash loss bound).
FSYNC_INTERVAL_S: Final = 1.0
#: Appended lines after which the journal is rewritten with the current totals only.
COMPACT_AFTER_LINES: Final = 10_000

Totals = dict[str, dict[int, int]]


def _parse(text: str) -> Totals:
    totals: Totals = {}
    # Only whole lines count: what follows the last newline is a write a crash cut.
    for line in text.split("\n")[:-1]:
        parts = line.split(" ")
        if len(parts) != 3 or not parts[1].lstrip("-").isdigit() or not parts[2].isdigit():
            continue
        totals.setdefault(parts[0], {})[int(parts[1])] = int(parts[2])
    return totals


class BudgetJournal:
    """The journal at ``path`` (created with its directory if missing). :attr:`totals`
    holds what it recorded, {budget: {bucket: nano-USD}}. Raises OSError if the file
    cannot be opened or written. Close with :meth:`close` (idempotent)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.totals = _parse(self.path.read_text())
        except FileNotFoundError:
            self.totals = {}
        self._fd = -1
        self._last_sync = time.monotonic()
        self.compact(self.totals)

    def compact(self, totals: Totals) -> None:
        """Rewrite the journal with ``totals`` only (atomic: temporary file, fsync,
        rename, fsync of the directory), and append to the new file from now on."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        body = "".join(_lines((n, k, v) for n, b in totals.items() for k, v in b.items()))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._appended = 0

    def record(self, changes: Iterable[tuple[str, int, int]]) -> bool:
        """Append (budget, bucket, new total) changes in one write. Returns True when the
        journal has grown past :data:`COMPACT_AFTER_LINES` (the owner compacts it)."""
        lines = _lines(changes)
        if not lines or self._fd < 0:
            return False
        os.write(self._fd, "".join(lines).encode())
        self._appended += len(lines)
        now = time.monotonic()
        if now - self._last_sync >= FSYNC_INTERVAL_S:
            os.fsync(self._fd)
            self._last_sync = now
        return self._appended >= COMPACT_AFTER_LINES

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1


def _lines(changes: Iterable[tuple[str, int, int]]) -> list[str]:
    return [f"{name} {bucket} {max(total, 0)}\n" for name, bucket, total in changes]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

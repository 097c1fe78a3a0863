"""A target's connection slots: at most ``limit`` attempts (or open streams) at once.

A counting semaphore like :class:`asyncio.Semaphore`, made for the call path: taking a
free slot is one comparison and one addition (:meth:`Slots.take`; asyncio's ``locked``
and ``acquire`` are three Python calls and a generator per attempt), and only a call
that finds every slot held waits (:meth:`Slots.wait`), first come, first served. A
released slot is handed to the oldest waiter directly, so a newcomer cannot take it
between the release and the waiter's wake-up.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class Slots:
    """``limit`` slots; ``held`` of them taken now (never above ``limit``)."""

    __slots__ = ("_waiters", "held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def take(self) -> bool:
        """Take a free slot now: True if one was free (and none is waited for)."""
        if self.held < self.limit and not self._waiters:
            self.held += 1
            return True
        return False

    async def wait(self) -> None:
        """Wait for a slot (after :meth:`take` found none), first come, first served; a
        cancellation (a timeout) leaves no slot taken."""
        if self.take():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot just as the wait was given up: pass it on
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):  # else taken off by release()
                self._waiters.remove(waiter)

    def release(self) -> None:
        """Give a slot back: to the oldest live waiter if any, else to the free ones."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: ``held`` unchanged
                return
        if self.held > 0:
            self.held -= 1

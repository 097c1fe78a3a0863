"""A target's connection slots (gateway.upstream.slots.Slots): never more than the limit
taken, waiters served first come first served, a released slot handed to the oldest
waiter (no newcomer takes it first), and a wait given up leaves no slot taken."""

from __future__ import annotations

import asyncio
import contextlib

from gateway.upstream.slots import Slots


async def test_free_slots_are_taken_at_once_up_to_the_limit() -> None:
    slots = Slots(2)
    assert slots.take()
    assert slots.take()
    assert not slots.take()
    assert slots.held == 2
    slots.release()
    assert slots.held == 1
    assert slots.take()


async def test_a_released_slot_goes_to_the_oldest_waiter_not_a_newcomer() -> None:
    slots = Slots(1)
    assert slots.take()
    order: list[str] = []

    async def waiter(name: str) -> None:
        await slots.wait()
        order.append(name)

    first = asyncio.create_task(waiter("first"))
    second = asyncio.create_task(waiter("second"))
    for _ in range(100):  # until both wait (bounded)
        if len(slots._waiters) == 2:
            break
        await asyncio.sleep(0)
    assert len(slots._waiters) == 2
    slots.release()
    assert not slots.take(), "a newcomer took the slot handed to a waiter"
    await first
    assert order == ["first"]
    assert slots.held == 1
    slots.release()
    await second
    assert order == ["first", "second"]
    assert slots.held == 1
    slots.release()
    assert slots.held == 0


async def test_a_wait_given_up_takes_no_slot() -> None:
    slots = Slots(1)
    assert slots.take()
    waiting = asyncio.create_task(slots.wait())
    await asyncio.sleep(0)
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    assert not slots._waiters
    slots.release()
    assert slots.held == 0
    assert slots.take()
    assert slots.held == 1


async def test_a_slot_handed_over_as_its_wait_is_given_up_passes_on() -> None:
    slots = Slots(1)
    assert slots.take()
    late = asyncio.create_task(slots.wait())
    await asyncio.sleep(0)
    after = asyncio.create_task(slots.wait())
    await asyncio.sleep(0)
    slots.release()  # handed to ``late``...
    late.cancel()  # ...which gives up before it runs again
    with contextlib.suppress(asyncio.CancelledError):
        await late
    await asyncio.wait_for(after, 5)  # the slot went on to the next waiter
    assert slots.held == 1
    assert not slots._waiters

"""A Redis timeout means that Redis did not answer, not that the sidecar was busy: the
sidecar measures a timeout on its own clock, so while its event loop is held by its own
work (a burst of calls, a throttled CPU) Redis's answer waits unread and the timer runs
on. The default timeouts outlast such a stall; a Redis that does not answer still fails
within them (tests/test_cluster_sidecars.py, tests/test_cluster_idempotency.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from gateway.policy import RedisSpec
from gateway.stores.redis import RedisClient
from tests.redis_fixtures import SHARED_URL

#: How long the test holds the event loop, as a busy sidecar on a loaded node can: over
#: the former 0.5 s default, well under the present one.
STALL_S = 0.75


@pytest.fixture
async def client(redis_prefix: str) -> AsyncIterator[RedisClient]:
    made = RedisClient(RedisSpec(key_prefix=redis_prefix), url=SHARED_URL)
    yield made
    await made.aclose()


async def test_a_stall_while_connecting_is_not_a_redis_failure(client: RedisClient) -> None:
    """The first PING opens the connection; the event loop is then held for STALL_S by
    work of the process. With 0.5 s timeouts this answered "Timeout connecting to
    server" (the DEPENDENCY_FAILED of a burst of cluster-idempotent calls)."""
    ping = asyncio.create_task(client.ping())
    await asyncio.sleep(0)  # the connect is under way: its timer runs
    time.sleep(STALL_S)  # the stall is the point: the loop is busy
    await ping  # raises RedisUnavailable if the timer fired

"""Approvals in cluster scope (Redis): sidecars sharing a Redis share the requests, an
approved call runs exactly once among them (also across a restart of one), and a call
waiting for approval when Redis goes away ends with a clear error, never unapproved."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.agents.approvals import Approvals, HeldCall
from gateway.agents.approvals_redis import RedisApprovalStore
from gateway.errors import ApprovalPending
from gateway.policy import RedisSpec
from gateway.policy.desk import ApprovalSpec
from gateway.stores.redis import RedisClient
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target
from tests.redis_fixtures import SHARED_URL, PrivateRedis, private_redis, redis_prefix

__all__ = ["private_redis", "redis_prefix"]  # fixtures, imported for pytest

Factory = Callable[..., Awaitable[Any]]
OPERATORS = {"alice": {"token_ref": "env://ALICE_TOKEN"}}
SPEC = ApprovalSpec(tools=["*"])


def cluster_policy(upstream_url: str, redis_url: str, prefix: str) -> Any:
    target = openai_target(
        upstream_url, approval={"endpoints": [{"path": "/v1/*", "methods": ["POST"]}]}
    )
    return compile_policy(
        {"fake-openai": target},
        operators=OPERATORS,
        approvals={"scope": "cluster"},
        redis={"url": redis_url, "key_prefix": prefix},
    )


async def test_two_sidecars_share_requests_and_run_an_approved_call_once(
    upstream: FakeUpstream, sidecar_factory: Factory, redis_prefix: str
) -> None:
    policy = cluster_policy(upstream.url, SHARED_URL, redis_prefix)
    a: Sidecar = await sidecar_factory(policy)
    b: Sidecar = await sidecar_factory(policy)
    env = envelope(timeout=0.2)
    status, answer = await a.call(env)
    assert status == 428, answer
    approval_id = answer["error"]["details"]["approval_id"]
    status, answer = await b.call(env)  # the other sidecar sees the same request
    assert answer["error"]["details"]["approval_id"] == approval_id
    await b.gateway.pipeline.approvals.decide(approval_id, "approved", "alice")

    results = await asyncio.gather(*(sc.call(env) for sc in (a, b, a, b)))
    statuses = sorted(status for status, _ in results)
    assert statuses == [200, 428, 428, 428], results
    assert upstream.hits == 1


# A thousand rounds of Redis trips: 27 s alone on a 2-core box at load 8, over 60 s in
# the whole suite at that load; the bound is a hang guard, the work is bounded by count.
@pytest.mark.timeout(240)
async def test_a_thousand_approvals_across_two_sidecars_and_a_restart_never_run_twice(
    redis_prefix: str,
) -> None:
    rng = random.Random(20261201)
    spec = RedisSpec(key_prefix=redis_prefix)
    clients = [RedisClient(spec, url=SHARED_URL), RedisClient(spec, url=SHARED_URL)]
    sidecars = [Approvals(RedisApprovalStore(c)) for c in clients]
    runs: dict[str, int] = {}
    approved: set[str] = set()
    try:
        for i in range(1000):
            if i == 500:  # one sidecar restarts: a new client, nothing kept in memory
                await clients[1].aclose()
                clients[1] = RedisClient(spec, url=SHARED_URL)
                sidecars[1] = Approvals(RedisApprovalStore(clients[1]))
            args = {"n": rng.randrange(300), "pay": rng.choice(["a", "b"])}  # repeats happen
            call = HeldCall("t", "tool", "pay", "POST", args, "agent", f"tr-{i % 97}")
            try:
                await rng.choice(sidecars).hold(SPEC, call, deadline=0.0)
                raise AssertionError("an unapproved call ran")
            except ApprovalPending as exc:
                approval_id = exc.details["approval_id"]
            await rng.choice(sidecars).decide(approval_id, "approved", "alice")
            approved.add(approval_id)
            senders = [rng.choice(sidecars) for _ in range(rng.randint(1, 4))]
            outcomes = await asyncio.gather(
                *(s.hold(SPEC, call, deadline=0.0) for s in senders), return_exceptions=True
            )
            for outcome in outcomes:
                if isinstance(outcome, str):
                    runs[outcome] = runs.get(outcome, 0) + 1
                else:
                    assert isinstance(outcome, ApprovalPending), outcome
    finally:
        for client in clients:
            await client.aclose()
    assert len(approved) == 1000
    assert set(runs) == approved  # each approval ran its call...
    assert set(runs.values()) == {1}  # ...exactly once


async def test_a_call_waiting_when_redis_goes_away_ends_with_a_clear_error(
    upstream: FakeUpstream,
    sidecar_factory: Factory,
    private_redis: PrivateRedis,
) -> None:
    policy = cluster_policy(upstream.url, private_redis.url, "egw-approvals-down")
    sc: Sidecar = await sidecar_factory(policy)
    store = sc.gateway.pipeline.approvals.store
    waiting = asyncio.create_task(sc.call(envelope(timeout=30)))
    for _ in range(2000):  # bounded: the request appears within a few polls
        if await store.recent(1):
            break
        await asyncio.sleep(0.005)
    assert await store.recent(1), "the request was never recorded"
    private_redis.kill()
    status, answer = await asyncio.wait_for(waiting, 20)
    assert status == 502, answer
    error = answer["error"]
    assert (error["code"], error["details"]["reason"]) == (
        "DEPENDENCY_FAILED",
        "approval_store_unavailable",
    )
    assert "was not sent" in error["message"]
    assert upstream.hits == 0

"""Each stage alone, at its seam, with a plain async API (design.md, "Layers").

Real objects only: a real loopback upstream, the real outbound client, the in-memory
idempotency store, the real rate-limit groups and breakers. No HTTP in front of the
pipeline: what the server adds (routing, size limits) is tested elsewhere.
"""

from __future__ import annotations

import io
import json
import random
import time
from typing import Any

from aiohttp import web

from gateway.audit import log as audit
from gateway.breaker import CircuitBreakers, breaker_specs
from gateway.call.attempts import Attempts
from gateway.call.intake import parse_request
from gateway.call.outbound import build, with_credential
from gateway.call.pipeline import Pipeline
from gateway.idempotency.memory import MemoryIdempotencyStore
from gateway.metrics import Metrics
from gateway.policy import PolicySet
from gateway.policy.refs import parse_ref
from gateway.ratelimit import RateLimitGroups
from gateway.secrets.factory import build_secret_resolvers
from gateway.upstream import Upstream
from tests.conftest import compile_policy, envelope, openai_target

KEY = "sk-fake-TEST-0001-NOTREAL"  # TEST_OPENAI_KEY, set for every test by conftest


def _policy(url: str, **target: Any) -> PolicySet:
    return compile_policy({"fake-openai": openai_target(url, **target)})


async def _upstream(policy: PolicySet) -> Upstream:
    upstream = Upstream(policy.policy.egress, max_response_bytes=1 << 20)
    await upstream.start()
    return upstream


async def test_upstream_sends_one_outbound_request_and_reads_the_answer(upstream_factory):
    fu = await upstream_factory()
    policy = _policy(fu.url)
    target = policy.targets["fake-openai"]
    request = parse_request(envelope()).request
    resolvers = build_secret_resolvers(policy.policy)
    resolved = await resolvers.resolve(parse_ref("env://TEST_OPENAI_KEY"))
    outbound, digest = build(request, target, idempotency_key=None, digest=True)
    upstream = await _upstream(policy)
    try:
        answer = await upstream.send(with_credential(outbound, target, resolved), timeout_s=5)
    finally:
        await upstream.aclose()
    assert answer.status == 200
    assert json.loads(answer.body) == {"ok": True}
    [seen] = fu.seen
    assert seen.headers["Authorization"] == f"Bearer {KEY}"
    assert seen.headers["traceparent"] == outbound.headers["traceparent"]
    assert len(seen.body) == digest.size
    assert json.loads(seen.body) == request.parameters
    assert upstream.closed


async def test_attempts_retry_a_503_then_return_the_200(upstream_factory):
    statuses = iter([503, 200])

    async def handler(_: web.Request) -> web.StreamResponse:
        return web.json_response({"n": 1}, status=next(statuses))

    fu = await upstream_factory(handler)
    policy = _policy(fu.url)
    target = policy.targets["fake-openai"]
    request = parse_request(envelope(max_retries=1)).request
    draft, _ = build(request, target, idempotency_key=None, digest=False)
    upstream = await _upstream(policy)
    attempts = Attempts(
        upstream=upstream,
        target=target,
        request=request,
        outbound=with_credential(draft, target, None),
        deadline=time.monotonic() + 5,
        has_idempotency_key=False,
        rng=random.Random(0),
    )
    try:
        answer = await attempts.run()
    finally:
        await upstream.aclose()
    assert answer.status == 200
    assert attempts.log.attempts == 2
    assert fu.hits == 2


async def test_pipeline_runs_a_call_and_replays_it_by_its_idempotency_key(upstream_factory):
    fu = await upstream_factory()
    policy = _policy(fu.url, idempotency={"methods": ["POST"]})
    stream = io.StringIO()
    upstream = await _upstream(policy)
    store = MemoryIdempotencyStore()
    pipeline = Pipeline(
        policy,
        resolvers=build_secret_resolvers(policy.policy),
        upstream=upstream,
        audit=audit.AuditLog(policy.policy.audit, stream, agent_id="seam-agent"),
        metrics=Metrics(),
        groups=RateLimitGroups(policy.policy.rate_limit_groups),
        breakers=CircuitBreakers(breaker_specs(policy.policy.targets)),
        idempotency=store,
    )
    body = json.dumps(envelope(idempotency_key="order-7")).encode()
    try:
        first = await pipeline.handle(body)
        again = await pipeline.handle(body)
    finally:
        await store.aclose()
        await upstream.aclose()
    assert first[0] == again[0] == 200
    assert first[1].success
    assert first[1].data == {"ok": True}
    assert again[1].replayed is True
    assert again[1].data == first[1].data
    assert fu.hits == 1
    assert fu.seen[0].headers["Idempotency-Key"] == "order-7"
    records = [json.loads(line) for line in stream.getvalue().split("\n") if line]
    calls = [r for r in records if r.get("event") == "egress_call"]
    assert [c["decision"] for c in calls] == ["allowed", "replayed"]

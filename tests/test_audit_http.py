"""Audit records through a real sidecar: one stream per Gateway, one record per answer.

Two gateways in one process write two audit streams (each its own chain). Answers the
server gives before the pipeline (unknown route, method not allowed, envelope too large,
a body that cannot be decoded) each get exactly one audit record, with the sidecar's
request line and status and nothing of the body; the ops listener's do not.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.audit.query.verify import verify
from gateway.server import create_ops_app
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target

MakeSidecar = Callable[..., Awaitable[Sidecar]]
LIMIT = 4096
BODY_CANARY = "body-canary-never-audited"


def _policy(url: str, **extra: Any) -> Any:
    return compile_policy(
        {"fake-openai": openai_target(url)},
        server={"max_request_bytes": LIMIT},
        audit={"chain": True},
        **extra,
    )


async def test_two_gateways_in_one_process_write_two_audit_streams(
    sidecar_factory: MakeSidecar, upstream: FakeUpstream
) -> None:
    a = await sidecar_factory(_policy(upstream.url))
    b = await sidecar_factory(_policy(upstream.url))
    for number in range(3):
        assert (await a.call(envelope(trace_id=f"tr-a-{number}")))[0] == 200
        assert (await b.call(envelope(trace_id=f"tr-b-{number}")))[0] == 200
    for sidecar, name in ((a, "a"), (b, "b")):
        records = sidecar.audit_records()
        assert [r["trace_id"] for r in records] == [f"tr-{name}-{n}" for n in range(3)]
        assert {r["sidecar_id"] for r in records} == {sidecar.gateway.audit.sidecar_id}  # type: ignore[union-attr]
        # A chain of its own: seq 1 is its start record (the policy it started with).
        start = [line for line in sidecar.lines() if line.get("event") == "policy_start"]
        assert [r["seq"] for r in start + records] == [1, 2, 3, 4]
        result = verify(["-"], stdin=io.BytesIO(sidecar.log.getvalue().encode()))
        assert result.ok, result.breaks
        assert (result.chains, result.chained) == (1, 4)  # the start record and 3 calls
    assert a.gateway.audit is not b.gateway.audit


@pytest.fixture
async def raw_session() -> AsyncIterator[aiohttp.ClientSession]:
    # A new connection per request: aiohttp closes one whose body it could not decode.
    async with aiohttp.ClientSession(
        auto_decompress=False, connector=aiohttp.TCPConnector(force_close=True)
    ) as session:
        yield session


async def _chunks() -> AsyncIterator[bytes]:
    for _ in range(8):
        yield (BODY_CANARY + "x" * 1000).encode()


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status"),
    [
        ("POST", "/v1/nope", BODY_CANARY.encode(), {}, 404),
        ("GET", "/v1/calls", None, {}, 405),
        ("DELETE", "/v1/calls?key=value", None, {}, 405),
        ("POST", "/healthz", None, {}, 405),
        ("POST", "/v1/calls", (BODY_CANARY * 400).encode(), {}, 413),  # Content-Length
        ("POST", "/v1/calls", _chunks, {}, 413),  # chunked: found out while reading
        ("POST", "/v1/calls", BODY_CANARY.encode(), {"Content-Encoding": "gzip"}, None),
    ],
    ids=["404", "405-get", "405-query", "405-healthz", "413", "413-chunked", "bad-gzip"],
)
async def test_a_refusal_before_the_pipeline_has_exactly_one_audit_record(
    sidecar_factory: MakeSidecar,
    upstream: FakeUpstream,
    raw_session: aiohttp.ClientSession,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    status: int | None,
) -> None:
    sidecar = await sidecar_factory(_policy(upstream.url))
    data = body() if callable(body) else body
    async with raw_session.request(method, sidecar.url + path, data=data, headers=headers) as resp:
        assert resp.content_type == "application/json"
        answer = await resp.json()
    if status is not None:
        assert resp.status == status
    [record] = sidecar.audit_records()  # validated against the schema
    assert record["decision"] == "invalid"
    assert record["success"] is False
    assert record["error_code"] == answer["error"]["code"]
    assert record["retryable"] == answer["error"]["retryable"]
    assert (record["http_method"], record["http_path"]) == (method, path.split("?")[0])
    assert record["http_status"] == resp.status
    assert record["attempts"] == 0
    assert record["trace_id"] is None
    assert record["sidecar_id"] == sidecar.gateway.audit.sidecar_id  # type: ignore[union-attr]
    assert BODY_CANARY not in sidecar.log.getvalue()
    assert "value" not in record["http_path"]
    assert upstream.hits == 0
    result = verify(["-"], stdin=io.BytesIO(sidecar.log.getvalue().encode()))
    assert result.ok, result.breaks


async def test_calls_through_the_pipeline_keep_their_one_record(
    sidecar_factory: MakeSidecar, upstream: FakeUpstream, raw_session: aiohttp.ClientSession
) -> None:
    sidecar = await sidecar_factory(_policy(upstream.url))
    for body, headers in (
        (b"\xff\xfe not json", {}),
        (gzip.compress(b'{"not": "an envelope"}'), {"Content-Encoding": "gzip"}),
    ):
        async with raw_session.post(sidecar.url + "/v1/calls", data=body, headers=headers) as resp:
            assert resp.status == 400
    assert (await sidecar.call(envelope()))[0] == 200
    records = sidecar.audit_records()
    assert [r["decision"] for r in records] == ["invalid", "invalid", "allowed"]
    assert all(r["http_status"] is None and r["http_path"] is None for r in records)


async def test_health_answers_and_the_ops_listener_are_not_audited(
    sidecar_factory: MakeSidecar, upstream: FakeUpstream, raw_session: aiohttp.ClientSession
) -> None:
    sidecar = await sidecar_factory(_policy(upstream.url))
    ops = TestServer(create_ops_app(sidecar.gateway), host="127.0.0.1")
    await ops.start_server()
    try:
        for url in (sidecar.url + "/healthz", sidecar.url + "/readyz", f"{ops.make_url('/nope')}"):
            async with raw_session.get(url) as resp:
                assert resp.content_type == "application/json"
                await resp.read()
        assert resp.status == 404  # the ops listener's unknown route
    finally:
        await ops.close()
    assert sidecar.audit_records() == []

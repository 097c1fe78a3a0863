"""A target's ``fallbacks`` serve when it fails before any byte reached the agent, inside
the call's one deadline; never after: a cut stream is STREAM_INTERRUPTED, not spliced.
Real loopback stand-ins for each fault class, through the envelope; what the agent got,
what each upstream saw, the audit record.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

from aiohttp import web

from tests.conftest import compile_policy, envelope, openai_target

PRICES = {
    "primary-model": {"input_usd_per_mtok": 1.0, "output_usd_per_mtok": 2.0},
    "backup-model": {"input_usd_per_mtok": 10.0, "output_usd_per_mtok": 20.0},
}


def _answer(model: str) -> dict[str, Any]:
    return {
        "id": "c-1",
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 500, "total_tokens": 1500},
    }


async def _ok(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    return web.json_response(_answer(body["model"]))


async def _unavailable(_: web.Request) -> web.StreamResponse:
    return web.json_response(
        {"error": {"message": "overloaded", "type": "server_error"}}, status=503
    )


def _policy(primary_url: str, backup_url: str, **primary: Any) -> Any:
    spec = openai_target(primary_url, **primary)
    spec.setdefault("fallbacks", [{"target": "backup", "model": "backup-model"}])
    return compile_policy({"primary": spec, "backup": openai_target(backup_url)}, prices=PRICES)


def _call(**overrides: Any) -> dict[str, Any]:
    parameters = {"model": "primary-model", "messages": [{"role": "user", "content": "ping"}]}
    return envelope(target_system="primary", api_key_ref=None, parameters=parameters, **overrides)


async def test_a_primary_503_is_served_by_its_fallback_with_its_model_and_usage(
    upstream_factory, sidecar_factory
):
    primary = await upstream_factory(_unavailable)
    backup = await upstream_factory(_ok)
    sc = await sidecar_factory(_policy(primary.url, backup.url))
    status, body = await sc.call(_call(max_retries=1))
    assert status == 200, body
    assert body["success"] is True
    assert body["served_by"] == {"target": "backup", "model": "backup-model"}
    assert body["data"]["model"] == "backup-model"
    assert body["tokens_used"] == 1500
    assert primary.hits == 2  # its own retry first, then the fallback
    assert backup.hits == 1
    assert backup.seen[0].json()["model"] == "backup-model"  # rewritten in the body
    assert backup.seen[0].json()["messages"] == [{"role": "user", "content": "ping"}]
    [record] = sc.audit_records()
    assert record["served_by"] == {"target": "backup", "model": "backup-model"}
    assert record["attempts"] == 3
    # One entry per attempt: the primary's two, then the fallback's.
    assert [(t["target"], t["model"], t["outcome"], t["attempts"]) for t in record["tried"]] == [
        ("primary", "primary-model", "DEPENDENCY_FAILED", 1),
        ("primary", "primary-model", "DEPENDENCY_FAILED", 1),
        ("backup", "backup-model", "ok", 1),
    ]
    assert sum(t["attempts"] for t in record["tried"]) == record["attempts"]
    assert record["tried"][0]["upstream_status"] == 503
    assert record["tried"][0]["api_key_ref"] == "env://TEST_OPENAI_KEY"  # a name, not a key
    assert "sk-fake" not in json.dumps(record)
    # Billed at the serving model's price only: 1000 in x 10 + 500 out x 20 per million.
    assert record["cost_model"] == "backup-model"
    assert abs(record["cost_usd"] - 0.02) < 1e-9
    metrics = await (await sc.session.get(sc.url + "/metrics")).text()
    assert (
        'egress_gateway_failovers_total{from="primary",reason="upstream_5xx",to="backup"} 1.0'
        in metrics
    )


async def test_the_record_lists_every_attempt_of_every_option(upstream_factory, sidecar_factory):
    async def fails(_: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)

    primary = await upstream_factory(fails)
    backup = await upstream_factory(_ok)
    sc = await sidecar_factory(_policy(primary.url, backup.url, retry={"max_retries": 1}))
    _, body = await sc.call(_call(max_retries=1))
    assert body["served_by"] == {"target": "backup", "model": "backup-model"}
    assert (primary.hits, backup.hits) == (2, 1)
    [record] = sc.audit_records()
    first, second, served = record["tried"]
    for failed in (first, second):
        assert (failed["target"], failed["model"]) == ("primary", "primary-model")
        assert (failed["outcome"], failed["upstream_status"]) == ("DEPENDENCY_FAILED", 500)
        assert failed["response_bytes"] == len(
            b'{"error": {"message": "boom", "type": "server_error"}}'
        )
    assert (served["target"], served["model"], served["outcome"]) == (
        "backup",
        "backup-model",
        "ok",
    )
    assert served["upstream_status"] == 200
    assert served["response_bytes"] == len(json.dumps(_answer("backup-model")).encode())
    for entry in record["tried"]:
        assert entry["api_key_ref"] == "env://TEST_OPENAI_KEY"  # its reference, never the key
        assert entry["attempts"] == 1
        assert 0 < entry["duration_ms"] < record["latency_ms"]
    assert record["attempts"] == 3


async def test_every_option_failing_answers_with_the_primarys_own_error(
    upstream_factory, sidecar_factory
):
    async def refuses(_: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"error": {"message": "unknown model backup-model", "type": "invalid_request_error"}},
            status=400,
        )

    primary = await upstream_factory(_unavailable)
    backup = await upstream_factory(refuses)
    sc = await sidecar_factory(_policy(primary.url, backup.url))
    status, body = await sc.call(_call(max_retries=0))
    assert body["success"] is False
    assert body["error"]["code"] == "DEPENDENCY_FAILED"  # not the fallback's 400
    assert body["status_code"] == 503
    assert body["error"]["details"]["target"] == "primary"
    assert status == 502
    assert body["served_by"] is None
    assert (primary.hits, backup.hits) == (1, 1)
    [record] = sc.audit_records()
    assert record["error_code"] == "DEPENDENCY_FAILED"
    assert record["attempts"] == 2
    assert [t["outcome"] for t in record["tried"]] == ["DEPENDENCY_FAILED", "UPSTREAM_REJECTED"]
    assert record["cost_usd"] is None  # nothing billed: both failed


async def test_a_refusal_of_the_request_is_passed_on_without_a_fallback(
    upstream_factory, sidecar_factory
):
    async def too_long(_: web.Request) -> web.StreamResponse:
        error = {
            "message": "This model's maximum context length is 8192 tokens",
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
        }
        return web.json_response({"error": error}, status=400)

    async def filtered(_: web.Request) -> web.StreamResponse:
        error = {"message": "flagged", "type": "invalid_request_error", "code": "content_filter"}
        return web.json_response({"error": error}, status=400)

    for handler in (too_long, filtered):
        primary = await upstream_factory(handler)
        backup = await upstream_factory(_ok)
        sc = await sidecar_factory(_policy(primary.url, backup.url))
        _, body = await sc.call(_call())
        assert body["error"]["code"] == "UPSTREAM_REJECTED"
        assert body["status_code"] == 400
        assert (primary.hits, backup.hits) == (1, 0)


async def test_fallback_on_context_length_moves_to_a_larger_model(
    upstream_factory, sidecar_factory
):
    async def too_long(_: web.Request) -> web.StreamResponse:
        error = {"message": "too long", "type": "invalid_request_error"}
        return web.json_response(
            {"error": {**error, "code": "context_length_exceeded"}}, status=400
        )

    primary = await upstream_factory(too_long)
    backup = await upstream_factory(_ok)
    sc = await sidecar_factory(
        _policy(primary.url, backup.url, fallback_on=["context_length_exceeded"])
    )
    _, body = await sc.call(_call())
    assert body["success"] is True
    assert body["served_by"] == {"target": "backup", "model": "backup-model"}
    assert (primary.hits, backup.hits) == (1, 1)


async def test_a_silent_primary_gives_way_within_first_byte_timeout(
    upstream_factory, sidecar_factory
):
    release = asyncio.Event()

    async def silent(_: web.Request) -> web.StreamResponse:
        await release.wait()  # never answers while the call runs
        return web.json_response({})

    primary = await upstream_factory(silent)
    backup = await upstream_factory(_ok)
    policy = _policy(primary.url, backup.url, first_byte_timeout_s=0.3, retry={"max_retries": 0})
    sc = await sidecar_factory(policy)
    try:
        status, body = await sc.call(_call(timeout=30))
    finally:
        release.set()
    assert status == 200, body
    assert body["success"] is True
    assert body["served_by"]["target"] == "backup"
    assert body["latency_ms"] < 10_000  # the 30 s deadline was not spent on the primary
    assert (primary.hits, backup.hits) == (1, 1)
    [record] = sc.audit_records()
    assert record["tried"][0]["outcome"] == "OUTCOME_UNKNOWN"  # sent, never answered


async def test_a_primary_that_refuses_connections_is_passed_over(upstream_factory, sidecar_factory):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    backup = await upstream_factory(_ok)
    sc = await sidecar_factory(_policy(closed, backup.url, retry={"max_retries": 0}))
    _, body = await sc.call(_call())
    assert body["success"] is True
    assert body["served_by"] == {"target": "backup", "model": "backup-model"}
    [record] = sc.audit_records()
    assert record["tried"][0]["outcome"] == "DEPENDENCY_FAILED"
    assert record["tried"][0]["reason"] == "connect"
    assert record["tried"][0]["attempts"] == 1


async def test_a_primary_that_answers_names_itself_and_a_target_without_fallbacks_nothing(
    upstream_factory, sidecar_factory
):
    primary = await upstream_factory(_ok)
    backup = await upstream_factory(_ok)
    sc = await sidecar_factory(_policy(primary.url, backup.url))
    _, body = await sc.call(_call())
    assert body["served_by"] == {"target": "primary", "model": "primary-model"}
    [record] = sc.audit_records()
    [answered] = record["tried"]  # the one attempt, noted as it answered
    assert list(answered) == [
        "target",
        "model",
        "api_key_ref",
        "attempts",
        "outcome",
        "upstream_status",
        "reason",
        "response_bytes",
        "duration_ms",
    ]  # the line's order (docs/audit.md)
    duration = answered.pop("duration_ms")
    assert isinstance(duration, float)
    assert duration >= 0
    assert answered == {
        "target": "primary",
        "model": "primary-model",
        "api_key_ref": record["api_key_ref"],
        "attempts": 1,
        "outcome": "ok",
        "upstream_status": 200,
        "reason": None,
        "response_bytes": record["response_bytes"],
    }
    assert (primary.hits, backup.hits) == (1, 0)
    plain = await sidecar_factory(compile_policy({"primary": openai_target(primary.url)}))
    _, body = await plain.call(_call())
    assert body["success"] is True
    assert body["served_by"] is None  # its answer is its own: unchanged
    [record] = plain.audit_records()
    assert (record["served_by"], record["tried"]) == (None, None)


async def _resets(request: web.Request) -> web.StreamResponse:
    assert request.transport is not None
    request.transport.close()  # the request read, no answer byte
    return web.Response()


async def test_a_reset_before_the_answer_is_resent_then_moves_on_for_a_chat_completion(
    upstream_factory, sidecar_factory
):
    primary = await upstream_factory(_resets)
    backup = await upstream_factory(_ok)
    sc = await sidecar_factory(_policy(primary.url, backup.url, retry={"max_retries": 1}))
    _, body = await sc.call(_call(max_retries=1))
    assert body["success"] is True
    assert body["served_by"] == {"target": "backup", "model": "backup-model"}
    assert (primary.hits, backup.hits) == (2, 1)  # a duplicate costs tokens: resent once
    [record] = sc.audit_records()
    assert [(t["target"], t["outcome"], t["reason"]) for t in record["tried"]] == [
        ("primary", "DEPENDENCY_FAILED", "reset"),
        ("primary", "DEPENDENCY_FAILED", "reset"),
        ("backup", "ok", None),
    ]


async def test_a_reset_before_the_answer_with_the_switch_off_is_neither_resent_nor_moved(
    upstream_factory, sidecar_factory
):
    primary = await upstream_factory(_resets)
    backup = await upstream_factory(_ok)
    strict = {"max_retries": 2, "resend_unanswered": False}
    sc = await sidecar_factory(_policy(primary.url, backup.url, retry=strict))
    _, body = await sc.call(_call(max_retries=2))
    assert body["error"]["code"] == "OUTCOME_UNKNOWN"
    assert body["served_by"] is None
    assert (primary.hits, backup.hits) == (1, 0)  # a POST lost after sending: not resent
    [record] = sc.audit_records()
    assert [t["outcome"] for t in record["tried"]] == ["OUTCOME_UNKNOWN"]


async def test_a_500_once_is_rescued_by_the_primarys_own_retry(upstream_factory, sidecar_factory):
    async def once(request: web.Request) -> web.StreamResponse:
        if primary.hits == 1:
            return web.json_response({"error": {"message": "oops"}}, status=500)
        return await _ok(request)

    primary = await upstream_factory(once)
    backup = await upstream_factory(_ok)
    sc = await sidecar_factory(_policy(primary.url, backup.url))
    _, body = await sc.call(_call())
    assert body["served_by"] == {"target": "primary", "model": "primary-model"}
    assert (primary.hits, backup.hits) == (2, 0)


async def test_429_is_retried_as_asked_then_moves_on_within_the_deadline(
    upstream_factory, sidecar_factory
):
    async def limited(_: web.Request) -> web.StreamResponse:
        error = {"error": {"message": "slow down", "type": "rate_limit_error"}}
        return web.json_response(error, status=429, headers={"retry-after-ms": "50"})

    primary = await upstream_factory(limited)
    backup = await upstream_factory(_ok)
    sc = await sidecar_factory(_policy(primary.url, backup.url, retry={"max_retries": 2}))
    _, body = await sc.call(_call(max_retries=2))
    assert body["served_by"] == {"target": "backup", "model": "backup-model"}
    assert (primary.hits, backup.hits) == (3, 1)
    assert primary.seen[1].at - primary.seen[0].at >= 0.05  # its Retry-After was kept
    [record] = sc.audit_records()
    assert record["tried"][0]["outcome"] == "CAPACITY_EXCEEDED"

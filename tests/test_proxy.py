"""The drop-in provider routes over plain HTTP: what goes upstream (credentials
dropped and injected, headers, ids, idempotency), what comes back (the upstream's own
answer, the sidecar's refusals in the provider's shape), and the pure parts."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
from typing import Any

import pytest
from aiohttp import web
from multidict import MultiDict

from gateway.api.answers import passback_headers
from gateway.call.proxy import (
    ProxyRequest,
    _query,
    _timeout,
    header_map,
    proxy_intake,
)
from gateway.call.record import CallContext
from gateway.call.sse import complete_events
from gateway.errors import InvalidPayload
from gateway.providers import DIALECTS, drop_in_dialect
from tests.conftest import compile_policy, openai_target

KEY = "sk-fake-TEST-0001-NOTREAL"  # conftest's TEST_OPENAI_KEY
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


async def _stack(upstream_factory: Any, sidecar_factory: Any, handler: Any = None, **target: Any):
    up = await (upstream_factory(handler) if handler else upstream_factory())
    spec = openai_target(up.url, **target)
    sc = await sidecar_factory(compile_policy({"openai": spec}))
    return up, sc


def _post(sc: Any, path: str = "/v1/chat/completions", **kwargs: Any) -> Any:
    kwargs.setdefault("json", CHAT)
    return sc.session.post(f"{sc.url}/proxy/openai{path}", **kwargs)


async def test_the_agents_credentials_never_pass_and_the_targets_is_injected(
    upstream_factory, sidecar_factory
):
    up, sc = await _stack(upstream_factory, sidecar_factory)
    agent = {
        "Authorization": "Bearer sk-agent-placeholder",
        "x-api-key": "sk-agent-placeholder",
        "api-key": "sk-agent-placeholder",
        "x-goog-api-key": "sk-agent-placeholder",
        "Cookie": "session=agent",
        "User-Agent": "OpenAI/Python 9.9",
        "x-stainless-os": "Linux",
        "x-stainless-retry-count": "0",
        "anthropic-beta": "tools-1",
        "openai-beta": "assistants=v2",
        "x-private": "not listed anywhere",
    }
    async with _post(sc, params={"key": "sk-agent-placeholder", "v": "1"}, headers=agent) as resp:
        assert resp.status == 200
        assert await resp.json() == {"ok": True}
    [seen] = up.seen
    assert seen.headers["Authorization"] == f"Bearer {KEY}"
    assert "sk-agent-placeholder" not in json.dumps(seen.headers) + json.dumps(seen.query)
    assert seen.query == {"v": "1"}
    for dropped in ("x-api-key", "api-key", "x-goog-api-key", "Cookie", "x-stainless-os"):
        assert dropped not in seen.headers
    assert "x-private" not in seen.headers
    assert seen.headers["User-Agent"].startswith("egress-gateway/")
    assert (seen.headers["anthropic-beta"], seen.headers["openai-beta"]) == (
        "tools-1",
        "assistants=v2",
    )
    assert seen.json() == CHAT
    [record] = sc.audit_records()
    assert (record["api"], record["endpoint"], record["method"]) == (
        "proxy",
        "/v1/chat/completions",
        "POST",
    )


async def test_forward_headers_add_more_and_static_headers_beat_the_sdks(
    upstream_factory, sidecar_factory
):
    up, sc = await _stack(
        upstream_factory,
        sidecar_factory,
        forward_headers=["x-team"],
        static_headers={"anthropic-version": "2023-06-01"},
    )
    headers = {"anthropic-version": "2099-01-01", "x-team": "blue", "accept": "application/json"}
    async with _post(sc, headers=headers) as resp:
        assert resp.status == 200
    [seen] = up.seen
    assert seen.headers["anthropic-version"] == "2023-06-01"
    assert (seen.headers["x-team"], seen.headers["Accept"]) == ("blue", "application/json")


async def test_x_egress_secret_ref_picks_another_allowed_ref(
    upstream_factory, sidecar_factory, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TEST_OTHER_KEY", "sk-fake-OTHER-0002")
    up = await upstream_factory()
    spec = openai_target(up.url)
    spec["credential"]["allowed_refs"].append("env://TEST_OTHER_KEY")
    sc = await sidecar_factory(compile_policy({"openai": spec}))
    async with _post(sc, headers={"x-egress-secret-ref": "env://TEST_OTHER_KEY"}) as resp:
        assert resp.status == 200
    assert up.seen[0].headers["Authorization"] == "Bearer sk-fake-OTHER-0002"
    async with _post(sc, headers={"x-egress-secret-ref": "env://HOME"}) as resp:
        assert resp.status == 403
        body = await resp.json()
        assert resp.headers["x-egress-error-code"] == "PERMISSION_DENIED"
    assert body["error"]["code"] == "PERMISSION_DENIED"
    assert body["error"]["type"] == "permission_error"
    assert "may not be sent to target 'openai'" in body["error"]["message"]
    assert up.hits == 1


async def test_ids_come_from_traceparent_or_x_egress_headers_and_go_back(
    upstream_factory, sidecar_factory
):
    up, sc = await _stack(upstream_factory, sidecar_factory)
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = f"00-{trace}-00f067aa0ba902b7-01"
    async with _post(sc, headers={"traceparent": parent}) as resp:
        assert resp.headers["x-egress-trace-id"] == trace
        generated = resp.headers["x-egress-correlation-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    sent = up.seen[0].headers["traceparent"]
    assert sent.startswith(f"00-{trace}-")
    assert sent != parent
    ids = {"x-egress-trace-id": "run-42", "x-egress-correlation-id": "step-7"}
    async with _post(sc, headers=ids) as resp:
        assert (resp.headers["x-egress-trace-id"], resp.headers["x-egress-correlation-id"]) == (
            "run-42",
            "step-7",
        )
    first, second = sc.audit_records()
    assert (first["trace_id"], first["correlation_id"]) == (trace, generated)
    assert (second["trace_id"], second["correlation_id"]) == ("run-42", "step-7")


async def test_an_idempotency_key_header_is_honoured_like_the_envelopes(
    upstream_factory, sidecar_factory
):
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"id": "chatcmpl-1", "usage": {"total_tokens": 3}})

    up, sc = await _stack(
        upstream_factory, sidecar_factory, answer, idempotency={"methods": ["POST"]}
    )
    for _ in range(2):
        async with _post(sc, headers={"Idempotency-Key": "k-1"}) as resp:
            assert resp.status == 200
            assert await resp.json() == {"id": "chatcmpl-1", "usage": {"total_tokens": 3}}
            replayed = resp.headers.get("x-egress-replayed")
    assert replayed == "true"
    assert up.hits == 1
    assert up.seen[0].headers["Idempotency-Key"] == "k-1"
    other = {**CHAT, "max_tokens": 6}
    async with _post(sc, json=other, headers={"Idempotency-Key": "k-1"}) as resp:
        assert resp.status == 422
        assert (await resp.json())["error"]["code"] == "IDEMPOTENCY_CONFLICT"
    assert up.hits == 1
    assert [r["decision"] for r in sc.audit_records()] == ["allowed", "replayed", "allowed"]


async def test_the_upstreams_answer_comes_back_less_hop_by_hop_headers(
    upstream_factory, sidecar_factory
):
    payload = json.dumps({"id": "x", "text": "é" * 100}).encode()

    async def answer(request: web.Request) -> web.Response:
        resp = web.Response(
            body=gzip.compress(payload),
            status=201,
            headers={
                "Content-Type": "application/json",
                "Content-Encoding": "gzip",
                "x-request-id": "req-1",
                "Connection": "x-hop",
                "x-hop": "1",
                "Keep-Alive": "timeout=5",
            },
        )
        resp.headers.add("Set-Cookie", "a=1")
        resp.headers.add("Set-Cookie", "b=2")
        return resp

    _up, sc = await _stack(upstream_factory, sidecar_factory, answer)
    async with _post(sc) as resp:
        assert resp.status == 201
        assert await resp.read() == payload  # decoded once, by the sidecar
        headers = resp.headers
    assert headers["x-request-id"] == "req-1"
    assert headers.getall("Set-Cookie") == ["a=1", "b=2"]
    for gone in ("x-hop", "Keep-Alive", "Content-Encoding"):
        assert gone not in headers
    assert "x-egress-error-code" not in headers


async def test_an_upstream_error_is_passed_on_unchanged_with_the_egress_headers(
    upstream_factory, sidecar_factory
):
    raw = b'{"error": {"message": "bad model", "type": "invalid_request_error", "code": null}}'

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=raw, status=400, content_type="application/json")

    _up, sc = await _stack(upstream_factory, sidecar_factory, answer)
    async with _post(sc) as resp:
        assert resp.status == 400
        assert await resp.read() == raw
        assert resp.headers["x-egress-error-code"] == "UPSTREAM_REJECTED"
        assert "x-should-retry" not in resp.headers  # a 4xx: the SDK's own rules apply


async def test_a_redirect_is_never_passed_back_for_the_sdk_to_follow(
    upstream_factory, sidecar_factory
):
    async def moved(request: web.Request) -> web.Response:
        return web.Response(status=307, headers={"Location": "http://203.0.113.9/v1/chat"})

    _up, sc = await _stack(upstream_factory, sidecar_factory, moved)
    async with _post(sc, allow_redirects=False) as resp:
        assert resp.status == 403
        assert "Location" not in resp.headers
        assert (await resp.json())["error"]["code"] == "EGRESS_DENIED"


async def test_a_secret_echoed_by_the_upstream_is_scrubbed(upstream_factory, sidecar_factory):
    async def echo(request: web.Request) -> web.Response:
        key = request.headers["Authorization"]
        return web.json_response({"you_sent": key}, headers={"x-echo": key})

    _up, sc = await _stack(upstream_factory, sidecar_factory, echo)
    async with _post(sc) as resp:
        text = await resp.text()
        assert KEY not in text
        assert KEY not in json.dumps(dict(resp.headers))
        assert "[REDACTED]" in text


async def test_the_deadline_is_the_x_egress_timeout(upstream_factory, sidecar_factory):
    never = asyncio.Event()

    async def silent(request: web.Request) -> web.Response:
        await never.wait()
        return web.Response()

    _up, sc = await _stack(upstream_factory, sidecar_factory, silent)
    try:
        url = f"{sc.url}/proxy/openai/v1/models/m"  # a GET: safe to say it timed out
        async with sc.session.get(url, headers={"x-egress-timeout": "0.2"}) as resp:
            assert resp.status == 504
            body = await resp.json()
            assert resp.headers["x-egress-retryable"] == "true"
    finally:
        never.set()
    assert body["error"]["code"] == "AGENT_TIMEOUT"
    assert body["error"]["type"] == "server_error"


async def test_refusals_take_the_shape_of_the_sdk_that_asked(upstream_factory, sidecar_factory):
    up, sc = await _stack(upstream_factory, sidecar_factory)
    url = f"{sc.url}/proxy/claude/v1/messages"
    async with sc.session.post(url, json={}, headers={"anthropic-version": "2023-06-01"}) as r:
        assert r.status == 403
        body = await r.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "permission_error"
    assert body["error"]["details"]["error_code"] == "PERMISSION_DENIED"
    async with sc.session.get(f"{sc.url}/proxy/openai/v1/models/m", data=b"x") as r:
        assert r.status == 400  # a GET carries no body through the sidecar
        assert (await r.json())["error"]["code"] == "INVALID_PAYLOAD"
    assert up.hits == 0
    assert [r["api"] for r in sc.audit_records()] == ["proxy", "proxy"]


# -- pure parts ---------------------------------------------------------------------------


def _intake(headers: dict[str, str], body: bytes = b"{}", **kw: Any) -> Any:
    policy = compile_policy({"openai": openai_target("http://127.0.0.1:9", **kw)})
    http = ProxyRequest(
        method="POST",
        target="openai",
        path="/v1/chat/completions",
        query=(),
        headers=tuple(headers.items()),
        body=body,
    )
    ctx = CallContext(started=0.0, agent_id="a")
    return ctx.arrived(proxy_intake(http, policy)).request, ctx


@pytest.mark.parametrize(
    ("content_type", "body", "parameters", "sent_as"),
    [
        ("application/json", b'{"a": 1}', {"a": 1}, None),
        (None, b'{"a": 1}', {"a": 1}, None),
        ("application/json", b"[1]", {}, "application/json"),  # not an object: as it came
        ("application/json", b"{nope", {}, "application/json"),
        ("audio/wav", b"RIFF\x00\xff", {}, "audio/wav"),
        (None, b"\xff", {}, "application/octet-stream"),
    ],
)
def test_bodies_are_parameters_when_json_objects_else_bytes(
    content_type: str | None, body: bytes, parameters: Any, sent_as: str | None
) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    request, _ = _intake(headers, body)
    assert request.parameters == parameters
    assert (request.body.content_type if request.body else None) == sent_as


def test_the_sdks_retry_means_one_attempt_and_its_timeout_is_the_deadline() -> None:
    request, ctx = _intake({"x-stainless-retry-count": "2", "x-stainless-read-timeout": "900"})
    assert (request.max_retries, request.timeout) == (0, 600.0)
    assert ctx.warnings
    assert "x-stainless-retry-count: 2" in ctx.warnings[0]
    request, _ = _intake({"x-stainless-retry-count": "0", "X-Server-Timeout": "45"})
    assert (request.max_retries, request.timeout) == (3, 45.0)
    assert _timeout({}) == 30.0
    with pytest.raises(InvalidPayload):
        _timeout({"x-egress-timeout": "soon"})


def test_headers_pass_beneath_the_policy_or_not_at_all() -> None:
    request, ctx = _intake(
        {
            "Connection": "close, x-named",
            "x-named": "hop",
            "anthropic-version": "2023-06-01",
            "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
            "x-team": "red",
            "Authorization": "Bearer agent",
        },
        forward_headers=["x-team", "x-named"],
    )
    assert request.headers == {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
                               "x-team": "red"}  # fmt: skip
    assert ctx.passthrough_headers == {"anthropic-version": "2023-06-01"}
    assert request.trace_id == "a" * 32


def test_query_names_an_upstream_could_read_as_a_key_are_dropped() -> None:
    items = [("key", "x"), ("KEY", "y"), ("k%65y", "z"), ("alt", "sse"), ("v", "1"), ("v", "2")]
    assert _query(items, ["key"]) == {"alt": "sse", "v": ["1", "2"]}


def test_header_map_joins_repeats_and_passback_drops_connection_named() -> None:
    assert header_map([("A", "1"), ("a", "2"), ("B", "3")]) == {"a": "1, 2", "b": "3"}
    given = {"Connection": "x-a", "x-a": "1", "Transfer-Encoding": "chunked", "X-B": "2"}
    assert passback_headers(given) == [("X-B", "2")]


def test_passed_back_names_are_the_same_on_every_answer_and_past_the_names_kept() -> None:
    # The names' routes are kept between answers (a bounded memo): the second answer, a
    # name past the length kept and names past the count kept are routed as the first.
    long = "X-Egress-" + "n" * 80
    given = [
        ("Content-Type", "application/json"),
        ("KEEP-ALIVE", "timeout=5"),
        ("Content-Length", "2"),
        ("X-Egress-Error-Code", "forged"),
        ("x-EGRESS-trace-id", "forged"),
        (long, "1"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
    ]
    want = [
        ("Content-Type", "application/json"),
        ("x-upstream-Egress-Error-Code", "forged"),
        ("x-upstream-EGRESS-trace-id", "forged"),
        ("x-upstream-" + long[2:], "1"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
    ]
    assert passback_headers(MultiDict(given)) == want
    assert passback_headers(MultiDict(given)) == want
    many = [(f"X-Name-{i}", str(i)) for i in range(1500)]
    assert passback_headers(MultiDict([*many, ("Upgrade", "h2c"), *given])) == [*many, *want]


@pytest.mark.parametrize(
    ("buffer", "whole"),
    [
        (b"", 0),
        (b"data: a", 0),
        (b"data: a\n\n", 9),
        (b"data: a\n\ndata: b", 9),
        (b"data: a\r\n\r\ndata: b\r\n", 11),
        (b"data: a\r\rdata", 9),
        (b"data: a\n\ndata: b\n\n", 18),
    ],
)
def test_complete_events_ends_at_the_last_blank_line(buffer: bytes, whole: int) -> None:
    assert complete_events(buffer) == whole


def test_the_error_shape_follows_the_target_then_the_sdks_headers() -> None:
    assert drop_in_dialect("anthropic", frozenset()) is DIALECTS["anthropic"]
    assert drop_in_dialect("none", frozenset({"x-goog-api-key"})) is DIALECTS["gemini"]
    assert drop_in_dialect(None, frozenset({"anthropic-version"})) is DIALECTS["anthropic"]
    assert drop_in_dialect(None, frozenset({"authorization"})) is DIALECTS["openai"]
    for dialect in DIALECTS.values():
        event = dialect.stream_error(502, "STREAM_INTERRUPTED", "cut")
        assert event.endswith((b"\n\n", b"\r\n\r\n"))
        assert complete_events(event) == len(event)
        assert "STREAM_INTERRUPTED" in json.dumps(dialect.error_body(502, "STREAM_INTERRUPTED", ""))


async def test_a_keyed_stream_is_replayed_as_its_events(upstream_factory, sidecar_factory):
    events = (
        b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'
        b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n'
        b"data: [DONE]\n\n"
    )

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(events)
        await resp.write_eof()
        return resp

    up, sc = await _stack(
        upstream_factory, sidecar_factory, stream, idempotency={"methods": ["POST"]}
    )
    answers = []
    for _ in range(2):
        async with _post(sc, json={**CHAT, "stream": True}, headers={"Idempotency-Key": "s"}) as r:
            assert r.status == 200
            assert r.content_type == "text/event-stream"
            answers.append((await r.read(), r.headers.get("x-egress-replayed")))
    assert answers == [(events, None), (events, "true")]
    assert up.hits == 1

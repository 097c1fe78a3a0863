"""Every error code the core can produce, through the real HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.envelope import ErrorCode
from gateway.secrets import ResolvedSecret, SecretRef
from tests.conftest import compile_policy, envelope, openai_target


def _json(status: int, body: dict[str, Any], **headers: str):
    async def handler(_: web.Request) -> web.StreamResponse:
        return web.json_response(body, status=status, headers=headers)

    return handler


async def _policy_sidecar(upstream_factory, sidecar_factory, handler=None, **target):
    up = await upstream_factory(handler) if handler else await upstream_factory()
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url, **target)}))
    return up, sc


def _assert_error(status, answer, http, code, retryable):
    assert status == http, answer
    assert answer["success"] is False
    assert answer["error"]["code"] == code
    assert answer["error"]["retryable"] is retryable
    assert answer["error"]["message"]
    assert answer["latency_ms"] >= 0


# -- INVALID_PAYLOAD / SCHEMA_MISMATCH ---------------------------------------------------


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "not_json"),
        (b"\xff\xfe{}", "not_utf8"),
        (b"[1, 2]", "not_an_object"),
        (json.dumps(envelope(timeout="5")).encode(), "invalid_fields"),
        (json.dumps(envelope(max_retries=True)).encode(), "invalid_fields"),
        (json.dumps(envelope(method="FETCH")).encode(), "invalid_fields"),
        (json.dumps(envelope(timeout=0)).encode(), "invalid_fields"),
        (json.dumps(envelope(trace_id=...)).encode(), "invalid_fields"),
        (json.dumps(envelope(max_retires=0)).encode(), "unknown_fields"),
    ],
)
async def test_invalid_payload(upstream_factory, sidecar_factory, body, reason):
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    status, answer = await sc.call(body)
    _assert_error(status, answer, 400, "INVALID_PAYLOAD", False)
    assert answer["error"]["details"]["reason"] == reason
    assert up.hits == 0
    [record] = sc.audit_records()
    assert record["decision"] == "invalid"
    assert record["error_code"] == "INVALID_PAYLOAD"


async def test_unknown_field_is_named_with_suggestion(upstream_factory, sidecar_factory):
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    status, answer = await sc.call(envelope(max_retires=0, extra_thing=1))
    assert up.hits == 0
    _assert_error(status, answer, 400, "INVALID_PAYLOAD", False)
    assert "'max_retires' (did you mean 'max_retries'?)" in answer["error"]["message"]
    assert "'extra_thing'" in answer["error"]["message"]
    assert answer["error"]["details"]["unknown_fields"] == ["max_retires", "extra_thing"]
    # The audit record still names the call the agent tried to make.
    [record] = sc.audit_records()
    assert record["trace_id"] == "tr-test-0001"


async def test_unknown_fields_warn_mode_forwards_and_logs(upstream_factory, sidecar_factory):
    up = await upstream_factory()
    policy = compile_policy(
        {"fake-openai": openai_target(up.url)}, envelope={"unknown_fields": "warn"}
    )
    sc = await sidecar_factory(policy)
    status, answer = await sc.call(envelope(client_version="2.0"))
    assert status == 200, answer
    assert up.hits == 1
    [record] = sc.audit_records()
    assert record["warnings"] == ["unknown envelope fields ignored: client_version"]
    assert any(line.get("event") == "unknown_envelope_fields" for line in sc.lines())


async def test_schema_mismatch(upstream_factory, sidecar_factory):
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    status, answer = await sc.call(envelope(protocol_version="2"))
    _assert_error(status, answer, 400, "SCHEMA_MISMATCH", False)
    assert answer["error"]["details"]["supported"] == ["1"]
    assert up.hits == 0


async def test_unknown_rate_limit_group(upstream_factory, sidecar_factory):
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    status, answer = await sc.call(envelope(rate_limit_group="nope"))
    _assert_error(status, answer, 400, "INVALID_PAYLOAD", False)
    assert answer["error"]["details"]["reason"] == "unknown_rate_limit_group"
    assert up.hits == 0


async def test_oversized_envelope_gets_json_413(upstream_factory, sidecar_factory):
    up = await upstream_factory()
    policy = compile_policy(
        {"fake-openai": openai_target(up.url)}, server={"max_request_bytes": 64 * 1024}
    )
    sc = await sidecar_factory(policy)
    big = envelope(parameters={"text": "x" * (100 * 1024)})
    status, answer = await sc.call(big)
    _assert_error(status, answer, 413, "INVALID_PAYLOAD", False)
    assert answer["error"]["details"] == {"reason": "too_large", "limit_bytes": 65536}
    assert up.hits == 0


@pytest.mark.parametrize(
    ("method", "path", "http"), [("GET", "/v1/calls", 405), ("POST", "/nope", 404)]
)
async def test_wrong_route_is_json(upstream_factory, sidecar_factory, method, path, http):
    _, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    async with sc.session.request(method, sc.url + path) as resp:
        assert resp.status == http
        answer = await resp.json()
    assert answer["error"]["code"] == "INVALID_PAYLOAD"
    assert answer["error"]["details"]["http_status"] == http
    # The message names every route family the calls listener serves.
    for route in ("POST /v1/calls", "/proxy/{target}/", "/mcp/{target}", "/a2a/{target}/"):
        assert route in answer["error"]["message"], route


# -- PERMISSION_DENIED / EGRESS_DENIED ---------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"target_system": "stripe"}, "unknown_target"),
        ({"endpoint": "/v1/files"}, "endpoint_not_allowed"),
        ({"endpoint": "/v1/chat/completions", "method": "PUT"}, "method_not_allowed"),
        ({"endpoint": "//evil.example/v1/chat/completions"}, "endpoint_not_a_path"),
        ({"endpoint": "http://169.254.169.254/latest/meta-data/"}, "endpoint_not_a_path"),
        ({"endpoint": "/v1/models/..%2f..%2fadmin", "method": "GET"}, "endpoint_not_a_path"),
        ({"endpoint": "/v1/models/%%32e%%32e%%32ffiles", "method": "GET"}, "endpoint_not_a_path"),
        ({"endpoint": "/v1/chat/completions\r\nHost: evil"}, "endpoint_not_a_path"),
        ({"api_key_ref": "env://OTHER_KEY"}, "ref_not_allowed"),
        ({"headers": {"X-Forwarded-For": "1.2.3.4"}}, "header_not_allowed"),
    ],
)
async def test_permission_denied(upstream_factory, sidecar_factory, overrides, reason):
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    status, answer = await sc.call(envelope(**overrides))
    _assert_error(status, answer, 403, "PERMISSION_DENIED", False)
    assert answer["error"]["details"]["reason"] == reason
    assert up.hits == 0
    [record] = sc.audit_records()
    assert record["decision"] == "denied"


async def test_upstream_401_is_permission_denied_with_body(upstream_factory, sidecar_factory):
    handler = _json(401, {"error": {"message": "Incorrect API key provided"}})
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory, handler)
    status, answer = await sc.call(envelope())
    _assert_error(status, answer, 403, "PERMISSION_DENIED", False)
    assert answer["status_code"] == 401
    assert answer["data"] == {"error": {"message": "Incorrect API key provided"}}
    assert up.hits == 1


def test_private_literal_base_url_needs_allow_cidrs():
    """A base_url on a private IP literal is refused when the policy is loaded."""
    from gateway.policy import PolicyError

    with pytest.raises(PolicyError) as caught:
        compile_policy({"fake-openai": openai_target("http://10.1.2.3:8080")})
    assert caught.value.problems == [
        "test-policy.yaml:1: targets.fake-openai.base_url: 10.1.2.3 is not allowed by the "
        "egress policy (not a public address, or in egress.deny_cidrs); "
        "list it in egress.allow_cidrs to allow it"
    ]


async def test_name_resolving_to_loopback_is_egress_denied(upstream_factory, sidecar_factory):
    """localhost resolves (for real) to a loopback address, which egress refuses by default."""
    up = await upstream_factory()
    target = openai_target(f"http://localhost:{up.port}")
    policy = compile_policy({"fake-openai": target}, egress={"allow_cidrs": []})
    sc = await sidecar_factory(policy)
    status, answer = await sc.call(envelope())
    _assert_error(status, answer, 403, "EGRESS_DENIED", False)
    assert answer["error"]["details"]["reason"] == "address_denied"
    assert answer["error"]["details"]["host"] == "localhost"
    assert up.hits == 0
    [record] = sc.audit_records()
    assert record["error_code"] == "EGRESS_DENIED"
    assert any("localhost" in w for w in record["warnings"])


# -- secrets ------------------------------------------------------------------------------


async def test_missing_env_secret(upstream_factory, sidecar_factory, monkeypatch):
    monkeypatch.delenv("TEST_OPENAI_KEY")
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    status, answer = await sc.call(envelope())
    _assert_error(status, answer, 500, "SECRET_NOT_FOUND", False)
    assert answer["error"]["details"] == {
        "api_key_ref": "env://TEST_OPENAI_KEY",
        "reason": "env_missing",
    }
    assert up.hits == 0


async def test_file_secret_injected_and_reread(upstream_factory, sidecar_factory, tmp_path):
    key_file = tmp_path / "token"
    key_file.write_text("file-secret-value-0001\n")
    ref = f"file://{key_file}"
    up = await upstream_factory()
    target = openai_target(
        up.url,
        credential={"header": "Authorization", "format": "Bearer {secret}", "default_ref": ref},
    )
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    status, _ = await sc.call(envelope(api_key_ref=...))
    assert status == 200
    key_file.write_text("file-secret-value-0002\n")  # rotated by the kubelet
    status, _ = await sc.call(envelope(api_key_ref=...))
    assert status == 200
    assert [s.headers["Authorization"] for s in up.seen] == [
        "Bearer file-secret-value-0001",
        "Bearer file-secret-value-0002",
    ]
    assert "file-secret-value" not in sc.log.getvalue()


async def test_missing_file_secret(upstream_factory, sidecar_factory, tmp_path):
    ref = f"file://{tmp_path}/absent"
    up = await upstream_factory()
    target = openai_target(up.url, credential={"header": "Authorization", "default_ref": ref})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    status, answer = await sc.call(envelope(api_key_ref=...))
    _assert_error(status, answer, 500, "SECRET_NOT_FOUND", False)
    assert answer["error"]["details"]["reason"] == "file_missing"
    assert up.hits == 0


class _DeniedResolver:
    """A resolver plugged in through the public interface, refusing every reference."""

    async def resolve(self, ref: SecretRef) -> ResolvedSecret:
        from gateway.errors import SecretAccessDenied

        raise SecretAccessDenied(
            f"secret reference {ref.raw!r}: denied",
            details={"api_key_ref": ref.raw, "reason": "forbidden"},
        )

    def invalidate(self, ref: SecretRef) -> None:
        pass

    async def aclose(self) -> None:
        pass


class _BrokenResolver(_DeniedResolver):
    async def resolve(self, ref: SecretRef) -> ResolvedSecret:
        raise RuntimeError("a bug in a resolver")


async def test_secret_access_denied(upstream_factory, sidecar_factory):
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    assert sc.gateway.pipeline is not None
    sc.gateway.pipeline.resolvers.register("env", _DeniedResolver())
    status, answer = await sc.call(envelope())
    _assert_error(status, answer, 403, "SECRET_ACCESS_DENIED", False)
    assert up.hits == 0


async def test_internal_bug_is_unknown_without_stack_trace(upstream_factory, sidecar_factory):
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    assert sc.gateway.pipeline is not None
    sc.gateway.pipeline.resolvers.register("env", _BrokenResolver())
    status, answer = await sc.call(envelope())
    _assert_error(status, answer, 500, "UNKNOWN", False)
    assert answer["error"]["stack_trace"] is None
    assert "a bug in a resolver" not in json.dumps(answer)
    assert answer["error"]["details"] == {"exception": "RuntimeError"}
    logged = [line for line in sc.lines() if line.get("event") == "internal_error"]
    assert logged
    assert logged[0]["trace_id"] == "tr-test-0001"
    assert up.hits == 0


# -- upstream outcomes --------------------------------------------------------------------


async def test_upstream_4xx_is_rejected_with_upstream_status(upstream_factory, sidecar_factory):
    handler = _json(422, {"error": {"message": "bad model"}})
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory, handler)
    status, answer = await sc.call(envelope())
    _assert_error(status, answer, 422, "UPSTREAM_REJECTED", False)
    assert up.hits == 1
    assert answer["status_code"] == 422
    assert answer["data"] == {"error": {"message": "bad model"}}


async def test_upstream_429_after_retries_is_capacity_exceeded(upstream_factory, sidecar_factory):
    handler = _json(429, {"error": "slow down"}, **{"retry-after-ms": "20"})
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory, handler)
    status, answer = await sc.call(envelope(max_retries=1))
    _assert_error(status, answer, 429, "CAPACITY_EXCEEDED", True)
    assert answer["error"]["details"]["source"] == "upstream"
    assert answer["error"]["suggested_retry_after"] == pytest.approx(0.02)
    assert up.hits == 2


async def test_connection_refused_is_dependency_failed(sidecar_factory, unused_tcp_port):
    target = openai_target(f"http://127.0.0.1:{unused_tcp_port}")
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    status, answer = await sc.call(envelope(max_retries=1))
    _assert_error(status, answer, 502, "DEPENDENCY_FAILED", True)
    assert answer["error"]["details"]["reason"] == "connect"
    [record] = sc.audit_records()
    assert record["attempts"] == 2


async def test_response_too_large(upstream_factory, sidecar_factory):
    async def big(_: web.Request) -> web.StreamResponse:
        return web.json_response({"blob": "x" * 4096})

    up = await upstream_factory(big)
    policy = compile_policy(
        {"fake-openai": openai_target(up.url)}, server={"max_response_bytes": 2048}
    )
    sc = await sidecar_factory(policy)
    status, answer = await sc.call(envelope())
    _assert_error(status, answer, 502, "RESPONSE_TOO_LARGE", False)
    assert answer["error"]["details"]["limit_bytes"] == 2048


@pytest.mark.parametrize("encoding", ["gzip", None])
async def test_a_body_is_limited_after_decompression(upstream_factory, sidecar_factory, encoding):
    import gzip

    body = json.dumps({"blob": "x" * 100_000}).encode()

    async def bomb(_: web.Request) -> web.StreamResponse:
        # ~300 bytes on the wire (Content-Length), 100 kB once inflated.
        packed = gzip.compress(body) if encoding else body[:1000]
        headers = {"Content-Type": "application/json"}
        if encoding:
            headers["Content-Encoding"] = encoding
        return web.Response(body=packed, headers=headers)

    up = await upstream_factory(bomb)
    policy = compile_policy(
        {"fake-openai": openai_target(up.url)}, server={"max_response_bytes": 2048}
    )
    sc = await sidecar_factory(policy)
    status, answer = await sc.call(envelope())
    if encoding:
        _assert_error(status, answer, 502, "RESPONSE_TOO_LARGE", False)
    else:  # 1000 declared bytes, under the limit: read whole (a cut JSON: text)
        assert status == 200, answer
        assert answer["data"]["text"] == body[:1000].decode()


async def test_outcome_unknown_when_post_without_key_loses_connection(
    upstream_factory, sidecar_factory
):
    async def drop(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.close()
        return web.Response()

    up = await upstream_factory(drop)
    # The switch off: a chat completion lost after sending is then as strict as any POST
    # (on by default there: tests/test_a_reset_before_the_answer_is_resent_....py).
    strict = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "resend_unanswered": False}
    target = openai_target(up.url, retry=strict)
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    status, answer = await sc.call(envelope(max_retries=2))
    _assert_error(status, answer, 502, "OUTCOME_UNKNOWN", False)
    assert up.hits == 1  # never resent without an idempotency key


async def test_shutting_down_refuses_new_calls(upstream_factory, sidecar_factory):
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    assert await sc.gateway.drain(0.1) == 0
    status, answer = await sc.call(envelope())
    _assert_error(status, answer, 503, "SHUTTING_DOWN", True)
    async with sc.session.get(sc.url + "/readyz") as resp:
        assert resp.status == 503
    assert up.hits == 0


async def test_drain_answers_calls_that_outlive_it(upstream_factory, sidecar_factory):
    release = asyncio.Event()

    async def hang(_: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.json_response({})

    up = await upstream_factory(hang)
    target = openai_target(up.url, idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    call = asyncio.create_task(sc.call(envelope(timeout=30)))
    from tests.conftest import wait_for

    await wait_for(lambda: up.hits == 1)
    assert await sc.gateway.drain(0.05) == 1
    status, answer = await call
    release.set()
    _assert_error(status, answer, 503, "SHUTTING_DOWN", True)
    [record] = sc.audit_records()
    assert record["error_code"] == "SHUTTING_DOWN"


async def test_a_call_the_agent_hangs_up_on_still_finishes_and_is_audited(
    upstream_factory, sidecar_factory
):
    release = asyncio.Event()

    async def slow(_: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.json_response({"ok": 1, "usage": {"prompt_tokens": 2, "completion_tokens": 3}})

    up = await upstream_factory(slow)
    target = openai_target(up.url, idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    from tests.conftest import wait_for

    async with aiohttp.ClientSession() as agent:
        hung_up = asyncio.create_task(
            agent.post(sc.url + "/v1/calls", json=envelope(timeout=30))  # never read
        )
        await wait_for(lambda: up.hits == 1)
        hung_up.cancel()  # the agent gives up and closes its connection
        with contextlib.suppress(asyncio.CancelledError):
            await hung_up
    server = sc.server.runner.server  # the sidecar has seen it go (its handler runs on)
    await wait_for(lambda: all(c.transport is None for c in server.connections))
    release.set()
    await wait_for(lambda: len(sc.audit_records()) == 1)
    [record] = sc.audit_records()
    assert record["tokens_used"] == 5  # the call ran to its end
    # ... and its answer reached no one: audited so, as an agent hanging up mid-stream.
    assert record["success"] is False
    assert record["error_code"] == "STREAM_INTERRUPTED"
    assert any("agent_disconnected" in w for w in record["warnings"])
    assert sc.gateway.inflight == 0
    # The idempotency key was settled: the agent's retry is a replay, not a second call.
    status, answer = await sc.call(envelope(timeout=30))
    assert status == 200
    assert answer["replayed"] is True
    assert up.hits == 1


async def test_inflight_gauge_counts_calls_inside_and_returns_to_zero(
    upstream_factory, sidecar_factory, unused_tcp_port
):
    release = asyncio.Event()

    async def slow(_: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.json_response({"ok": 1})

    up = await upstream_factory(slow)
    dead = openai_target(f"http://127.0.0.1:{unused_tcp_port}")
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url), "dead": dead}))
    from tests.conftest import wait_for

    def gauge() -> float | None:
        return sc.gateway.metrics.registry.get_sample_value("egress_gateway_inflight_calls")

    calls = [asyncio.create_task(sc.call(envelope(timeout=30))) for _ in range(2)]
    await wait_for(lambda: up.hits == 2)
    assert gauge() == 2
    release.set()
    assert [status for status, _ in await asyncio.gather(*calls)] == [200, 200]
    status, _ = await sc.call(envelope(target_system="dead", max_retries=0))
    assert status == 502
    assert gauge() == 0


async def test_health_and_readiness(upstream_factory, sidecar_factory):
    _, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    async with sc.session.get(sc.url + "/healthz") as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "alive"
    async with sc.session.get(sc.url + "/readyz") as resp:
        assert resp.status == 200
        assert (await resp.json())["checks"]["policy_loaded"] is True


def test_every_error_code_is_documented_in_the_error_code_table():
    from pathlib import Path

    page = Path(__file__).resolve().parents[1].joinpath("docs", "api", "envelope.md").read_text()
    table = page.split("### Error codes", 1)[1].split("\n## ", 1)[0]
    for code in ErrorCode:
        assert f"| `{code.value}` |" in table, code


# -- hostile input: odd strings, ids, headers, paths, numbers; a tightened egress --------


async def test_lone_surrogate_is_refused_and_audited(upstream_factory, sidecar_factory):
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    body = json.dumps(envelope(metadata={"k": "X"})).replace('"X"', '"\\udc00"').encode()
    status, answer = await sc.call(body)
    _assert_error(status, answer, 400, "INVALID_PAYLOAD", False)
    assert answer["error"]["details"]["reason"] == "lone_surrogate"
    assert up.hits == 0
    [record] = sc.audit_records()
    assert record["trace_id"] == "tr-test-0001"


async def test_invalid_envelope_answer_keeps_the_callers_ids(upstream_factory, sidecar_factory):
    _, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    status, answer = await sc.call(envelope(endpoint=5))
    assert status == 400
    assert (answer["trace_id"], answer["correlation_id"]) == ("tr-test-0001", "corr-test-0001")


@pytest.mark.parametrize("value", ["a\r\nX-Injected: 1", "a\x00b", "a\nb"])
async def test_control_characters_in_header_values_are_refused(
    upstream_factory, sidecar_factory, value
):
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory, forward_headers=["X-Custom"])
    status, answer = await sc.call(envelope(headers={"X-Custom": value}))
    _assert_error(status, answer, 400, "INVALID_PAYLOAD", False)
    assert answer["error"]["details"]["reason"] == "invalid_header"
    assert up.hits == 0


async def test_env_secret_with_trailing_newline_is_trimmed(
    upstream_factory, sidecar_factory, monkeypatch
):
    monkeypatch.setenv("TEST_OPENAI_KEY", "sk-fake-TEST-0001-NOTREAL\n")
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    assert (await sc.call(envelope()))[0] == 200
    assert up.seen[0].headers["Authorization"] == "Bearer sk-fake-TEST-0001-NOTREAL"
    monkeypatch.setenv("TEST_OPENAI_KEY", "sk-fake-TEST\n0001-NOTREAL")
    status, answer = await sc.call(envelope(correlation_id="c2"))
    _assert_error(status, answer, 500, "SECRET_NOT_FOUND", False)
    assert answer["error"]["details"]["reason"] == "invalid_value"
    assert up.hits == 1


async def test_tomcat_dot_dot_semicolon_is_refused(upstream_factory, sidecar_factory):
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    status, answer = await sc.call(envelope(method="GET", endpoint="/v1/models/..;/admin"))
    _assert_error(status, answer, 403, "PERMISSION_DENIED", False)
    assert answer["error"]["details"]["problem"] == "dot_segment"
    assert up.hits == 0


async def test_metadata_is_bounded(upstream_factory, sidecar_factory):
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    status, answer = await sc.call(envelope(metadata={"blob": "x" * 20_000}))
    _assert_error(status, answer, 400, "INVALID_PAYLOAD", False)
    assert "metadata" in answer["error"]["message"]
    assert up.hits == 0


async def test_a_number_that_overflows_a_float_is_refused_not_forwarded(
    upstream_factory, sidecar_factory
):
    up, sc = await _policy_sidecar(upstream_factory, sidecar_factory)
    overflow = "9" * 300 + "e99"  # ~1e399: no 309-digit run, no 3-digit exponent
    body = json.dumps(envelope(parameters={"a": "X"}, metadata={"m": "Y", "big": 2**70}))
    status, answer = await sc.call(body.replace('"X"', overflow).replace('"Y"', "1").encode())
    _assert_error(status, answer, 400, "INVALID_PAYLOAD", False)
    assert answer["error"]["details"]["reason"] == "not_finite"
    assert up.hits == 0
    constants: list[str] = []  # NaN, Infinity: not RFC 8259 JSON
    for line in sc.log.getvalue().splitlines():
        json.loads(line, parse_constant=constants.append)
    assert constants == []


async def test_a_tightened_egress_applies_at_once_to_pooled_connections(
    upstream_factory, sidecar_factory
):
    # Keep-alive connections checked under the old rules must not keep a now denied
    # destination reachable for as long as calls kept them busy.
    up = await upstream_factory()
    by_name = up.url.replace("127.0.0.1", "localhost")  # checked when connecting
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(by_name)}))
    status, _ = await sc.call(envelope())
    assert status == 200
    denied = compile_policy({"fake-openai": openai_target(by_name)}, egress={})
    assert sc.gateway.pipeline is not None
    sc.gateway.apply_policy(denied)  # what a reload does once the file parses
    status, answer = await sc.call(envelope())
    _assert_error(status, answer, 403, "EGRESS_DENIED", False)
    assert up.hits == 1
    sc.gateway.apply_policy(compile_policy({"fake-openai": openai_target(by_name)}))
    status, _ = await sc.call(envelope())
    assert status == 200
    assert up.hits == 2


async def test_calls_in_flight_finish_on_the_old_pool_which_then_closes(
    upstream_factory, sidecar_factory
):
    release = asyncio.Event()

    async def slow(_: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.json_response({"ok": 1})

    up = await upstream_factory(slow)
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    from tests.conftest import wait_for

    call = asyncio.create_task(sc.call(envelope(timeout=30)))
    await wait_for(lambda: up.hits == 1)
    assert sc.gateway.pipeline is not None
    upstream = sc.gateway.pipeline.upstream
    old = upstream._session
    other = {"allow_cidrs": ["127.0.0.0/8"], "deny_cidrs": ["10.9.8.0/24"]}
    sc.gateway.apply_policy(compile_policy({"fake-openai": openai_target(up.url)}, egress=other))
    assert upstream._session is not old
    assert old is not None
    assert not old.closed  # the call in flight still uses it
    release.set()
    status, _ = await call
    assert status == 200
    await wait_for(lambda: old.closed)
    assert upstream._users == {}

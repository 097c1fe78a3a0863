"""Failure cases from ../shared/cases.md, against real loopback upstreams.

Code mapping (the cases' names are suggestions): TIMEOUT -> AGENT_TIMEOUT,
RATE_LIMITED -> CAPACITY_EXCEEDED (details.source "upstream"), REDIRECT_BLOCKED and
EGRESS_DENIED -> EGRESS_DENIED, INVALID_REQUEST -> INVALID_PAYLOAD,
PAYLOAD_TOO_LARGE -> INVALID_PAYLOAD with HTTP 413, a scheme/host in the endpoint ->
PERMISSION_DENIED (details.reason endpoint_not_a_path), UPSTREAM_BAD_GATEWAY ->
DEPENDENCY_FAILED.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import socket
import time
from typing import Any

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult

from tests.conftest import RULED_OUT_S, SOON_S, compile_policy, envelope, openai_target, wait_for

STRIPE_KEY = "rk_fake_TEST_0003_NOTREAL"
GEMINI_KEY = "gk-fake-TEST-0004-NOTREAL"
ANTHROPIC_KEY = "ak-fake-TEST-0002-NOTREAL"


@pytest.fixture(autouse=True)
def _case_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STRIPE_KEY", STRIPE_KEY)
    monkeypatch.setenv("FAKE_GEMINI_KEY", GEMINI_KEY)
    monkeypatch.setenv("FAKE_ANTHROPIC_KEY", ANTHROPIC_KEY)


def stripe_target(url: str, *, idempotency: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "base_url": url,
        "credential": {
            "header": "Authorization",
            "format": "Bearer {secret}",
            "default_ref": "env://FAKE_STRIPE_KEY",
        },
        "endpoints": [
            {"path": "/v1/charges", "methods": ["POST"]},
            {"path": "/v1/refunds", "methods": ["POST"]},
        ],
        "retry": {"backoff_base_s": 0.01, "backoff_max_s": 0.05},
    }
    if idempotency:
        spec["idempotency"] = {"header": "Idempotency-Key", "methods": ["POST"]}
    return spec


def stripe_envelope(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "target_system": "fake-stripe",
        "endpoint": "/v1/charges",
        "api_key_ref": ...,
        "parameters": {"amount": 1250, "currency": "usd", "source": "tok_fake_visa"},
    }
    fields.update(overrides)
    return envelope(**fields)


def _pieces(secret: str, size: int = 12) -> list[str]:
    return [secret[i : i + size] for i in range(len(secret) - size + 1)]


# -- B03: 4xx client errors are never retried --------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "http"),
    [
        (400, "UPSTREAM_REJECTED", 400),
        (401, "PERMISSION_DENIED", 403),
        (403, "PERMISSION_DENIED", 403),
        (404, "UPSTREAM_REJECTED", 404),
        (422, "UPSTREAM_REJECTED", 422),
    ],
)
async def test_b03_client_errors_not_retried(upstream_factory, sidecar_factory, status, code, http):
    body = {"error": {"type": "invalid_request_error", "message": "unknown parameter 'tempreture'"}}

    async def reject(_: web.Request) -> web.StreamResponse:
        return web.json_response(body, status=status)

    up = await upstream_factory(reject)
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    latencies = []
    for calls in range(1, 4):
        answered, answer = await sc.call(envelope(max_retries=3))
        assert up.hits == calls  # one attempt per call: not retried
        assert answered == http
        assert answer["success"] is False
        assert answer["status_code"] == status
        assert answer["error"]["code"] == code
        assert answer["error"]["retryable"] is False
        assert answer["data"] == body
        latencies.append(answer["latency_ms"])
    # The case's bound, on the best of three calls: a loaded machine slows some calls, a
    # backoff would slow every one.
    assert min(latencies) < 500


# -- B04: a lost answer to a POST is resent with the same idempotency key ----------------


async def test_b04_lost_response_resent_with_same_key(upstream_factory, sidecar_factory):
    charges: dict[str, dict[str, Any]] = {}
    ids = itertools.count(1)

    async def stripe(request: web.Request) -> web.StreamResponse:
        key = request.headers.get("Idempotency-Key", "")
        if key in charges:
            return web.json_response(charges[key])
        charge = {"id": f"ch_fake_{next(ids):02d}", "amount": (await request.json())["amount"]}
        charges[key] = charge
        if len(charges) == 1:  # the first answer is lost on the way back
            assert request.transport is not None
            request.transport.close()
        return web.json_response(charge)

    up = await upstream_factory(stripe)
    sc = await sidecar_factory(compile_policy({"fake-stripe": stripe_target(up.url)}))
    status, answer = await sc.call(stripe_envelope(max_retries=2))
    assert status == 200, answer
    assert up.hits == 2
    keys = [seen.headers.get("Idempotency-Key") for seen in up.seen]
    assert keys[0]
    assert keys[0] == keys[1]
    assert len(charges) == 1
    assert answer["data"]["id"] == "ch_fake_01"


async def test_b04_without_key_the_outcome_is_unknown(upstream_factory, sidecar_factory):
    async def drop(request: web.Request) -> web.StreamResponse:
        await request.read()
        assert request.transport is not None
        request.transport.close()
        return web.Response()

    up = await upstream_factory(drop)
    target = stripe_target(up.url, idempotency=False)
    sc = await sidecar_factory(compile_policy({"fake-stripe": target}))
    status, answer = await sc.call(stripe_envelope(max_retries=2))
    assert up.hits == 1
    assert status == 502
    assert answer["error"]["code"] == "OUTCOME_UNKNOWN"
    assert answer["error"]["retryable"] is False
    assert "may or may not have been processed" in answer["error"]["message"]


async def test_b04_the_same_envelope_twice_sends_the_same_derived_key(
    upstream_factory, sidecar_factory
):
    up = await upstream_factory()
    sc = await sidecar_factory(compile_policy({"fake-stripe": stripe_target(up.url)}))
    answers = [await sc.call(stripe_envelope()) for _ in range(2)]
    assert [status for status, _ in answers] == [200, 200]
    assert [a["replayed"] for _, a in answers] == [False, True]  # same key: one charge
    status, _ = await sc.call(stripe_envelope(correlation_id="corr-other"))
    keys = [seen.headers["Idempotency-Key"] for seen in up.seen]
    assert len(keys) == 2
    assert keys[0] != keys[1]
    status, _ = await sc.call(stripe_envelope(idempotency_key="agent-key-1"))
    assert status == 200
    assert up.seen[-1].headers["Idempotency-Key"] == "agent-key-1"


# -- B14: a key in the URL never reaches answers or logs ---------------------------------


async def test_b14_query_param_key_not_leaked(upstream_factory, sidecar_factory):
    async def overloaded(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"error": {"code": 503, "message": "model overloaded"}}, status=503
        )

    up = await upstream_factory(overloaded)
    target = {
        "base_url": up.url,
        "credential": {"query_param": "key", "default_ref": "env://FAKE_GEMINI_KEY"},
        "endpoints": [{"path": "/v1beta/models/*", "methods": ["POST"]}],
        "usage": "gemini",
        "retry": {"backoff_base_s": 0.01, "backoff_max_s": 0.02},
    }
    sc = await sidecar_factory(compile_policy({"fake-gemini": target}))
    status, answer = await sc.call(
        envelope(
            target_system="fake-gemini",
            endpoint="/v1beta/models/fake-model:generateContent",
            api_key_ref="env://FAKE_GEMINI_KEY",
            max_retries=1,
        )
    )
    assert up.hits == 2
    assert up.seen[0].query["key"] == GEMINI_KEY  # the key is really used
    assert status == 502
    assert answer["error"]["code"] == "DEPENDENCY_FAILED"
    emitted = json.dumps(answer) + sc.log.getvalue()
    for piece in _pieces(GEMINI_KEY):
        assert piece not in emitted
    [record] = sc.audit_records()
    assert record["upstream"] == f"http://127.0.0.1:{up.port}"
    assert "?" not in json.dumps(record)


async def test_b14_upstream_echoing_the_key_is_scrubbed(upstream_factory, sidecar_factory):
    async def echo(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"error": f"invalid key {request.query['key']} for {request.url}"}, status=400
        )

    up = await upstream_factory(echo)
    target = {
        "base_url": up.url,
        "credential": {"query_param": "key", "default_ref": "env://FAKE_GEMINI_KEY"},
        "endpoints": [{"path": "/v1beta/models/*", "methods": ["POST"]}],
    }
    sc = await sidecar_factory(compile_policy({"fake-gemini": target}))
    _, answer = await sc.call(
        envelope(
            target_system="fake-gemini",
            api_key_ref=...,
            endpoint="/v1beta/models/m:generateContent",
        )
    )
    assert answer["error"]["code"] == "UPSTREAM_REJECTED"
    assert GEMINI_KEY not in json.dumps(answer)
    assert "[REDACTED]" in answer["data"]["error"]


# -- B16: a cross-origin redirect is not followed ----------------------------------------


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_b16_cross_origin_redirect_blocked(upstream_factory, sidecar_factory, status):
    collector = await upstream_factory()

    async def redirect(_: web.Request) -> web.StreamResponse:
        return web.Response(status=status, headers={"Location": f"{collector.url}/collect"})

    origin = await upstream_factory(redirect)
    target = {
        "base_url": origin.url,
        "credential": {"header": "x-api-key", "default_ref": "env://FAKE_ANTHROPIC_KEY"},
        "endpoints": [
            {"path": "/v1/messages", "methods": ["POST"]},
            {"path": "/collect", "methods": ["POST", "GET"]},
        ],
    }
    sc = await sidecar_factory(compile_policy({"fake-anthropic": target}))
    answered, answer = await sc.call(
        envelope(
            target_system="fake-anthropic",
            endpoint="/v1/messages",
            api_key_ref=...,
            parameters={"messages": [{"role": "user", "content": "secret plan B"}]},
        )
    )
    assert collector.hits == 0
    assert origin.hits == 1
    assert answered == 403
    assert answer["error"]["code"] == "EGRESS_DENIED"
    assert answer["error"]["retryable"] is False
    assert answer["status_code"] == status
    assert answer["error"]["details"]["location_origin"] == f"http://127.0.0.1:{collector.port}"
    [record] = sc.audit_records()
    assert f"127.0.0.1:{collector.port}" in " ".join(record["warnings"])
    assert "/collect" not in json.dumps(record)


async def test_same_origin_redirect_followed_only_within_allowlist(
    upstream_factory, sidecar_factory
):
    async def moved(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/models/old":
            return web.Response(status=308, headers={"Location": "/v1/models/new"})
        if request.path == "/v1/models/new":
            return web.json_response({"id": "new"})
        return web.Response(status=307, headers={"Location": "/admin"})

    up = await upstream_factory(moved)
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    status, answer = await sc.call(envelope(method="GET", endpoint="/v1/models/old"))
    assert status == 200
    assert answer["data"] == {"id": "new"}
    assert [s.path for s in up.seen] == ["/v1/models/old", "/v1/models/new"]
    assert up.seen[1].headers["Authorization"] == "Bearer sk-fake-TEST-0001-NOTREAL"
    status, answer = await sc.call(envelope(method="GET", endpoint="/v1/models/evil"))
    assert status == 403
    assert answer["error"]["details"]["reason"] == "redirect_outside_allowlist"
    assert up.seen[-1].path == "/v1/models/evil"


# -- B17: SSRF to the metadata address ----------------------------------------------------


class MapResolver(AbstractResolver):
    """Resolves every name to one address, the way a poisoned DNS answer would."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.asked: list[str] = []

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.asked.append(host)
        return [
            {
                "hostname": host,
                "host": self.address,
                "port": port,
                "family": family,
                "proto": 0,
                "flags": 0,
            }
        ]

    async def close(self) -> None:
        pass


def inventory_target(url: str) -> dict[str, Any]:
    return {
        "base_url": url,
        "credential": {
            "header": "Authorization",
            "format": "Bearer {secret}",
            "default_ref": "env://TEST_OPENAI_KEY",
        },
        "endpoints": [
            {"path": "/items", "methods": ["GET"]},
            {"path": "/latest/**", "methods": ["GET"]},
        ],
    }


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "//169.254.169.254/latest/meta-data/",
        "/latest/meta-data/@169.254.169.254",
        "/%2e%2e/latest/meta-data/",
        "/latest/%%32e%%32e/%%32e%%32e/admin",  # sent as %252e: ".." to a double decoder
    ],
)
async def test_b17_endpoint_cannot_change_host(upstream_factory, sidecar_factory, endpoint):
    up = await upstream_factory()
    sc = await sidecar_factory(compile_policy({"fake-inventory": inventory_target(up.url)}))
    status, answer = await sc.call(
        envelope(target_system="fake-inventory", method="GET", endpoint=endpoint, api_key_ref=...)
    )
    assert status == 403
    assert answer["error"]["code"] == "PERMISSION_DENIED"
    assert answer["error"]["details"]["reason"] == "endpoint_not_a_path"
    assert up.hits == 0


async def test_b17_redirect_to_metadata_not_followed(upstream_factory, sidecar_factory):
    async def to_metadata(_: web.Request) -> web.StreamResponse:
        return web.Response(
            status=307, headers={"Location": "http://169.254.169.254/latest/meta-data/"}
        )

    up = await upstream_factory(to_metadata)
    sc = await sidecar_factory(compile_policy({"fake-inventory": inventory_target(up.url)}))
    status, answer = await sc.call(
        envelope(target_system="fake-inventory", method="GET", endpoint="/items", api_key_ref=...)
    )
    assert status == 403
    assert answer["error"]["code"] == "EGRESS_DENIED"
    assert answer["error"]["details"]["location_origin"] == "http://169.254.169.254:80"
    assert up.hits == 1


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254",
        "10.0.0.7",
        "172.16.5.4",
        "192.168.1.1",
        "fd00::1",
        "fe80::1",
        "::ffff:169.254.169.254",
    ],
)
async def test_b17_allowlisted_name_resolving_to_private_address(sidecar_factory, address):
    resolver = MapResolver(address)
    target = inventory_target("http://inventory.example.test:8080")
    sc = await sidecar_factory(compile_policy({"fake-inventory": target}), resolver=resolver)
    started = time.monotonic()
    status, answer = await sc.call(
        envelope(
            target_system="fake-inventory",
            method="GET",
            endpoint="/items",
            api_key_ref=...,
            timeout=RULED_OUT_S,
        )
    )
    assert resolver.asked == ["inventory.example.test"]
    assert status == 403
    assert answer["error"]["code"] == "EGRESS_DENIED"
    assert answer["error"]["retryable"] is False
    assert answer["error"]["details"]["address"] == address
    # Refused at resolution: no connection was tried (one would hang or fail slowly).
    assert time.monotonic() - started < SOON_S
    [record] = sc.audit_records()
    assert address in " ".join(record["warnings"])
    assert "sk-fake" not in sc.log.getvalue()


# -- B18: an HTML error page is not parsed as JSON ----------------------------------------

HTML_502 = (
    "<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad "
    "Gateway</h1></center></body></html>"
)


async def test_b18_html_502(upstream_factory, sidecar_factory):
    async def lb(_: web.Request) -> web.StreamResponse:
        return web.Response(status=502, text=HTML_502 + " " * 2000, content_type="text/html")

    up = await upstream_factory(lb)
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    status, answer = await sc.call(envelope(max_retries=1))
    assert up.hits == 2
    assert status == 502
    assert answer["success"] is False
    assert answer["status_code"] == 502
    assert answer["error"]["code"] == "DEPENDENCY_FAILED"
    assert answer["error"]["retryable"] is True
    message = answer["error"]["message"]
    assert "502" in message
    assert "not JSON" in message
    assert "JSONDecodeError" not in message
    assert "Expecting value" not in message
    assert answer["data"]["content_type"] == "text/html"
    assert len(answer["data"]["text"]) <= 512


async def test_b18_html_502_then_success(upstream_factory, sidecar_factory):
    async def flaky(_: web.Request) -> web.StreamResponse:
        if up.hits == 1:
            return web.Response(status=502, text=HTML_502, content_type="text/html")
        return web.json_response({"id": "ok"})

    up = await upstream_factory(flaky)
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    status, answer = await sc.call(envelope(max_retries=1))
    assert status == 200
    assert answer["success"] is True
    assert up.hits == 2
    [record] = sc.audit_records()
    assert record["attempts"] == 2


# -- B22: large, multibyte request bodies ------------------------------------------------


async def test_b22_large_multibyte_body(upstream_factory, sidecar_factory):
    async def digest(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        return web.json_response(
            {"sha256": hashlib.sha256(body).hexdigest(), "content_length": request.content_length}
        )

    pattern = "naïve café 🚀 "
    text = pattern * ((1536 * 1024) // len(pattern.encode()) + 1)
    up = await upstream_factory(digest)
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    params = {"model": "fake-model-1", "messages": [{"role": "user", "content": text}]}
    status, answer = await sc.call(envelope(parameters=params))
    assert status == 200, answer["error"]
    received = up.seen[0].body
    assert answer["data"]["content_length"] == len(received)
    assert answer["data"]["sha256"] == hashlib.sha256(received).hexdigest()
    assert json.loads(received.decode("utf-8")) == params  # no mojibake, no lost characters
    assert b"\\ud83d" not in received
    assert "🚀".encode() in received


async def test_b22_twenty_mib_envelope_refused_as_json(upstream_factory, sidecar_factory):
    up = await upstream_factory()
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    huge = json.dumps(envelope(parameters={"text": "x" * (20 * 1024 * 1024)})).encode()
    status, answer = await sc.call(huge)
    assert status == 413
    assert answer["error"]["code"] == "INVALID_PAYLOAD"
    assert answer["error"]["retryable"] is False
    assert answer["error"]["details"]["limit_bytes"] == 8 * 1024 * 1024
    assert up.hits == 0


# -- B23: a silent upstream cannot hang the call -----------------------------------------


@pytest.mark.parametrize("variant", ["silent", "stalled_stream"])
async def test_b23_deadline_holds(upstream_factory, sidecar_factory, variant):
    transports: list[asyncio.BaseTransport] = []
    never = asyncio.Event()

    async def stall(request: web.Request) -> web.StreamResponse:
        await request.read()
        assert request.transport is not None
        transports.append(request.transport)
        if variant == "stalled_stream":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n')
        await never.wait()
        return web.Response()

    up = await upstream_factory(stall)
    target = openai_target(up.url, idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    started = time.monotonic()
    status, answer = await sc.call(envelope(timeout=1, max_retries=0))
    elapsed = time.monotonic() - started
    assert elapsed < 1.5
    assert status == 504
    assert answer["error"]["code"] == "AGENT_TIMEOUT"
    assert answer["error"]["retryable"] is True
    assert 1000 <= answer["latency_ms"] <= 1500
    # The sidecar closed its end: the upstream's socket is released.
    await wait_for(lambda: transports[0].is_closing(), timeout_s=2.0)


async def test_b23_retry_fits_inside_the_overall_deadline(upstream_factory, sidecar_factory):
    never = asyncio.Event()

    async def silent(request: web.Request) -> web.StreamResponse:
        await never.wait()
        return web.Response()

    up = await upstream_factory(silent)
    target = openai_target(up.url, timeout_s=0.4, idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    started = time.monotonic()
    status, answer = await sc.call(envelope(timeout=1, max_retries=1))
    assert time.monotonic() - started < 1.5
    assert status == 504
    assert up.hits == 2  # per-attempt cap 0.4 s, so a retry fitted
    assert answer["error"]["code"] == "AGENT_TIMEOUT"


# -- B24: a misspelt field is refused before anything is sent ----------------------------


async def test_b24_misspelt_field_refused(upstream_factory, sidecar_factory):
    async def down(_: web.Request) -> web.StreamResponse:
        return web.json_response({}, status=503)

    up = await upstream_factory(down)
    sc = await sidecar_factory(compile_policy({"fake-stripe": stripe_target(up.url)}))
    env = stripe_envelope(max_retries=..., parameters={"amount": 100, "currency": "usd"})
    env["max_retires"] = 0
    status, answer = await sc.call(env)
    assert up.hits == 0
    assert status == 400
    assert answer["error"]["code"] == "INVALID_PAYLOAD"
    assert answer["error"]["retryable"] is False
    assert "max_retires" in answer["error"]["message"]
    # Unknown keys inside parameters are the upstream's business.
    env = stripe_envelope(parameters={"amount": 100, "max_retires": 0})
    status, _ = await sc.call(env)
    assert up.hits >= 1
    assert up.seen[0].json() == {"amount": 100, "max_retires": 0}


# -- B01: Retry-After honoured ------------------------------------------------------------


@pytest.mark.slow
async def test_b01_retry_after_honoured(upstream_factory, sidecar_factory):
    async def limited(_: web.Request) -> web.StreamResponse:
        if up.hits == 1:
            return web.json_response(
                {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}},
                status=429,
                headers={"retry-after": "2"},
            )
        return web.json_response(
            {"type": "message", "usage": {"input_tokens": 3, "output_tokens": 4}}
        )

    up = await upstream_factory(limited)
    target = {
        "base_url": up.url,
        "credential": {"header": "x-api-key", "default_ref": "env://FAKE_ANTHROPIC_KEY"},
        "endpoints": [{"path": "/v1/messages", "methods": ["POST"]}],
        "usage": "anthropic",
        "retry": {"backoff_base_s": 0.1},
    }
    sc = await sidecar_factory(compile_policy({"fake-anthropic": target}))
    status, answer = await sc.call(
        envelope(
            target_system="fake-anthropic",
            endpoint="/v1/messages",
            api_key_ref=...,
            timeout=10,
            max_retries=2,
        )
    )
    assert status == 200
    assert up.hits == 2
    gap = up.seen[1].at - up.seen[0].at
    assert 2.0 <= gap <= 3.5
    assert answer["latency_ms"] >= 2000
    assert answer["tokens_used"] == 7


async def test_b01_retry_after_beyond_deadline_answers_at_once(upstream_factory, sidecar_factory):
    async def limited(_: web.Request) -> web.StreamResponse:
        return web.json_response({"error": "slow down"}, status=429, headers={"retry-after": "30"})

    up = await upstream_factory(limited)
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    # A deadline under the upstream's Retry-After (30 s), far over SOON_S.
    status, answer = await sc.call(envelope(timeout=25, max_retries=2))
    assert up.hits == 1
    assert status == 429
    assert answer["status_code"] == 429
    assert answer["error"]["code"] == "CAPACITY_EXCEEDED"
    assert answer["error"]["retryable"] is True
    assert answer["error"]["suggested_retry_after"] == 30
    assert answer["latency_ms"] < SOON_S * 1000  # not a wait until the deadline


# -- B20, B21: streamed answers -------------------------------------------------------------


def _sse(*events: Any) -> bytes:
    out = b""
    for event in events:
        payload = event if isinstance(event, str) else json.dumps(event)
        out += f"data: {payload}\n\n".encode()
    return out


async def _stream_sidecar(upstream_factory, sidecar_factory, body: bytes, usage: str):
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for start in range(0, len(body), 50_000):
            await resp.write(body[start : start + 50_000])
        await resp.write_eof()
        return resp

    up = await upstream_factory(stream)
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url, usage=usage)}))
    return await sc.call(
        envelope(
            timeout=15,
            parameters={
                "model": "fake-model-1",
                "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
    )


async def test_b20_openai_stream_usage(upstream_factory, sidecar_factory):
    chunks = [{"choices": [{"delta": {"content": p}}]} for p in ("Hel", "lo", "!")]
    usage = {
        "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17},
    }
    status, answer = await _stream_sidecar(
        upstream_factory, sidecar_factory, _sse(*chunks, usage, "[DONE]"), "openai"
    )
    assert status == 200
    assert answer["data"]["content"] == "Hello!"
    assert answer["tokens_used"] == 17


async def test_b20_anthropic_stream_usage(upstream_factory, sidecar_factory):
    events = [
        {"type": "message_start", "message": {"usage": {"input_tokens": 12, "output_tokens": 1}}},
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hello!"}},
        {"type": "message_delta", "usage": {"output_tokens": 5}},
        {"type": "message_stop"},
    ]
    status, answer = await _stream_sidecar(
        upstream_factory, sidecar_factory, _sse(*events), "anthropic"
    )
    assert status == 200
    assert answer["data"]["content"] == "Hello!"
    assert answer["tokens_used"] == 17


async def test_b20_stream_without_usage_is_null(upstream_factory, sidecar_factory):
    chunks = [{"choices": [{"delta": {"content": "Hi"}}]}]
    _, answer = await _stream_sidecar(
        upstream_factory, sidecar_factory, _sse(*chunks, "[DONE]"), "openai"
    )
    assert answer["success"] is True
    assert answer["tokens_used"] is None


async def test_b21_one_event_bigger_than_read_buffer(upstream_factory, sidecar_factory):
    content = "A" * 307200
    events = [
        {"choices": [{"delta": {"content": content}}]},
        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}},
        "[DONE]",
    ]
    status, answer = await _stream_sidecar(
        upstream_factory, sidecar_factory, _sse(*events), "openai"
    )
    assert status == 200, answer["error"]
    assert answer["data"]["content"] == content
    assert answer["tokens_used"] == 3


async def test_redirect_outside_the_base_path_is_refused(upstream_factory, sidecar_factory):
    async def sideways(request: web.Request) -> web.StreamResponse:
        return web.Response(status=307, headers={"Location": "/basement/v1/models/x"})

    up = await upstream_factory(sideways)
    target = openai_target(up.url + "/base")
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    status, answer = await sc.call(envelope(method="GET", endpoint="/v1/models/x"))
    assert status == 403
    assert answer["error"]["details"]["reason"] == "redirect_outside_allowlist"
    assert [s.path for s in up.seen] == ["/base/v1/models/x"]

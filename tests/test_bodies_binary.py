"""Bodies that are not JSON: uploads in the envelope's ``body``, the envelope's
``query`` for any method, and the rules that keep both honest (intake, egress, idempotency)."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import pytest
from aiohttp import web

from tests.conftest import compile_policy, envelope, openai_target

AUDIO = bytes(range(256)) * 64  # 16 KiB, every byte value, not UTF-8


async def _sidecar(upstream_factory: Any, sidecar_factory: Any, handler: Any = None, **target):
    up = await upstream_factory(handler) if handler else await upstream_factory()
    spec = openai_target(up.url, endpoints=[{"path": "/v1/**", "methods": ["GET", "POST", "PUT"]}])
    spec.update(target)
    return up, await sidecar_factory(compile_policy({"fake-openai": spec}))


def _upload(data: bytes = AUDIO, content_type: str = "audio/wav") -> dict[str, Any]:
    return {"content_type": content_type, "base64": base64.b64encode(data).decode()}


async def test_an_upload_is_sent_as_its_bytes_with_its_content_type(
    upstream_factory, sidecar_factory
):
    up, sc = await _sidecar(upstream_factory, sidecar_factory)
    status, answer = await sc.call(
        envelope(endpoint="/v1/audio/transcriptions", parameters=..., body=_upload())
    )
    assert status == 200, answer
    [seen] = up.seen
    assert seen.body == AUDIO
    assert seen.headers["Content-Type"] == "audio/wav"
    assert seen.headers["Content-Length"] == str(len(AUDIO))
    [record] = sc.audit_records()
    assert record["request_bytes"] == len(AUDIO)
    assert record["request_sha256"] == hashlib.sha256(AUDIO).hexdigest()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"method": "GET", "parameters": ...}, "body"),
        ({"parameters": {"model": "m"}}, "body"),
        ({"parameters": ..., "body": {"content_type": "audio/wav", "base64": "not base64!"}},
         "body.base64"),
    ],
    ids=["on-get", "beside-parameters", "not-base64"],
)  # fmt: skip
async def test_a_body_that_cannot_be_sent_is_invalid_payload(
    overrides: dict[str, Any], field: str, upstream_factory, sidecar_factory
):
    up, sc = await _sidecar(upstream_factory, sidecar_factory)
    env = envelope(endpoint="/v1/files", body=_upload())
    env.update({k: v for k, v in overrides.items() if v is not ...})
    for k, v in overrides.items():
        if v is ...:
            env.pop(k, None)
    status, answer = await sc.call(env)
    assert status == 400, answer
    assert answer["error"]["code"] == "INVALID_PAYLOAD"
    assert [e["field"] for e in answer["error"]["details"]["errors"]] == [field]
    assert up.hits == 0


async def test_query_goes_out_for_any_method(upstream_factory, sidecar_factory):
    raw_queries: list[str] = []

    async def recording(request: web.Request) -> web.StreamResponse:
        raw_queries.append(request.query_string)
        return web.json_response({"ok": True})

    up, sc = await _sidecar(upstream_factory, sidecar_factory, recording)
    status, _ = await sc.call(envelope(endpoint="/v1/models:stream", query={"alt": "sse"}))
    assert status == 200
    status, _ = await sc.call(
        envelope(method="GET", endpoint="/v1/items", parameters={"a": 1}, query={"b": [2, 3]})
    )
    assert status == 200
    post, get = up.seen
    assert post.method == "POST"
    assert post.body == b'{"model":"fake-model-1","messages":[{"role":"user","content":"ping"}]}'
    assert get.method == "GET"
    assert raw_queries == ["alt=sse", "a=1&b=2&b=3"]


async def test_a_query_name_like_the_query_credential_is_refused(upstream_factory, sidecar_factory):
    credential = {"query_param": "key", "default_ref": "env://TEST_OPENAI_KEY",
                  "allowed_refs": ["env://TEST_OPENAI_KEY"]}  # fmt: skip
    up, sc = await _sidecar(upstream_factory, sidecar_factory, credential=credential)
    status, answer = await sc.call(envelope(api_key_ref=..., query={"KEY": "mine"}))
    assert status == 403
    assert answer["error"]["details"]["reason"] == "credential_parameter"
    assert up.hits == 0


async def test_an_idempotency_key_reused_with_another_upload_is_a_conflict(
    upstream_factory, sidecar_factory
):
    up, sc = await _sidecar(upstream_factory, sidecar_factory, idempotency={"methods": ["POST"]})
    first = envelope(endpoint="/v1/files", parameters=..., body=_upload(b"one"),
                     idempotency_key="upload-1")  # fmt: skip
    assert (await sc.call(first))[0] == 200
    again = {**first, "body": _upload(b"two")}
    status, answer = await sc.call(again)
    assert status == 422
    assert answer["error"]["code"] == "IDEMPOTENCY_CONFLICT"
    status, answer = await sc.call({**first, "query": {"purpose": "x"}})
    assert status == 422
    status, answer = await sc.call(first)
    assert answer["replayed"] is True
    assert up.hits == 1


# -- answers that are not text --------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("audio/mpeg", AUDIO),
        ("image/png", b"\x89PNG\r\n\x1a\n" + bytes(range(200))),
        ("application/octet-stream", b"\x00\x01\x02\xff"),
        ("text/plain", b"caf\xe9 \xff"),  # says text, is not UTF-8
        (None, b"\x80\x81\x82"),
    ],
    ids=["audio", "png", "octets", "not-utf8-text", "untyped"],
)
async def test_a_binary_answer_comes_back_byte_for_byte(
    content_type: str | None, body: bytes, upstream_factory, sidecar_factory
):
    async def serve(_: web.Request) -> web.StreamResponse:
        resp = web.Response(body=body)
        if content_type is not None:
            resp.headers["Content-Type"] = content_type
        return resp

    _, sc = await _sidecar(upstream_factory, sidecar_factory, serve)
    status, answer = await sc.call(envelope())
    assert status == 200, answer
    assert answer["success"] is True
    data = answer["data"]
    assert base64.b64decode(data["base64"]) == body
    assert data["bytes"] == len(body)
    assert "text" not in data


async def test_a_secret_inside_a_binary_answer_is_scrubbed_in_its_base64(
    upstream_factory, sidecar_factory
):
    async def echo(request: web.Request) -> web.StreamResponse:
        secret = request.headers["Authorization"].encode()
        # The secret at every alignment to base64's 3-byte groups.
        body = b"\x00\xff" + secret + b"\x01" + b"x" + secret + b"xy" + secret + b"\xfe"
        return web.Response(body=body, content_type="application/octet-stream")

    _, sc = await _sidecar(upstream_factory, sidecar_factory, echo)
    async with sc.session.post(sc.url + "/v1/calls", json=envelope()) as resp:
        raw = await resp.read()
    secret = b"sk-fake-TEST-0001-NOTREAL"
    for lead in range(3):
        core = base64.b64encode(b"\x00" * lead + secret).decode()[4 if lead else 0 : -4]
        assert core[:12].encode() not in raw
    assert b"[REDACTED]" in raw

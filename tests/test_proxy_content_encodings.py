"""Content encodings of an upstream's answer: every body reaches the agent decoded and
scrubbed. What aiohttp undoes (one ``gzip``, ``deflate``) and what it leaves (``x-gzip``,
RFC 9110 section 8.4.1.3's alias of gzip; stacked codings, ``gzip, gzip`` in one header
or two) are undone, last applied first, each layer bounded by ``max_response_bytes``; a
coding the sidecar cannot undo (``compress``, ``br`` without brotli, an unknown one)
refuses the answer (DEPENDENCY_FAILED, ``details.reason: content_encoding``, not
retried), streamed or not, rather than pass the body on coded and so unscrubbed. Real
sidecar, loopback upstream.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable

import pytest
from aiohttp import web

from gateway.errors import GatewayError
from gateway.upstream.codings import left_on_body
from tests.conftest import compile_policy, envelope, openai_stack, openai_target

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
KEY = "sk-fake-TEST-0001-NOTREAL"  # the provider key the sidecar holds (conftest)
PLAIN = json.dumps({"ok": True, "echo": f"Bearer {KEY}"}).encode()


def _gzip(data: bytes) -> bytes:
    """gzip without the time in its header: the bodies made at collection are test IDs, which
    must be the same in every pytest-xdist worker."""
    return gzip.compress(data, mtime=0)


def _deflate(data: bytes) -> bytes:
    return zlib.compress(data)


#: Content-Encoding header lines -> the body coded as they say (last applied last).
DECODED: dict[str, tuple[list[str], Callable[[bytes], bytes]]] = {
    "x-gzip": (["x-gzip"], _gzip),
    "X-GZIP": (["X-GZIP"], _gzip),
    "gzip, gzip": (["gzip, gzip"], lambda b: _gzip(_gzip(b))),
    "gzip, x-gzip": (["gzip, x-gzip"], lambda b: _gzip(_gzip(b))),
    "two headers": (["gzip", "gzip"], lambda b: _gzip(_gzip(b))),
    "deflate, gzip": (["deflate, gzip"], lambda b: _gzip(_deflate(b))),
    "gzip, deflate": (["gzip, deflate"], lambda b: _deflate(_gzip(b))),
    "identity, x-gzip": (["identity, x-gzip"], _gzip),
}


def _handler(lines: list[str], body: bytes, content_type: str = "application/json"):
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        for line in lines:
            resp.headers.add("Content-Encoding", line)
        return resp

    return handler


@pytest.mark.parametrize("case", DECODED)
async def test_a_coding_aiohttp_left_is_undone_and_the_body_scrubbed(
    upstream_factory, sidecar_factory, case: str
):
    lines, encode = DECODED[case]
    _, sc = await openai_stack(upstream_factory, sidecar_factory, _handler(lines, encode(PLAIN)))
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    async with sc.session.post(url, json=CHAT, auto_decompress=False) as resp:
        assert resp.status == 200
        assert "Content-Encoding" not in resp.headers
        got = json.loads(await resp.read())
    assert got["ok"] is True
    assert KEY not in got["echo"]
    status, answer = await sc.call(envelope(target_system="openai", parameters=CHAT))
    assert status == 200
    assert answer["data"]["ok"] is True
    assert KEY not in json.dumps(answer)


@pytest.mark.parametrize(
    ("lines", "body"),
    [
        (["compress"], PLAIN),
        (["x-unknown"], PLAIN),
        (["gzip, br"], PLAIN),
        (["gzip, compress"], PLAIN),
        # Which of two headers aiohttp undid depends on its parser (C: the last).
        (["x-gzip", "gzip"], _gzip(_gzip(PLAIN))),
        (["gzip", "deflate"], _deflate(_gzip(PLAIN))),
    ],
)
async def test_a_coding_the_sidecar_cannot_undo_is_refused_never_passed_on(
    upstream_factory, sidecar_factory, lines: list[str], body: bytes
):
    _, sc = await openai_stack(upstream_factory, sidecar_factory, _handler(lines, body))
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    async with sc.session.post(url, json=CHAT, auto_decompress=False) as resp:
        assert resp.status == 502
        assert resp.headers["x-egress-error-code"] == "DEPENDENCY_FAILED"
        assert resp.headers["x-egress-retryable"] == "false"
        body = await resp.read()
    assert KEY.encode() not in body
    [record] = sc.audit_records()
    assert (record["success"], record["error_code"], record["attempts"]) == (
        False,
        "DEPENDENCY_FAILED",
        1,
    )


async def test_a_streamed_answer_with_a_coding_left_on_it_is_refused(
    upstream_factory, sidecar_factory
):
    events = f'data: {{"echo": "{KEY}"}}\n\ndata: [DONE]\n\n'.encode()
    handler = _handler(["x-gzip"], _gzip(events), "text/event-stream")
    _, sc = await openai_stack(upstream_factory, sidecar_factory, handler)
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    async with sc.session.post(url, json={**CHAT, "stream": True}, auto_decompress=False) as resp:
        assert resp.status == 502
        body = await resp.read()
    assert KEY.encode() not in body
    [record] = sc.audit_records()
    assert (record["success"], record["error_code"]) == (False, "DEPENDENCY_FAILED")


@pytest.mark.parametrize("lines", [["x-gzip"], ["gzip, gzip"], ["gzip", "gzip"]])
async def test_every_layer_is_bounded_by_max_response_bytes(
    upstream_factory, sidecar_factory, lines: list[str]
):
    bomb = b"\0" * 4_000_000  # ~4 KB gzipped; once more: ~100 bytes
    body = _gzip(bomb) if len(lines) == 1 and "," not in lines[0] else _gzip(_gzip(bomb))
    up = await upstream_factory(_handler(lines, body))
    sc = await sidecar_factory(
        compile_policy({"openai": openai_target(up.url)}, server={"max_response_bytes": 65536})
    )
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    async with sc.session.post(url, json=CHAT) as resp:
        assert resp.status == 502
        assert resp.headers["x-egress-error-code"] == "RESPONSE_TOO_LARGE"


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_an_encoding_aiohttp_undid_comes_back_decoded(
    upstream_factory, sidecar_factory, encoding: str
):
    plain = json.dumps({"ok": True}).encode()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.Response(body=plain, content_type="application/json")
        resp.enable_compression(web.ContentCoding(encoding))
        return resp

    _, sc = await openai_stack(upstream_factory, sidecar_factory, handler)
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    async with sc.session.post(url, json=CHAT, auto_decompress=False) as resp:
        assert (await resp.read(), resp.headers.get("Content-Encoding")) == (plain, None)


@pytest.mark.parametrize(
    ("lines", "left"),
    [
        ([], ()),
        (["gzip"], ()),
        (["GZIP"], ()),
        (["identity"], ()),
        (["x-gzip"], ("x-gzip",)),
        (["gzip, br"], ("gzip", "br")),
        (["gzip", "gzip"], ("gzip",)),
        (["compress", "x-gzip"], ("compress", "x-gzip")),
        (["x-gzip", "gzip"], None),  # aiohttp's two parsers undo different headers
        (["gzip", "deflate"], None),
    ],
)
def test_the_codings_left_on_a_body_are_those_aiohttp_did_not_undo(
    lines: list[str], left: tuple[str, ...] | None
) -> None:
    from multidict import CIMultiDict, CIMultiDictProxy

    headers = CIMultiDictProxy(CIMultiDict([("Content-Encoding", v) for v in lines]))
    assert left_on_body(headers) == left


@pytest.mark.parametrize(
    ("codings", "body", "code"),
    [
        (("x-gzip",), _gzip(PLAIN)[:-9], "DEPENDENCY_FAILED"),  # cut short
        (("x-gzip",), _gzip(PLAIN) * 2, "DEPENDENCY_FAILED"),  # two members
        (("gzip", "gzip"), _gzip(PLAIN), "DEPENDENCY_FAILED"),  # one layer only
        (("gzip", "gzip"), _gzip(_gzip(b"\0" * 5000)), "RESPONSE_TOO_LARGE"),
        (("x-gzip",), _gzip(b"\0" * 4097), "RESPONSE_TOO_LARGE"),
    ],
)
def test_a_body_that_is_not_what_its_codings_say_or_too_large_once_undone_is_refused(
    codings: tuple[str, ...], body: bytes, code: str
) -> None:
    from gateway.upstream.codings import decoded
    from gateway.urls import URL

    with pytest.raises(GatewayError) as refused:
        decoded(body, codings, URL("https://api.example/v1"), 4096, 200)
    assert refused.value.code.value == code
    assert decoded(_gzip(b"\0" * 4096), ("x-gzip",), URL("https://a.example/"), 4096, 200)

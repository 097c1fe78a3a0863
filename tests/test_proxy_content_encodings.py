"""Content encodings on the drop-in route: what the sidecar undid comes back decoded,
what it could not undo (``x-gzip``, ``compress``, two layers) comes back as it came,
with the header of the layer left. Real sidecar, loopback upstream.
"""

from __future__ import annotations

import gzip
import json

import pytest
from aiohttp import web

from tests.conftest import openai_stack

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("encoding", ["x-gzip", "gzip, gzip", "compress"])
async def test_an_encoding_the_sidecar_did_not_undo_is_passed_back_with_its_header(
    upstream_factory, sidecar_factory, encoding: str
):
    plain = json.dumps({"ok": True}).encode()
    encoded = gzip.compress(gzip.compress(plain)) if "," in encoding else gzip.compress(plain)

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=encoded,
            headers={"Content-Type": "application/json", "Content-Encoding": encoding},
        )

    _, sc = await openai_stack(upstream_factory, sidecar_factory, handler)
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    async with sc.session.post(url, json=CHAT, auto_decompress=False) as resp:
        assert resp.status == 200
        got = await resp.read()
    # Either the body comes back decoded, or as it was sent with the header that says how.
    assert (got, resp.headers.get("Content-Encoding")) in {(plain, None), (encoded, encoding)}


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_an_encoding_the_sidecar_undid_comes_back_decoded(
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


async def test_a_second_content_encoding_header_stays_with_the_layer_left(
    upstream_factory, sidecar_factory
):
    plain = json.dumps({"ok": True}).encode()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.Response(body=gzip.compress(gzip.compress(plain)))
        resp.headers["Content-Type"] = "application/json"
        resp.headers.add("Content-Encoding", "gzip")
        resp.headers.add("Content-Encoding", "gzip")  # aiohttp undoes the first only
        return resp

    _, sc = await openai_stack(upstream_factory, sidecar_factory, handler)
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    async with sc.session.post(url, json=CHAT, auto_decompress=False) as resp:
        assert resp.headers.getall("Content-Encoding") == ["gzip"]
        assert gzip.decompress(await resp.read()) == plain

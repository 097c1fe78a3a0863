"""HEAD through the drop-in route: the upstream's Content-Length describes the body a GET
would get (RFC 9110 section 9.3.2 and 8.6); it goes back to the agent unchanged, not
replaced by the length of the empty body the sidecar writes."""

from __future__ import annotations

from aiohttp import web

from tests.conftest import compile_policy, openai_target

FILE = b"x" * 1234


async def _file(request: web.Request) -> web.StreamResponse:
    return web.Response(body=FILE, content_type="application/octet-stream")


async def test_head_keeps_the_upstreams_content_length(upstream_factory, sidecar_factory):
    up = await upstream_factory(_file)
    target = openai_target(
        up.url, endpoints=[{"path": "/v1/files/*", "methods": ["GET", "HEAD"]}], usage="none"
    )
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    async with sc.session.head(sc.url + "/proxy/fake-openai/v1/files/f-1") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Length"] == str(len(FILE))
        assert resp.headers["Content-Type"] == "application/octet-stream"
        assert await resp.read() == b""
    async with sc.session.get(sc.url + "/proxy/fake-openai/v1/files/f-1") as resp:
        assert resp.status == 200
        assert await resp.read() == FILE
        assert resp.headers["Content-Length"] == str(len(FILE))
    assert [r["method"] for r in sc.audit_records()] == ["HEAD", "GET"]


async def _gzipped(request: web.Request) -> web.StreamResponse:
    import gzip

    packed = gzip.compress(FILE)
    return web.Response(
        body=packed,
        headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
    )


async def test_head_of_a_coded_body_says_no_length(upstream_factory, sidecar_factory):
    # A GET through the sidecar gets the body decoded (its Content-Encoding undone), so the
    # upstream's length of the gzip body would describe nothing the agent can get.
    up = await upstream_factory(_gzipped)
    target = openai_target(
        up.url, endpoints=[{"path": "/v1/files/*", "methods": ["GET", "HEAD"]}], usage="none"
    )
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    async with sc.session.head(sc.url + "/proxy/fake-openai/v1/files/f-1") as resp:
        assert resp.status == 200
        assert "Content-Encoding" not in resp.headers
        assert resp.headers.get("Content-Length") in (None, "0")
    async with sc.session.get(
        sc.url + "/proxy/fake-openai/v1/files/f-1", auto_decompress=False
    ) as resp:
        assert "Content-Encoding" not in resp.headers
        assert await resp.read() == FILE

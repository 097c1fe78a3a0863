"""Header values, status lines and content types holding bytes that are not UTF-8.

HTTP allows obs-text (RFC 9110 section 5.5, RFC 9112 section 4); the sidecar's HTTP
client and its JSON answers speak UTF-8. What the agent sends is refused rather than
forwarded altered (a ``traceparent`` is replaced as any invalid one is); what the
upstream sends still gets the route's own answer shape, the bytes escaped, never passed
back altered. Real sidecar, raw sockets on both sides where an HTTP client would tidy
the bytes up.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.conftest import compile_policy, envelope, openai_target
from tests.rawhttp import read_message


@pytest.mark.parametrize(
    "name", [b"anthropic-beta", b"x-team", b"accept", b"idempotency-key", b"tracestate"]
)
async def test_an_agent_header_that_is_not_utf8_is_refused_not_forwarded_altered(
    upstream_factory, sidecar_factory, name
):
    """A drop-in request header the sidecar forwards (an SDK header, one of the target's
    ``forward_headers``, the idempotency key of a target without idempotency) whose value
    holds bytes that are not UTF-8 (obs-text, here Latin-1 ``\\xe9``): the sidecar's HTTP
    client writes header values as UTF-8, so it could only forward it altered (``caf``
    reached the upstream for ``caf\\xe9``). It is refused instead, audited, and nothing
    is sent."""
    up = await upstream_factory()
    target = openai_target(up.url, forward_headers=["x-team"])
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.server.port)
    body = b'{"model":"m","messages":[]}'
    writer.write(
        b"POST /proxy/fake-openai/v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\n"
        b"Content-Type: application/json\r\n" + name + b": caf\xe9\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, answer = raw.partition(b"\r\n\r\n")
    assert up.hits == 0, [s.headers for s in up.seen]
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 400 Bad Request"
    error = json.loads(answer)["error"]
    assert error["code"] == "INVALID_PAYLOAD"
    assert name.decode() in error["message"]
    records = sc.audit_records()
    assert len(records) == 1
    assert records[0]["error_code"] == "INVALID_PAYLOAD"


async def test_a_traceparent_that_is_not_utf8_is_replaced_as_any_invalid_one(
    upstream_factory, sidecar_factory
):
    """The fallback of the refusal above: a ``traceparent`` is never forwarded as it came
    unless valid (hex digits), so one with non-UTF-8 bytes is replaced, as before."""
    up = await upstream_factory()
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.server.port)
    body = b'{"model":"m","messages":[]}'
    writer.write(
        b"POST /proxy/fake-openai/v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\n"
        b"Content-Type: application/json\r\ntraceparent: caf\xe9\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert raw.split(b"\r\n")[0] == b"HTTP/1.1 200 OK"
    assert up.hits == 1
    sent = {k.lower(): v for k, v in up.seen[0].headers.items()}["traceparent"]
    assert sent.startswith("00-")
    assert len(sent) == 55


class RawUpstream:
    """Answers every request with the raw status line and headers it is given."""

    def __init__(self, status_line: bytes, headers: bytes = b"", body: bytes = b"{}") -> None:
        self.head = b"HTTP/1.1 " + status_line + b"\r\n" + headers
        self.body = body
        self.requests = 0
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_message(reader)
        self.requests += 1
        writer.write(self.head + b"Content-Length: %d\r\n\r\n%s" % (len(self.body), self.body))
        await writer.drain()
        writer.close()


async def _raw_upstream(fake: RawUpstream) -> asyncio.Server:
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    fake.port = server.sockets[0].getsockname()[1]
    return server


async def _raw_call(port: int, path: bytes, body: bytes) -> tuple[bytes, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (path, len(body), body)
    )
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, answer = raw.partition(b"\r\n\r\n")
    return head, answer


@pytest.mark.parametrize(
    ("status_line", "headers", "status", "code"),
    [
        (
            b"400 Mauvaise requ\xeate",
            b"Content-Type: application/json\r\n",
            400,
            "UPSTREAM_REJECTED",
        ),
        (b"503 Indisponible \xe0 pr\xe9sent", b"Content-Type: application/json\r\n", 503, None),
        (b"502 Bad Gateway", b"Content-Type: t\xe9xt/html\r\n", 502, None),
    ],
)
async def test_an_upstream_status_line_that_is_not_utf8_still_gets_an_envelope(
    sidecar_factory, status_line, headers, status, code
):
    """An upstream error whose reason phrase (RFC 9112 section 4 allows obs-text) or
    Content-Type holds bytes that are not UTF-8: the error message quotes them, and the
    envelope route could not write that message as JSON (aiohttp's plain-text ``500
    Server got itself in trouble`` went back instead of an ExternalCallResponse). The
    message has them escaped (``\\udcea``), as the ids of an invalid envelope are."""
    fake = RawUpstream(status_line, headers)
    server = await _raw_upstream(fake)
    try:
        sc = await sidecar_factory(
            compile_policy({"fake-openai": openai_target(f"http://127.0.0.1:{fake.port}")})
        )
        head, answer = await _raw_call(
            sc.server.port, b"/v1/calls", json.dumps(envelope(max_retries=0)).encode()
        )
        assert head.split(b"\r\n")[0].split(b" ")[1] != b"500", (head, answer)
        doc = json.loads(answer)
        assert doc["success"] is False
        assert doc["status_code"] == status
        if code is not None:
            assert doc["error"]["code"] == code
        assert str(status) in doc["error"]["message"]
        assert "\\udc" in doc["error"]["message"]  # the byte, escaped
        assert b"could not be written" not in answer  # the data kept, not a note
        assert len(sc.audit_records()) == 1
    finally:
        server.close()
        await server.wait_closed()


async def test_a_reason_phrase_that_is_not_utf8_is_not_passed_back_altered(sidecar_factory):
    """The drop-in route passes the upstream's reason phrase back; one holding bytes that
    are not UTF-8 could only go back altered (``D\\xe9j\\xe0`` went back as ``Dj``), so the
    standard phrase of the status is written instead, as for a header value."""
    fake = RawUpstream(b"200 D\xe9j\xe0", b"Content-Type: application/json\r\n", b'{"id":"x"}')
    server = await _raw_upstream(fake)
    try:
        sc = await sidecar_factory(
            compile_policy({"fake-openai": openai_target(f"http://127.0.0.1:{fake.port}")})
        )
        head, answer = await _raw_call(
            sc.server.port, b"/proxy/fake-openai/v1/chat/completions", b'{"model":"m"}'
        )
        assert head.split(b"\r\n")[0] == b"HTTP/1.1 200 OK"
        assert answer == b'{"id":"x"}'
    finally:
        server.close()
        await server.wait_closed()


async def test_a_success_whose_content_type_is_not_utf8_keeps_its_data(sidecar_factory):
    """The same Content-Type on a 200 that is not JSON: the answer's ``data`` names it
    (escaped) and keeps the body, instead of the note that the data could not be
    written as JSON."""
    fake = RawUpstream(b"200 OK", b"Content-Type: t\xe9xt/plain\r\n", b"hello")
    server = await _raw_upstream(fake)
    try:
        sc = await sidecar_factory(
            compile_policy({"fake-openai": openai_target(f"http://127.0.0.1:{fake.port}")})
        )
        head, answer = await _raw_call(
            sc.server.port, b"/v1/calls", json.dumps(envelope(max_retries=0)).encode()
        )
        assert head.split(b"\r\n")[0] == b"HTTP/1.1 200 OK"
        doc = json.loads(answer)
        assert doc["success"] is True
        assert doc["data"]["content_type"] == "t\\udce9xt/plain"
        assert "could not be written" not in json.dumps(doc["data"])
        assert len(sc.audit_records()) == 1
    finally:
        server.close()
        await server.wait_closed()

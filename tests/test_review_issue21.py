"""Review of issue 21's changes (newcomer and adversary, h-review): each test is a break
found on main, written to fail before its fix."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from aiohttp import web

from tests.conftest import compile_policy, envelope, openai_target, wait_for
from tests.rawhttp import read_message
from tests.redis_fixtures import SHARED_URL, redis_prefix
from tests.test_upstream_101 import switcher

__all__ = ["redis_prefix", "switcher"]  # fixtures, imported for pytest

CHAT = {"model": "fake-model-1", "messages": [{"role": "user", "content": "ping"}]}


async def test_a_replayed_101_is_not_sent_to_the_agent_as_101(switcher, sidecar_factory):
    """An upstream 101 on a target with idempotency: the first answer is the 502 refusal
    and its key is completed; the resend with the same key must get that 502 again, not a
    ``101 Switching Protocols`` of the sidecar's own (which would switch the agent's
    connection)."""
    target = openai_target(f"http://127.0.0.1:{switcher.port}", idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    headers = {"x-egress-timeout": "5", "Idempotency-Key": "key-101"}
    url = sc.url + "/proxy/fake-openai/v1/chat/completions"
    answers = []
    for _ in range(2):
        async with sc.session.post(url, json=CHAT, headers=headers) as resp:
            answers.append(
                (resp.status, resp.headers.get("x-egress-error-code"), await resp.read())
            )
    assert switcher.requests == 1  # the key held: the upstream saw one request
    first, second = answers
    assert first[0] == 502
    assert first[1] == "UPSTREAM_REJECTED"
    assert second[0] == 502, second
    assert second[1] == "UPSTREAM_REJECTED"
    assert len(sc.audit_records()) == 2


async def test_a_replayed_redirect_is_the_refusal_the_first_answer_was(
    upstream_factory, sidecar_factory
):
    """An upstream redirect (not followed) is refused with the provider's 502 error body
    on the drop-in route; its replay must be that same refusal, not a bare 300 of the
    sidecar's own with an empty body (nor a redirect the SDK might follow)."""

    async def redirect(_: object) -> web.StreamResponse:
        return web.Response(status=300, text="choose")  # no Location: not followed

    up = await upstream_factory(redirect)
    target = openai_target(up.url, idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    headers = {"Idempotency-Key": "key-300"}
    url = sc.url + "/proxy/fake-openai/v1/chat/completions"
    answers = []
    for _ in range(2):
        async with sc.session.post(url, json=CHAT, headers=headers, allow_redirects=False) as resp:
            body = await resp.json(content_type=None) if resp.status == 502 else None
            answers.append((resp.status, resp.headers.get("x-egress-error-code"), body))
    assert up.hits == 1
    first, second = answers
    assert first[0] == 502
    assert first[1] == "UPSTREAM_REJECTED"
    assert second == first  # the same status, code and provider-shaped error body


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


#: An answer just under the bound of a large one (gateway.api.http.WRITE_BUFFERED_BYTES).
MEDIUM = {"object": "blob", "text": "x" * (60 * 1024)}


async def _medium(_: web.Request) -> web.StreamResponse:
    return web.json_response(MEDIUM)


async def test_small_answers_to_an_agent_that_stopped_reading_are_bounded_too(upstream_factory):
    """An agent that sends requests on one connection (pipelined) and reads none of the
    answers, each under 64 KiB: each is handed to the transport at once, but once the
    earlier ones fill it the next one waits for the socket to drain, without a bound
    (aiohttp's ``write_eof`` drains). That answer must be written within
    ``body_timeout_s`` as a large one is, the connection dropped and ``answer_undelivered``
    logged."""
    from tests.test_answer_write_bound import _lines, _sidecar

    up = await upstream_factory(_medium)
    server, log = await _sidecar(up.url, body_timeout_s=0.5)
    agent = socket.socket()
    agent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        agent.connect(("127.0.0.1", server.port))
        body = json.dumps(envelope()).encode()
        one = (
            b"POST /v1/calls HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        agent.sendall(one * 200)  # ~12 MiB of answers, more than any socket buffers
        await wait_for(
            lambda: any(x.get("event") == "answer_undelivered" for x in _lines(log)), 15.0
        )
        line = next(x for x in _lines(log) if x.get("event") == "answer_undelivered")
        assert line["reason"] == "agent_stalled"
    finally:
        agent.close()
        await server.close()


async def test_pipelined_answers_to_an_agent_that_reads_all_arrive(upstream_factory):
    """The other side of the bound above: an agent that pipelines its requests and reads
    gets every answer whole, in order, and nothing is logged undelivered."""
    from tests.test_answer_write_bound import _lines, _sidecar

    up = await upstream_factory(_medium)
    server, log = await _sidecar(up.url, body_timeout_s=5.0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        body = json.dumps(envelope()).encode()
        one = (
            b"POST /v1/calls HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        writer.write(one * 40)
        await writer.drain()
        for _ in range(40):
            head, raw = await asyncio.wait_for(read_message(reader), 10)
            assert head.startswith(b"HTTP/1.1 200 OK")
            answer = json.loads(raw)
            assert answer["data"] == MEDIUM
        writer.close()
        assert up.hits == 40
        assert not any(x.get("event") == "answer_undelivered" for x in _lines(log))
    finally:
        await server.close()


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


@pytest.mark.parametrize("scope", ["local", "cluster"])
async def test_concurrent_idempotent_answers_are_each_their_own(
    upstream_factory, sidecar_factory, redis_prefix, scope
):
    """The answer serialised once for the store and the wire (call/idempotent.py
    ``rendered``, one slot): under concurrency, and with the store's awaits between the
    slot's writing and the answer (Redis, ``scope: cluster``), every call gets its own
    answer's bytes, and every resend its own replay."""

    async def echo(request: web.Request) -> web.StreamResponse:
        sent = await request.json()
        return web.json_response({"echo": sent["n"], "text": "x" * (sent["n"] * 97 % 5000)})

    up = await upstream_factory(echo)
    target = openai_target(up.url, idempotency={"methods": ["POST"], "scope": scope})
    extra = {"redis": {"url": SHARED_URL, "key_prefix": redis_prefix}} if scope == "cluster" else {}
    sc = await sidecar_factory(compile_policy({"fake-openai": target}, **extra))

    def env(n: int) -> dict[str, object]:
        return envelope(correlation_id=f"corr-{n}", parameters={"model": "m", "n": n})

    for _round in range(2):  # the first: all go upstream; the second: all replayed
        answers = await asyncio.gather(*(sc.call(env(n)) for n in range(60)))
        for n, (status, answer) in enumerate(answers):
            assert status == 200
            assert answer["correlation_id"] == f"corr-{n}"
            assert answer["data"]["echo"] == n
            assert len(answer["data"]["text"]) == n * 97 % 5000
            assert answer["replayed"] is (_round == 1)
    assert up.hits == 60

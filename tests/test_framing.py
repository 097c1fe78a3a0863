"""Request framing and encoding, over raw TCP to a real listener.

A ``Content-Encoding`` the body does not have, or one the sidecar does not decode, gets
a JSON ExternalCallResponse with INVALID_PAYLOAD (``details.reason: content_encoding``);
a body that stalls gets 408 (``body_timeout``). What aiohttp's HTTP parser refuses
before any handler runs (conflicting lengths, bad chunks, oversize headers, bad request
lines) gets aiohttp's own 400 text answer: these tests show that then nothing reaches the
upstream and nothing more is read from that connection (no request is smuggled behind
it). The listener is the one ``gateway serve`` runs: ``create_app`` behind
``make_runner``, on 127.0.0.1 port 0, in front of a recording loopback upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.policy import PolicySet
from gateway.server.app import BODY_TIMEOUT_S, KEEPALIVE_TIMEOUT_S, LINGERING_TIME_S
from tests.conftest import FakeUpstream, compile_policy, envelope, openai_target
from tests.rawhttp import Listener, chunked, closed_within, exchange, listening, request

ROOT = Path(__file__).resolve().parent.parent

ListenerFactory = Callable[..., Awaitable[Listener]]


@pytest.fixture
async def listener_factory() -> AsyncIterator[ListenerFactory]:
    async with contextlib.AsyncExitStack() as stack:

        async def make(policy: PolicySet, **kw: Any) -> Listener:
            return await stack.enter_async_context(listening(policy, **kw))

        yield make


def _policy(up: FakeUpstream) -> PolicySet:
    return compile_policy({"fake-openai": openai_target(up.url)})


ENVELOPE = json.dumps(envelope()).encode()


async def _listener(upstream: FakeUpstream, listener_factory: ListenerFactory, **kw: Any):
    return await listener_factory(_policy(upstream), **kw)


def _assert_one_refusal_record(lst: Listener, status: int) -> None:
    """The refusal before the pipeline has its one audit record (decision ``invalid``)."""
    [record] = lst.log.records()
    assert (record["decision"], record["error_code"]) == ("invalid", "INVALID_PAYLOAD")
    assert (record["http_method"], record["http_path"]) == ("POST", "/v1/calls")
    assert record["http_status"] == status


# -- Content-Encoding --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "encoding"),
    [
        (gzip.compress(ENVELOPE), "gzip"),
        (zlib.compress(ENVELOPE), "deflate"),
        (zlib.compress(ENVELOPE)[2:-4], "deflate"),  # raw deflate, as some clients send
        (gzip.compress(ENVELOPE), "GZIP"),
        (ENVELOPE, "identity"),
    ],
    ids=["gzip", "deflate", "raw-deflate", "upper-case", "identity"],
)
async def test_an_encoded_envelope_is_decoded_and_forwarded(
    body: bytes, encoding: str, upstream: FakeUpstream, listener_factory: ListenerFactory
) -> None:
    lst = await _listener(upstream, listener_factory)
    ex = await exchange(lst.port, request(body, ("Content-Encoding", encoding)))
    [answer] = ex.answers
    assert answer.status == 200, answer.body
    assert answer.envelope().success is True
    assert upstream.hits == 1
    assert upstream.seen[0].json() == envelope()["parameters"]
    assert len(lst.log.records()) == 1


@pytest.mark.parametrize(
    ("body", "encoding"),
    [
        (ENVELOPE, "gzip"),
        (ENVELOPE, "deflate"),
        (b"\x1f\x8b" + ENVELOPE, "gzip"),  # the magic number, then no gzip stream
        (zlib.compress(ENVELOPE), "gzip"),
    ],
    ids=["plain-as-gzip", "plain-as-deflate", "bad-gzip-header", "deflate-as-gzip"],
)
async def test_a_body_that_is_not_what_its_content_encoding_says_is_invalid_payload(
    body: bytes, encoding: str, upstream: FakeUpstream, listener_factory: ListenerFactory
) -> None:
    lst = await _listener(upstream, listener_factory)
    # A second request pipelined behind it is never read: the connection closes.
    ex = await exchange(
        lst.port, request(body, ("Content-Encoding", encoding)) + request(ENVELOPE), answers=2
    )
    [answer] = ex.answers
    assert answer.status == 400
    error = answer.envelope().error
    assert error is not None
    assert error.code == "INVALID_PAYLOAD"
    assert error.details["reason"] == "content_encoding"
    assert error.retryable is False
    assert answer.headers.get("connection", "").lower() == "close"
    assert ex.closed
    assert upstream.hits == 0
    _assert_one_refusal_record(lst, 400)


@pytest.mark.parametrize(
    "encodings",
    [["x-unknown"], ["compress"], ["gzip, gzip"], ["gzip", "gzip"], ["identity, gzip"]],
    ids=["unknown", "compress", "two-codings", "two-headers", "identity-then-gzip"],
)
async def test_a_content_encoding_the_sidecar_does_not_decode_is_415(
    encodings: list[str], upstream: FakeUpstream, listener_factory: ListenerFactory
) -> None:
    lst = await _listener(upstream, listener_factory)
    headers = [("Content-Encoding", value) for value in encodings]
    ex = await exchange(lst.port, request(ENVELOPE, *headers) + request(ENVELOPE), answers=2)
    [answer] = ex.answers
    assert answer.status == 415
    error = answer.envelope().error
    assert error is not None
    assert error.code == "INVALID_PAYLOAD"
    assert error.details["reason"] == "content_encoding"
    assert error.details["supported"] == ["identity", "gzip", "deflate"]
    assert ex.closed
    assert upstream.hits == 0
    _assert_one_refusal_record(lst, 415)


def _decodes(name: str) -> bool:
    from importlib.util import find_spec

    module = {"br": "brotli", "zstd": "backports.zstd"}[name]
    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("encoding", ["br", "zstd"])
async def test_br_and_zstd_without_their_decoders_are_refused_by_the_parser(
    encoding: str, upstream: FakeUpstream, listener_factory: ListenerFactory
) -> None:
    if _decodes(encoding):
        pytest.skip(f"{encoding} is decoded here: aiohttp lets the handler answer")
    lst = await _listener(upstream, listener_factory)
    ex = await exchange(
        lst.port, request(ENVELOPE, ("Content-Encoding", encoding)) + request(ENVELOPE), answers=2
    )
    [answer] = ex.answers
    assert (answer.status, answer.is_json) == (400, False)  # aiohttp's own answer
    assert b"content-encoding" in answer.body
    assert ex.closed
    assert upstream.hits == 0


# -- malformed framing: aiohttp's parser answers, nothing is smuggled --------------------

#: Requests aiohttp's HTTP parser refuses before any handler runs, each with a valid
#: envelope pipelined behind it: the answer is aiohttp's 400 text, the connection closes,
#: and neither request reaches the upstream. docs/getting-started.md, "Calling the sidecar",
#: lists them.
PARSER_REFUSALS: dict[str, bytes] = {
    "duplicate-content-length": request(ENVELOPE, ("Content-Length", str(len(ENVELOPE)))),
    "conflicting-content-length": request(ENVELOPE, ("Content-Length", "5")),
    "content-length-list": request(
        ENVELOPE, ("Content-Length", f"{len(ENVELOPE)}, {len(ENVELOPE)}"), length=False
    ),
    "negative-content-length": request(ENVELOPE, ("Content-Length", "-1"), length=False),
    "signed-content-length": request(
        ENVELOPE, ("Content-Length", f"+{len(ENVELOPE)}"), length=False
    ),
    "content-length-and-chunked": request(
        chunked(ENVELOPE), ("Transfer-Encoding", "chunked")
    ),  # the classic CL.TE smuggling shape
    "chunked-not-last": request(ENVELOPE, ("Transfer-Encoding", "chunked, identity"), length=False),
    "unknown-transfer-encoding": request(ENVELOPE, ("Transfer-Encoding", "identity"), length=False),
    "bad-chunk-size": request(
        b"zz\r\n" + ENVELOPE + b"\r\n0\r\n\r\n", ("Transfer-Encoding", "chunked"), length=False
    ),
    "chunk-without-crlf": request(
        b"%x\r\n" % len(ENVELOPE) + ENVELOPE + b"XX0\r\n\r\n",
        ("Transfer-Encoding", "chunked"),
        length=False,
    ),
    "header-line-too-long": request(ENVELOPE, ("X-Long", "a" * 9000)),
    "too-many-headers": request(ENVELOPE, *[(f"X-H{i}", "v") for i in range(200)]),
    "space-in-header-name": request(ENVELOPE, ("X Bad", "v")),
    "obs-fold": request(ENVELOPE, ("X-A", "a\r\n folded")),
    "bare-lf": request(ENVELOPE).replace(b"\r\n", b"\n"),
    "lower-case-method": request(ENVELOPE, method="post"),
    "unknown-method": request(ENVELOPE, method="BREW"),
    "space-in-method": request(ENVELOPE, method="PO ST"),
    "relative-path": request(ENVELOPE, path="v1/calls"),
    "request-line-too-long": request(ENVELOPE, path="/v1/calls?" + "a" * 9000),
    "http-2-version": request(ENVELOPE, version="HTTP/2.0"),
    "tls-client-hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32,
    "nul-in-path": request(ENVELOPE, path="/v1/calls\x00"),
}


@pytest.mark.parametrize("name", sorted(PARSER_REFUSALS))
async def test_malformed_http_is_refused_by_the_parser_and_nothing_is_smuggled(
    name: str, upstream: FakeUpstream, listener_factory: ListenerFactory
) -> None:
    lst = await _listener(upstream, listener_factory)
    ex = await exchange(lst.port, PARSER_REFUSALS[name] + request(ENVELOPE), answers=2)
    [answer] = ex.answers
    assert answer.status == 400
    assert not answer.is_json  # aiohttp's text: no handler ran
    assert ex.closed
    assert ex.rest == b""
    assert upstream.hits == 0
    assert lst.log.records() == []


async def test_a_bad_chunk_after_the_headers_arrived_ends_the_connection_unforwarded(
    upstream: FakeUpstream, listener_factory: ListenerFactory
) -> None:
    # The handler is already waiting for the body when the broken chunk arrives: aiohttp's
    # parser drops the body, the body timeout answers.
    lst = await _listener(upstream, listener_factory, body_timeout_s=0.3)
    head = request(b"", ("Transfer-Encoding", "chunked"), length=False)
    ex = await exchange(
        lst.port, head, b"%x\r\n" % len(ENVELOPE), b"zz\r\n" + request(ENVELOPE), answers=2
    )
    assert len(ex.answers) == 1
    assert ex.answers[0].status in {400, 408}
    if ex.answers[0].is_json:
        error = ex.answers[0].envelope().error
        assert error is not None
        assert error.code == "INVALID_PAYLOAD"
    assert ex.closed
    assert upstream.hits == 0


async def test_pipelined_requests_are_each_answered_in_order(
    upstream: FakeUpstream, listener_factory: ListenerFactory
) -> None:
    lst = await _listener(upstream, listener_factory)
    bodies = [json.dumps(envelope(correlation_id=f"c-{i}")).encode() for i in range(3)]
    ex = await exchange(lst.port, b"".join(request(b) for b in bodies), answers=3)
    assert [a.envelope().correlation_id for a in ex.answers] == ["c-0", "c-1", "c-2"]
    assert upstream.hits == 3
    assert len(lst.log.records()) == 3


async def test_http_1_0_is_answered_and_closed(
    upstream: FakeUpstream, listener_factory: ListenerFactory
) -> None:
    lst = await _listener(upstream, listener_factory)
    ex = await exchange(lst.port, request(ENVELOPE, version="HTTP/1.0"), answers=2)
    [answer] = ex.answers
    assert answer.envelope().success is True
    assert ex.closed
    assert upstream.hits == 1


# -- slow and idle clients ---------------------------------------------------------------


async def test_a_body_that_stalls_is_answered_408_and_the_connection_closed(
    upstream: FakeUpstream, listener_factory: ListenerFactory
) -> None:
    lst = await _listener(upstream, listener_factory, body_timeout_s=0.2)
    head = request(b"", ("Content-Length", str(len(ENVELOPE))), length=False)
    started = asyncio.get_running_loop().time()
    ex = await exchange(lst.port, head + ENVELOPE[:10], answers=1)
    elapsed = asyncio.get_running_loop().time() - started
    [answer] = ex.answers
    assert answer.status == 408
    error = answer.envelope().error
    assert error is not None
    assert (error.code, error.details["reason"]) == ("INVALID_PAYLOAD", "body_timeout")
    assert answer.headers.get("connection", "").lower() == "close"
    assert 0.2 <= elapsed < 3.0
    assert upstream.hits == 0
    _assert_one_refusal_record(lst, 408)


async def test_a_chunked_body_that_never_ends_is_answered_408(
    upstream: FakeUpstream, listener_factory: ListenerFactory
) -> None:
    lst = await _listener(upstream, listener_factory, body_timeout_s=0.2)
    head = request(b"", ("Transfer-Encoding", "chunked"), length=False)
    ex = await exchange(lst.port, head + b"%x\r\n" % len(ENVELOPE) + ENVELOPE + b"\r\n")
    [answer] = ex.answers
    assert answer.status == 408
    assert upstream.hits == 0


@pytest.mark.parametrize("ops", [False, True], ids=["calls", "ops"])
async def test_an_idle_connection_is_closed_after_the_keepalive_timeout(
    ops: bool, upstream: FakeUpstream, listener_factory: ListenerFactory
) -> None:
    lst = await _listener(upstream, listener_factory, keepalive_timeout_s=0.2, ops=ops)
    # Never sends a byte; then one that sends a request and stays idle after the answer.
    assert await closed_within(lst.port, b"", timeout_s=3.0)
    path = "/healthz"
    ex = await exchange(lst.port, request(b"", method="GET", path=path), answers=2)
    assert [a.status for a in ex.answers] == [200]
    assert ex.closed  # closed by the sidecar after 0.2 s idle, before our 5 s bound


async def test_headers_that_trickle_in_are_cut_off_by_the_keepalive_timeout(
    upstream: FakeUpstream, listener_factory: ListenerFactory
) -> None:
    lst = await _listener(upstream, listener_factory, keepalive_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
    started = asyncio.get_running_loop().time()
    closed = False
    try:
        async with asyncio.timeout(5):
            for i in range(500):  # one header line every 20 ms, never the blank line
                writer.write(b"POST /v1/calls HTTP/1.1\r\n" if i == 0 else b"X-Slow: 1\r\n")
                try:
                    await writer.drain()
                    # The pause is the slow client being simulated, not a synchronisation.
                    data = await asyncio.wait_for(reader.read(1024), 0.02)
                except TimeoutError:
                    continue
                except ConnectionError:
                    data = b""
                assert data == b""
                closed = True
                break
    finally:
        writer.close()
    assert closed
    assert asyncio.get_running_loop().time() - started < 3.0
    assert upstream.hits == 0


async def test_after_a_408_the_rest_of_the_body_is_waited_for_no_longer_than_lingering(
    upstream: FakeUpstream, listener_factory: ListenerFactory
) -> None:
    lst = await _listener(upstream, listener_factory, body_timeout_s=0.1, lingering_time_s=0.3)
    head = request(b"", ("Content-Length", str(len(ENVELOPE))), length=False)
    started = asyncio.get_running_loop().time()
    ex = await exchange(lst.port, head + ENVELOPE[:10], answers=2)
    assert [a.status for a in ex.answers] == [408]
    assert ex.closed
    assert asyncio.get_running_loop().time() - started < 3.0


def test_the_listener_limits_are_documented_with_their_defaults() -> None:
    page = (ROOT / "docs" / "running.md").read_text()
    assert f"{KEEPALIVE_TIMEOUT_S:g} s" in page
    assert f"{BODY_TIMEOUT_S:g} s" in page
    assert f"{LINGERING_TIME_S:g} s" in page

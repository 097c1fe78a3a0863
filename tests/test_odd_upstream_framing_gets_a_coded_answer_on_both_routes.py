"""What an upstream's HTTP framing may do, lawful or not, and what the agent gets, on the
envelope route and the drop-in route: an answer in its own shape with a documented
code, the upstream hit once (a POST without an idempotency key), one audit record.

Lawful oddities are answered as usual: ``100 Continue`` or ``103 Early Hints`` before the
answer (RFC 9110 section 15.2), an HTTP/1.0 answer whose body ends with the connection,
a folded header (obs-fold, RFC 9112 section 5.2), a header value that is not UTF-8.
Answers aiohttp's parser refuses (a NUL in a header, a header past 8190 bytes, too many
headers, Content-Length with Transfer-Encoding, two lengths, a bad chunk size, a status
line that is not one) are DEPENDENCY_FAILED ``malformed_response``, not resent (the same
bytes would come back). A body cut short after the head (a Content-Length not met, no
last chunk) is OUTCOME_UNKNOWN: the upstream may have acted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import compile_policy, envelope, openai_target
from tests.rawhttp import read_message

BODY = json.dumps({"choices": [{"message": {"content": "pong"}}]}).encode()
TYPE = b"Content-Type: application/json\r\n"


def _sized(head: bytes = b"HTTP/1.1 200 OK\r\n", extra: bytes = b"") -> bytes:
    return head + TYPE + extra + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY


CHUNKED = b"HTTP/1.1 200 OK\r\n" + TYPE + b"Transfer-Encoding: chunked\r\n"
MALFORMED = ("DEPENDENCY_FAILED", "malformed_response")
UNKNOWN = ("OUTCOME_UNKNOWN", "reset")

#: name -> (the bytes the upstream answers with before closing, expected (code, reason)
#: or None for the answer passed on)
FRAMINGS: dict[str, tuple[bytes, tuple[str, str | None] | None]] = {
    "100-continue-first": (b"HTTP/1.1 100 Continue\r\n\r\n" + _sized(), None),
    "103-early-hints-first": (
        b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n" + _sized(),
        None,
    ),
    "http-1.0-close-delimited": (b"HTTP/1.0 200 OK\r\n" + TYPE + b"\r\n" + BODY, None),
    "obs-fold": (_sized(extra=b"X-Folded: a\r\n  b\r\n"), None),
    "value-not-utf8": (_sized(extra=b"X-Latin: caf\xe9\xff\r\n"), None),
    "nul-in-a-value": (_sized(extra=b"X-Nul: a\x00b\r\n"), MALFORMED),
    "header-past-8190-bytes": (_sized(extra=b"X-Big: " + b"a" * 9000 + b"\r\n"), MALFORMED),
    "too-many-headers": (
        _sized(extra=b"".join(b"X-H%d: v\r\n" % i for i in range(200))),
        MALFORMED,
    ),
    "length-and-chunked": (
        CHUNKED + b"Content-Length: 5\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),
        MALFORMED,
    ),
    "two-lengths": (_sized(extra=b"Content-Length: 3\r\n"), MALFORMED),
    "bad-chunk-size": (CHUNKED + b"\r\nzz\r\n" + BODY + b"\r\n0\r\n\r\n", MALFORMED),
    "status-not-three-digits": (b"HTTP/1.1 2000 OK\r\n\r\n", MALFORMED),
    "not-http": (b"SSH-2.0-OpenSSH_9.6\r\n", MALFORMED),
    "length-not-met": (_sized()[: -len(BODY) // 2], UNKNOWN),
    "no-last-chunk": (CHUNKED + b"\r\n%x\r\n%s\r\n" % (len(BODY), BODY), UNKNOWN),
}


@contextlib.asynccontextmanager
async def _answering(raw: bytes) -> AsyncIterator[tuple[int, list[int]]]:
    """A raw upstream answering each request with ``raw``, then closing: its port and
    the count of requests it read."""
    hits = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_message(reader)
            hits[0] += 1
            writer.write(raw)
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], hits
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("route", ["envelope", "drop-in"])
@pytest.mark.parametrize("framing", list(FRAMINGS))
async def test_each_framing_gets_the_answer_or_a_documented_code_once(
    sidecar_factory: Any, framing: str, route: str
) -> None:
    raw, expected = FRAMINGS[framing]
    async with _answering(raw) as (port, hits):
        target = openai_target(f"http://127.0.0.1:{port}")
        sc = await sidecar_factory(compile_policy({"fake-openai": target}))
        if route == "envelope":
            status, answer = await sc.call(envelope(max_retries=2))
            got = answer["data"] if answer["success"] else None
            error = answer["error"] or {}
        else:
            url = f"{sc.url}/proxy/fake-openai/v1/chat/completions"
            async with sc.session.post(url, json=envelope()["parameters"]) as resp:
                status, body = resp.status, await resp.json()
            code = resp.headers.get("x-egress-error-code")
            got = None if code else body
            error = {"code": code, **body.get("error", {})} if code else {}
        if expected is None:
            assert status == 200, error
            assert got == json.loads(BODY)
        else:
            assert status == 502
            assert error["code"] == expected[0], error
            if route == "envelope":
                assert error["retryable"] is False
                assert error["details"].get("reason") == expected[1]
            assert "OpenSSH" not in json.dumps(error)  # the raw bytes are never echoed
        assert hits[0] == 1
    [record] = sc.audit_records()
    assert record["error_code"] == (expected[0] if expected else None)

"""Upstream-controlled redirect Locations.

A raw TCP upstream on loopback answers 301/302/307 with a Location written byte for
byte (aiohttp.web would refuse to send some of them), then 200 to a followed hop. Every
Location is either followed by the documented rule (same origin, allowlisted path,
nothing the upstream chose added to the request) or refused with a classified code and
``retryable: false``: never UNKNOWN, never a plain-text 500. A second server, which
several Locations point at, must receive nothing; the canary key appears nowhere.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from yarl import URL

from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope
from tests.test_canary import CANARY, _pieces

SAME = "127.0.0.1:{same}"
OTHER = "127.0.0.1:{other}"


@dataclass
class RawSeen:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes

    @property
    def url(self) -> URL:
        return URL(self.target, encoded=True)


@dataclass
class RawUpstream:
    """Answers the first request of each call with ``status`` and the ``location`` bytes
    (or several), and any later request with 200 JSON; one request per connection."""

    status: int = 307
    locations: list[bytes] = field(default_factory=list)
    seen: list[RawSeen] = field(default_factory=list)
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.seen.append(RawSeen(method, target, headers, body))
            if len(self.seen) == 1:
                answer = b"HTTP/1.1 %d Redirect\r\n" % self.status
                for location in self.locations:
                    answer += b"Location: " + location + b"\r\n"
                answer += b"Set-Cookie: session=from-the-redirect\r\n"
                answer += b"Content-Length: 0\r\nConnection: close\r\n\r\n"
            else:
                payload = json.dumps({"followed": target}).encode()
                answer = (
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(payload) + payload
                )
            writer.write(answer)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def raw_upstream() -> AsyncIterator[RawUpstream]:
    fake = RawUpstream()
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    fake.port = server.sockets[0].getsockname()[1]
    yield fake
    server.close()
    await server.wait_closed()


@dataclass
class Lab:
    raw: RawUpstream
    other: FakeUpstream
    sidecar: Sidecar

    def location(self, template: bytes) -> bytes:
        return template.replace(b"{same}", b"%d" % self.raw.port).replace(
            b"{other}", b"%d" % self.other.port
        )

    async def call(
        self, target: str, method: str, status: int, *locations: bytes
    ) -> tuple[int, dict[str, Any]]:
        self.raw.status = status
        self.raw.locations = [self.location(loc) for loc in locations]
        self.raw.seen.clear()
        parameters: dict[str, Any] = {"a": "1"} if method == "GET" else {"msg": "plan B"}
        return await self.sidecar.call(
            envelope(
                target_system=target,
                endpoint="/v1/start",
                method=method,
                api_key_ref=...,
                parameters=parameters,
                max_retries=2,
                timeout=30,  # a deadline no refusal waits for, even on a loaded machine
            )
        )


@pytest.fixture
async def lab(
    raw_upstream: RawUpstream,
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    monkeypatch: pytest.MonkeyPatch,
) -> Lab:
    monkeypatch.setenv("CANARY_KEY", CANARY)
    other = await upstream_factory()
    endpoints = [{"path": "/v1/**", "methods": ["GET", "POST"]}]
    base = f"http://127.0.0.1:{raw_upstream.port}"
    retry = {"backoff_base_s": 0.01, "backoff_max_s": 0.02}
    targets = {
        "in-query": {
            "base_url": base,
            "endpoints": endpoints,
            "retry": retry,
            "credential": {"query_param": "key", "default_ref": "env://CANARY_KEY"},
        },
        "in-header": {
            "base_url": base,
            "endpoints": endpoints,
            "retry": retry,
            "credential": {"header": "x-api-key", "default_ref": "env://CANARY_KEY"},
        },
    }
    return Lab(raw_upstream, other, await sidecar_factory(compile_policy(targets)))


def _invalid(problem: str) -> tuple[str, str, str | None]:
    return ("PERMISSION_DENIED", "invalid_redirect_location", problem)


CROSS_ORIGIN = ("EGRESS_DENIED", "cross_origin_redirect", None)
MALFORMED = ("DEPENDENCY_FAILED", "malformed_response", None)
OUTSIDE = ("PERMISSION_DENIED", "redirect_outside_allowlist", None)

#: Location bytes -> (code, details.reason, details.problem) of the refusal.
REFUSED: list[tuple[str, bytes, tuple[str, str, str | None]]] = [
    (
        "port-too-high",
        b"http://127.0.0.1:99999/v1/y?key=" + CANARY.encode(),
        _invalid("invalid_url"),
    ),
    ("port-negative", b"http://127.0.0.1:-1/v1/y", _invalid("invalid_url")),
    ("port-not-a-number", b"http://127.0.0.1:abc/v1/y", _invalid("invalid_url")),
    ("two-ports", b"http://" + SAME.encode() + b":9/v1/y", _invalid("invalid_url")),
    ("bracket-unclosed", b"http://[::1/v1/y", _invalid("invalid_url")),
    ("bracket-not-ipv6", b"http://[zz]/", _invalid("invalid_url")),
    ("backslash-authority", b"http:\\\\127.0.0.1:{other}\\v1", _invalid("backslash")),
    ("backslash-path", b"/\\127.0.0.1:{other}/v1/y", _invalid("backslash")),
    ("backslash-inside", b"/v1\\y", _invalid("backslash")),
    ("userinfo-same-origin", b"http://user:pw@" + SAME.encode() + b"/v1/y", _invalid("userinfo")),
    ("userinfo-scheme-relative", b"//u@" + SAME.encode() + b"/v1/y", _invalid("userinfo")),
    ("userinfo-empty", b"//@" + SAME.encode() + b"/v1/y", _invalid("userinfo")),
    (
        "userinfo-password-only",
        b"http://:" + CANARY.encode() + b"@" + SAME.encode() + b"/v1/y",
        _invalid("userinfo"),
    ),
    ("userinfo-other-origin", b"//u@" + OTHER.encode() + b"/v1/y", _invalid("userinfo")),
    ("control-soh", b"/v1/\x01y", _invalid("control_characters")),
    ("control-tab", b"/v1/a\tb", _invalid("control_characters")),
    ("control-del", b"/v1/\x7fy", _invalid("control_characters")),
    ("control-c1-nel", "/v1/\x85y".encode(), _invalid("control_characters")),
    ("space", b"/v1/a b", _invalid("whitespace")),
    ("no-break-space", "/v1/a\xa0b".encode(), _invalid("whitespace")),
    ("not-utf8", b"/v1/\xffy", _invalid("not_utf8")),
    ("empty", b"", _invalid("empty")),
    ("scheme-file", b"file:///etc/passwd", _invalid("scheme")),
    ("scheme-javascript", b"javascript:alert(1)", _invalid("scheme")),
    ("scheme-data", b"data:text/html,hi", _invalid("scheme")),
    ("scheme-ws", b"ws://" + SAME.encode() + b"/v1/y", _invalid("scheme")),
    ("too-long", b"/v1/" + b"a" * 5000, _invalid("too_long")),
    ("dot-dot", b"../..", OUTSIDE),
    ("other-origin", b"http://" + OTHER.encode() + b"/collect", CROSS_ORIGIN),
    ("other-scheme", b"https://" + SAME.encode() + b"/v1/y", CROSS_ORIGIN),
    ("port-zero", b"http://127.0.0.1:0/v1/y", CROSS_ORIGIN),
    # aiohttp's parser refuses these before any Location can be read.
    ("nul", b"/v1/\x00y", MALFORMED),
    ("bare-cr", b"/v1/a\rb", MALFORMED),
    ("past-the-parser-limit", b"/v1/" + b"a" * 9000, MALFORMED),
]

#: (method, status) pairs that are judged alike: every Location is checked first.
JUDGED = [("GET", 301), ("GET", 302), ("GET", 307), ("POST", 307), ("POST", 302)]


def _emitted(lab: Lab, answers: list[dict[str, Any]]) -> str:
    return json.dumps(answers) + lab.sidecar.log.getvalue()


@pytest.mark.parametrize(
    ("location", "expected"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
async def test_refused_locations_are_classified_and_nothing_follows(
    lab: Lab, location: bytes, expected: tuple[str, str, str | None]
) -> None:
    code, reason, problem = expected
    answers = []
    for target in ("in-query", "in-header"):
        for method, status in JUDGED:
            answered, answer = await lab.call(target, method, status, location)
            where = f"{target} {method} {status}"
            assert answer["success"] is False, where
            error = answer["error"]
            if reason == "redirect_outside_allowlist" and (method, status) == ("POST", 302):
                # A valid same-origin Location after a POST: the 302 is answered as is.
                assert (error["code"], answer["status_code"]) == ("UPSTREAM_REJECTED", 302)
                answers.append(answer)
                continue
            assert (error["code"], error["details"].get("reason")) == (code, reason), where
            assert error["details"].get("problem") == problem, where
            assert error["retryable"] is False, where
            assert answered == (502 if code == "DEPENDENCY_FAILED" else 403), where
            assert len(lab.raw.seen) == 1, where  # not followed, not retried
            answers.append(answer)
    assert lab.other.hits == 0
    records = lab.sidecar.audit_records()
    assert len(records) == len(answers)
    assert [r["error_code"] for r in records] == [a["error"]["code"] for a in answers]
    emitted = _emitted(lab, answers)
    for piece in _pieces(CANARY):
        assert piece not in emitted, piece
    assert "UNKNOWN" not in emitted


async def test_several_location_headers_are_refused(lab: Lab) -> None:
    _, answer = await lab.call("in-query", "GET", 302, b"/v1/y", b"http://127.0.0.1:{other}/v1/y")
    assert answer["error"]["details"] == {
        "reason": "invalid_redirect_location",
        "problem": "repeated",
    }
    assert len(lab.raw.seen) == 1
    assert lab.other.hits == 0


def _only_our_credential(seen: RawSeen, target: str) -> None:
    """The followed hop carries the policy's credential and nothing the redirect chose."""
    assert "authorization" not in seen.headers
    assert "cookie" not in seen.headers  # the redirect's Set-Cookie is not replayed
    if target == "in-query":
        assert seen.url.query.getall("key") == [CANARY]
        assert "x-api-key" not in seen.headers
    else:
        assert seen.headers["x-api-key"] == CANARY


BOTH = ("in-query", "in-header")


@pytest.mark.parametrize(
    ("location", "path", "query", "targets"),
    [
        (b"/v1/y", "/v1/y", [], BOTH),
        (b"http://" + SAME.encode() + b"/v1/y", "/v1/y", [], BOTH),
        (b"//" + SAME.encode() + b"/v1/y", "/v1/y", [], BOTH),
        (b"y#fragment", "/v1/y", [], BOTH),
        # A relative "?q" replaces the query (RFC 3986, section 5.2.2): "a=1" is not resent.
        (b"?q", "/v1/start", [("q", "")], BOTH),
        # What the upstream puts in the query cannot choose the query credential.
        (
            b"/v1/y?key=attacker&KEY=2&k%65y=3&key%5B%5D=4&b=2&c=3;key=5",
            "/v1/y",
            [("b", "2")],
            ("in-query",),
        ),
        (b"/v1/y?key=" + CANARY.encode(), "/v1/y", [], ("in-query",)),
    ],
    ids=[
        "path",
        "absolute",
        "scheme-relative",
        "fragment",
        "query-only",
        "credential-names",
        "echoed-key",
    ],
)
async def test_followed_redirects_carry_only_the_policys_credential(
    lab: Lab,
    location: bytes,
    path: str,
    query: list[tuple[str, str]],
    targets: tuple[str, ...],
) -> None:
    answers = []
    for target in targets:
        for method, status in [("GET", 301), ("GET", 302), ("GET", 307), ("POST", 307)]:
            answered, answer = await lab.call(target, method, status, location)
            where = f"{target} {method} {status}"
            assert answered == 200, (where, answer)
            assert len(lab.raw.seen) == 2, where
            first, second = lab.raw.seen
            assert first.url.query.get("a") == ("1" if method == "GET" else None)
            assert second.method == method
            assert second.url.path == path, where
            assert "#" not in second.target
            items = [(k, v) for k, v in second.url.query.items() if k != "key"]
            assert items == query, where
            assert second.body == first.body  # a 307 resends the body; GET has none
            _only_our_credential(second, target)
            answers.append(answer)
    assert lab.other.hits == 0
    emitted = _emitted(lab, answers)
    for piece in _pieces(CANARY):
        assert piece not in emitted, piece


async def test_302_to_a_post_is_answered_as_is(lab: Lab) -> None:
    """301/302/303 after a POST are not followed (docs/features/egress.md)."""
    answered, answer = await lab.call("in-query", "POST", 302, b"/v1/y")
    assert answered == 502
    assert answer["status_code"] == 302
    assert answer["error"]["code"] == "UPSTREAM_REJECTED"
    assert answer["error"]["retryable"] is False
    assert len(lab.raw.seen) == 1

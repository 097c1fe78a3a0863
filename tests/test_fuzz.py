"""Property-based fuzzing of the calls listener.

Generated envelopes (valid ones with fields mutated, wrong types, unknown fields, huge
strings, deep nesting, odd unicode, control characters, lone surrogates, duplicate keys,
every method, bodies that are not JSON or not UTF-8) and generated raw HTTP requests
(wrong, duplicate or conflicting Content-Length, chunked bodies with bad chunks,
Content-Encodings the body has or has not, oversize headers, bad methods and paths,
HTTP/1.0, pipelining) go to a real sidecar listener in front of a recording loopback
upstream. For every example:

* each answer is a well-formed ExternalCallResponse JSON with the HTTP status the
  "Error codes" table of docs/api/envelope.md gives its code, and the code is never
  UNKNOWN; or, for malformed HTTP only, aiohttp's own plain-text 400, after which the
  connection is closed and nothing more is answered (docs/getting-started.md, "Calling
  the sidecar");
* each JSON answer has exactly one audit record, valid against the schema, and what
  the agent got is what it says; aiohttp's own answers have none;
* a refusal forwarded nothing, and the upstream saw exactly one request per answered
  upstream attempt: nothing is smuggled.

``FUZZ_EXAMPLES=N`` sets the examples per test (default 300, derandomized, so the suite
stays reproducible); ``make fuzz`` runs 10,000 each, random, and prints the figures.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.envelope import ExternalCallResponse
from tests.conftest import FakeUpstream, compile_policy, envelope, openai_target
from tests.rawhttp import Listener, RawAnswer, chunked, exchange, listening
from tests.rawhttp import request as http_request

ROOT = Path(__file__).resolve().parent.parent
FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
settings.register_profile(
    "fuzz",
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,  # nothing written into the work tree
    derandomize="FUZZ_EXAMPLES"
    not in os.environ,  # the suite's run is reproducible; `make fuzz` explores
    suppress_health_check=list(HealthCheck),  # one sidecar serves all examples of a test
    print_blob=True,
)
FUZZ = settings.get_profile("fuzz")
# A failing example can be large (a 300 kB string): its repr is still wanted.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

#: Codes after which nothing may have been forwarded (when no upstream answer is in it).
REFUSALS = frozenset(
    {
        "INVALID_PAYLOAD",
        "SCHEMA_MISMATCH",
        "PERMISSION_DENIED",
        "EGRESS_DENIED",
        "SECRET_NOT_FOUND",
        "SECRET_ACCESS_DENIED",
        "IDEMPOTENCY_CONFLICT",
    }
)


def documented_statuses() -> dict[str, frozenset[int]]:
    """Each error code's HTTP statuses, read from the "Error codes" table of
    docs/api/envelope.md (``4xx`` is every 4xx status)."""
    text = (ROOT / "docs" / "api" / "envelope.md").read_text()
    table = text.split("### Error codes", 1)[1].split("\n\n| code |", 1)[1].split("\n\n")[0]
    statuses: dict[str, frozenset[int]] = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        code, http = cells[0].strip("`"), cells[1]
        found = {int(n) for n in re.findall(r"\b[1-5]\d\d\b", http)}
        if "4xx" in http:
            found |= set(range(400, 500))
        statuses[code] = frozenset(found)
    return statuses


DOCUMENTED = documented_statuses()


def test_the_error_code_table_is_read_whole() -> None:
    from gateway.envelope import ErrorCode

    assert set(DOCUMENTED) == {code.value for code in ErrorCode}
    assert DOCUMENTED["INVALID_PAYLOAD"] == {400, 404, 405, 408, 413, 415}
    assert DOCUMENTED["UPSTREAM_REJECTED"] >= {404, 502}


# -- the sidecar under test ---------------------------------------------------------------


async def _upstream_answer(req: web.Request) -> web.StreamResponse:
    """The fake upstream answers by the last path segment: ok, eNNN (that status), text."""
    last = req.path.rsplit("/", 1)[-1]
    if last.startswith("e") and last[1:].isdigit():
        return web.json_response({"error": {"message": "fuzz"}}, status=int(last[1:]))
    if last == "text":
        return web.Response(text="plain text, not JSON")
    return web.json_response({"ok": True, "usage": {"prompt_tokens": 1, "completion_tokens": 2}})


ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def _policy(up: FakeUpstream) -> Any:
    retry = {"max_retries": 1, "backoff_base_s": 0.001, "backoff_max_s": 0.002}
    # The breaker opens now and then (its answer is covered too), and closes soon after.
    breaker = {"fail_max": 50, "reset_timeout_s": 0.2}
    return compile_policy(
        {
            "fake-openai": openai_target(up.url, retry=retry),
            "fake-idem": openai_target(
                up.url, retry=retry, idempotency={"methods": ["POST"], "ttl_s": 60}
            ),
            "fake-items": {
                "base_url": up.url,
                "endpoints": [{"path": "/items/*", "methods": ALL_METHODS}],
                "forward_headers": ["x-request-id"],
                "rate_limit_group": "g",
                "retry": retry,
                "circuit_breaker": breaker,
            },
        },
        rate_limit_groups={"g": {"requests_per_second": 100000, "burst": 100000}},
    )


@dataclass
class Figures:
    """What a fuzz run saw, printed at its end (``make fuzz`` shows it)."""

    examples: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    parser_answers: Counter[str] = field(default_factory=Counter)
    non_envelope: int = 0
    unknown: int = 0
    started: float = field(default_factory=time.monotonic)

    def line(self, name: str) -> str:
        return (
            f"\nFUZZ {name}: {self.examples} examples in {time.monotonic() - self.started:.1f} s; "
            f"non-envelope answers {self.non_envelope}, UNKNOWN {self.unknown}; "
            f"answers {dict(sorted(self.answers.items()))}; "
            f"aiohttp's own 400s {dict(sorted(self.parser_answers.items()))}"
        )


@dataclass
class Target:
    listener: Listener
    upstream: FakeUpstream
    session: aiohttp.ClientSession
    figures: Figures


@pytest.fixture
async def target(upstream_factory: Any, request: pytest.FixtureRequest) -> AsyncIterator[Target]:
    up = await upstream_factory(_upstream_answer)
    limits = {"body_timeout_s": 0.2, "keepalive_timeout_s": 1.0, "lingering_time_s": 0.2}
    async with (
        listening(_policy(up), **limits) as lst,
        # A new connection per call: the 1 s idle timeout must not race a pooled one.
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session,
    ):
        target = Target(lst, up, session, Figures())
        yield target
    print(target.figures.line(request.node.name))


def check_envelope_answer(answer: RawAnswer, figures: Figures) -> ExternalCallResponse:
    """The invariant of one JSON answer: the contract, its documented status, no UNKNOWN."""
    if not answer.is_json:
        figures.non_envelope += 1
    response = answer.envelope()
    code = response.error.code if response.error else None
    figures.answers[f"{answer.status} {code or 'success'}"] += 1
    if code == "UNKNOWN":
        figures.unknown += 1
    assert code != "UNKNOWN", response
    if code is None:
        assert response.success is True
        assert answer.status == 200, response
    else:
        assert response.success is False
        assert answer.status in DOCUMENTED[code], (answer.status, response)
        assert response.error is not None
        assert response.error.message
    return response


def check_records(records: list[dict[str, Any]], responses: list[ExternalCallResponse]) -> None:
    """One audit record per JSON answer, in order, saying what the agent got."""
    assert len(records) == len(responses), (records, responses)
    for record, response in zip(records, responses, strict=True):
        assert record["success"] is response.success
        assert record["error_code"] == (response.error.code if response.error else None)


def hits_expected(response: ExternalCallResponse) -> range:
    """How many requests the upstream may have seen for this answer."""
    if response.replayed:
        return range(0, 1)
    if response.error is None:
        return range(1, 2)
    if response.error.code in REFUSALS and response.status_code is None:
        return range(0, 1)  # a refusal forwards nothing
    return range(0, 3)  # at most max_retries + 1 attempts


# -- generated envelopes ------------------------------------------------------------------

_odd_text = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8"),
        st.sampled_from("\x00\x1b\x7f\x85\u2028\u2029\ufeff\r\n\t\u202e\U0001f600"),
    ),
    max_size=40,
)
_json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    _odd_text,
)
_json = st.recursive(
    _json_scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_odd_text, inner, max_size=4),
    max_leaves=12,
)
_wrong = st.one_of(
    _json_scalar,
    st.lists(_json_scalar, max_size=3),
    st.dictionaries(_odd_text, _json_scalar, max_size=3),
)
_huge = st.integers(min_value=1, max_value=300_000).map(lambda n: "a" * n)
_text_like = st.one_of(_odd_text, _huge, st.sampled_from(["", " ", "x" * 257]))

_fields: dict[str, st.SearchStrategy[Any]] = {
    "trace_id": st.one_of(st.just("tr-fuzz"), _text_like, _wrong),
    "correlation_id": st.one_of(st.just("corr-fuzz"), _text_like, _wrong),
    "target_system": st.one_of(
        st.sampled_from(["fake-openai", "fake-idem", "fake-items", "nope", "FAKE-OPENAI"]),
        _text_like,
        _wrong,
    ),
    "endpoint": st.one_of(
        st.sampled_from(
            [
                "/v1/chat/completions",
                "/v1/models/m1",
                "/items/ok",
                "/items/e404",
                "/items/e401",
                "/items/e429",
                "/items/e500",
                "/items/text",
                "//evil.example/x",
                "/items/../secret",
                "/items/%2e%2e",
                "http://169.254.169.254/",
                "/items/a?b=c",
                "/items/a#f",
                "/items/\\x",
                "/items/a\r\nHost: x",
            ]
        ),
        _odd_text.map(lambda t: "/items/" + t),
        _text_like,
        _wrong,
    ),
    "method": st.one_of(st.sampled_from([*ALL_METHODS, "get", "FETCH", "CONNECT", ""]), _wrong),
    "parameters": st.one_of(st.dictionaries(_odd_text, _json, max_size=5), _wrong),
    "api_key_ref": st.one_of(
        st.sampled_from(
            ["env://TEST_OPENAI_KEY", "env://OTHER", "vault://x", "file:///etc/passwd", "sk-1"]
        ),
        st.none(),
        _text_like,
        _wrong,
    ),
    "rate_limit_group": st.one_of(st.sampled_from(["g", "nope"]), st.none(), _text_like, _wrong),
    "timeout": st.one_of(
        st.floats(min_value=0.05, max_value=3), st.sampled_from([0, -1, 601, 1e308]), _wrong
    ),
    "max_retries": st.one_of(st.integers(min_value=-2, max_value=12), _wrong),
    "idempotency_key": st.one_of(st.sampled_from(["k1", "k2"]), st.none(), _text_like, _wrong),
    "protocol_version": st.one_of(st.sampled_from(["1", "2", "1.0"]), _text_like, _wrong),
    "agent_id": st.one_of(st.none(), _text_like, _wrong),
    "headers": st.one_of(
        st.dictionaries(
            st.sampled_from(["x-request-id", "traceparent", "Authorization", "host"]) | _odd_text,
            _odd_text,
            max_size=3,
        ),
        _wrong,
    ),
    "metadata": st.one_of(st.dictionaries(_odd_text, _json, max_size=5), _wrong),
    "body": st.one_of(
        st.fixed_dictionaries(
            {
                "content_type": st.sampled_from(["audio/wav", "text/plain", "a\nb"]) | _odd_text,
                "base64": st.sampled_from(["aGk=", "", "not base64!", "aGk"]) | _odd_text,
            }
        ),
        st.none(),
        _wrong,
    ),
}


def _encode(pairs: list[tuple[str, Any]], ascii_only: bool) -> str:
    """An object of ``pairs`` as JSON text, duplicate keys kept (the last one counts)."""
    return (
        "{"
        + ",".join(
            f"{json.dumps(k, ensure_ascii=ascii_only)}:{json.dumps(v, ensure_ascii=ascii_only)}"
            for k, v in pairs
        )
        + "}"
    )


#: (target, method, endpoint) calls the policy allows.
_VALID_CALLS = [
    ("fake-openai", "POST", "/v1/chat/completions"),
    ("fake-openai", "GET", "/v1/models/m1"),
    ("fake-idem", "POST", "/v1/chat/completions"),
    *[
        ("fake-items", method, f"/items/{last}")
        for method in ALL_METHODS
        for last in ("ok", "ok", "e404", "e401", "e429", "e500", "text")
    ],
]


@st.composite
def envelope_bodies(draw: st.DrawFn) -> bytes:
    """A request body: mostly an envelope near a valid one, sometimes anything."""
    target, method, endpoint = draw(st.sampled_from(_VALID_CALLS))
    base = envelope(
        target_system=target,
        endpoint=endpoint,
        method=method,
        api_key_ref=... if target == "fake-items" else "env://TEST_OPENAI_KEY",
        idempotency_key=draw(st.sampled_from([..., "k1", "k2"])),
    )
    pairs = list(base.items())
    mutations = draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3, 4]))
    fields = draw(
        st.lists(
            st.sampled_from(sorted(_fields)), min_size=mutations, max_size=mutations, unique=True
        )
    )
    for name in fields:
        action = draw(st.sampled_from(["replace", "replace", "delete", "duplicate"]))
        value = draw(_fields[name])
        if action == "delete":
            pairs = [(k, v) for k, v in pairs if k != name]
        elif action == "duplicate":
            pairs.append((name, value))
        else:
            pairs = [(k, v) for k, v in pairs if k != name] + [(name, value)]
    if draw(st.booleans()) and draw(st.booleans()):
        pairs += draw(st.lists(st.tuples(_odd_text, _json), max_size=3))  # unknown fields
    text = _encode(pairs, ascii_only=draw(st.booleans()))
    shape = draw(
        st.sampled_from(
            ["plain"] * 8
            + ["surrogate", "deep", "nan", "bignum", "bom", "utf16", "latin1", "cut", "junk"]
        )
    )
    if shape == "surrogate":  # a lone surrogate escape somewhere a string is
        text = text.replace('"tr-test-0001"', '"tr-\\udc80"').replace('"ping"', '"\\ud800x"')
    elif shape == "deep":
        depth = draw(st.integers(min_value=1, max_value=3000))
        text = text[:-1] + f', "parameters": {{"d": {"[" * depth}{"]" * depth}}}}}'
    elif shape == "nan":
        text = text[:-1] + f', "timeout": {draw(st.sampled_from(["NaN", "Infinity", "-1e999"]))}}}'
    elif shape == "bignum":
        text = text[:-1] + f', "max_retries": {"9" * draw(st.integers(1, 6000))}}}'
    elif shape == "bom":
        return b"\xef\xbb\xbf" + text.encode("utf-8", "surrogatepass")
    elif shape == "utf16":
        return text.encode("utf-16", "surrogatepass")
    elif shape == "latin1":
        return text.encode("latin-1", "replace")
    elif shape == "cut":
        raw = text.encode("utf-8", "surrogatepass")
        return raw[: draw(st.integers(0, max(len(raw) - 1, 0)))]
    elif shape == "junk":
        return draw(st.binary(max_size=200))
    return text.encode("utf-8", "surrogatepass")


@FUZZ
@given(body=envelope_bodies())
async def test_every_envelope_gets_an_envelope_and_one_audit_record(
    target: Target, body: bytes
) -> None:
    target.figures.examples += 1
    up, log = target.upstream, target.listener.log
    hits, lines = up.hits, len(log.lines)
    url = f"http://127.0.0.1:{target.listener.port}/v1/calls"
    async with target.session.post(
        url, data=body, headers={"Content-Type": "application/json"}
    ) as resp:
        raw = RawAnswer(
            resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read()
        )
    response = check_envelope_answer(raw, target.figures)
    check_records(log.records(lines), [response])
    assert up.hits - hits in hits_expected(response), (response, up.seen[hits:])


# -- generated raw HTTP requests ----------------------------------------------------------

ENVELOPES = [
    json.dumps(
        envelope(target_system="fake-items", endpoint="/items/ok", api_key_ref=...)
    ).encode(),
    json.dumps(envelope()).encode(),
    json.dumps(envelope(target_system="nope")).encode(),
]
#: Behind every generated request, on the same connection: a valid call that closes the
#: connection after its answer. If it is answered, it was read as its own request.
CANARY = http_request(
    json.dumps(
        envelope(
            target_system="fake-items", endpoint="/items/canary", correlation_id="canary",
            api_key_ref=...,
        )
    ).encode(),
    ("Connection", "close"),
)  # fmt: skip


def often(draw: st.DrawFn, common: Any, rare: list[Any]) -> Any:
    """``common`` three times in four, else one of ``rare``."""
    return common if draw(st.booleans()) or draw(st.booleans()) else draw(st.sampled_from(rare))


def rarely(draw: st.DrawFn) -> bool:
    """True one time in eight."""
    return draw(st.booleans()) and draw(st.booleans()) and draw(st.booleans())


_CODINGS = ["gzip", "deflate", "GZIP", "br", "zstd", "identity", "x-zip", "gzip, gzip"]
_FRAMINGS = ["chunked", "none", "short", "long", "dup", "conflict", "signed", "both"]
_FRAMINGS += ["bad-chunk", "te-other"]
_ODD_HEADERS = [
    ("Expect", "100-continue"),
    ("Connection", "keep-alive"),
    ("Connection", "close"),
    ("Connection", "upgrade"),
    ("Upgrade", "websocket"),
    ("Content-Type", "text/plain"),
    ("X-Big", "b" * 9000),
    ("X Bad", "v"),
    ("X-Null", "a\x00b"),
    ("Host", "other.example"),
    ("Transfer-Encoding", "chunked"),
]
_ODD_METHODS = ["GET", "PUT", "DELETE", "OPTIONS", "post", "BREW", "PO ST", "CONNECT"]
_ODD_PATHS = ["/v1/calls/", "/V1/calls", "/v1/calls?x=1", "/", "/nope", "//v1/calls"]
_ODD_PATHS += ["/v1/%63alls", "*", "v1/calls", "http://127.0.0.1/v1/calls", "/v1/calls\x00"]
_ODD_PATHS += ["/" + "a" * 9000]


@st.composite
def raw_requests(draw: st.DrawFn) -> list[bytes]:
    """One request as the bytes of one or more writes, the canary (mostly) behind it."""
    body = draw(st.sampled_from(ENVELOPES))
    encoding = None if draw(st.booleans()) else draw(st.sampled_from(_CODINGS))
    if encoding and draw(st.booleans()):  # the body has the coding it claims
        if encoding.lower() == "gzip":
            body = gzip.compress(body)
        elif encoding == "deflate":
            body = zlib.compress(body)
    headers: list[tuple[str, str]] = []
    if encoding:
        headers += [("Content-Encoding", encoding)] * (2 if rarely(draw) else 1)
    framing = often(draw, "length", _FRAMINGS)
    if framing in {"chunked", "bad-chunk", "both"}:
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if b > a]
        payload = chunked(*pieces)
        if framing == "bad-chunk":
            at = draw(st.integers(0, len(payload) - 1))
            junk = draw(st.sampled_from([b"zz", b"\r\n", b"-1", b";"]))
            payload = payload[:at] + junk + payload[at:]
        headers.append(("Transfer-Encoding", "chunked"))
        if framing == "both":
            headers.append(("Content-Length", str(len(payload))))
        body = payload
    elif framing == "te-other":
        te = draw(st.sampled_from(["gzip, chunked", "identity", "chunked, gzip", "xchunked"]))
        headers.append(("Transfer-Encoding", te))
    elif framing != "none":
        length = {
            "short": max(len(body) - draw(st.integers(1, 20)), 0),
            "long": len(body) + draw(st.integers(1, 20)),
        }.get(framing, len(body))
        headers.append(("Content-Length", f"+{length}" if framing == "signed" else str(length)))
        if framing == "dup":
            headers.append(("Content-Length", str(length)))
        if framing == "conflict":
            headers.append(("Content-Length", str(length + 1)))
    if rarely(draw):
        headers += draw(st.lists(st.sampled_from(_ODD_HEADERS), min_size=1, max_size=3))
    if rarely(draw) and rarely(draw):
        headers += [(f"X-H{i}", "v") for i in range(200)]
    method = often(draw, "POST", _ODD_METHODS)
    path = often(draw, "/v1/calls", _ODD_PATHS)
    version = often(draw, "HTTP/1.1", ["HTTP/1.0", "HTTP/2.0", "HTTP/1.2", "HTTP/1"])
    data = http_request(body, *headers, method=method, path=path, version=version, length=False)
    if rarely(draw) and rarely(draw):
        data = data.replace(b"\r\n", b"\n")
    if rarely(draw) and rarely(draw):
        data = draw(st.binary(max_size=64)) + data
    if framing != "long" or not rarely(draw):
        data += CANARY  # else the body waits for bytes that never come: the body timeout
    cuts = sorted(draw(st.lists(st.integers(1, len(data) - 1), max_size=3, unique=True)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


#: What aiohttp's parser (llhttp) says when it answers a request itself: the start of its
#: 400 text. docs/getting-started.md, "Calling the sidecar", lists these inputs; a new one
#: fails the run.
PARSER_REFUSAL_MESSAGES = (
    # the request line
    "Invalid method",
    "Expected space after",
    "Expected HTTP/",
    "Invalid HTTP version",
    "Invalid major version",
    "Invalid minor version",
    "Expected dot",
    "Unexpected space after start line",
    "Bad status line",  # aiohttp's word for a broken start line (junk, bare LF...)
    "Invalid char in url",
    "Invalid characters in url",
    "Unexpected char in url",
    "Unexpected start char in url",
    "*",  # an asterisk-form target (aiohttp's message is the target)
    "http",  # an absolute-form target with CONNECT
    "Received HTTPS traffic on an HTTP port",
    # header lines
    "Got more than N bytes when reading",  # a request or header line over 8190 bytes
    "Too many headers received",  # more than 128 header fields
    "Invalid header",  # a separator in a name, a control character in a value
    "Unexpected whitespace after header value",
    "Duplicate",  # Content-Length twice, or another single-valued header (Host...)
    # framing
    "Content-Length can't be present with Transfer-Encoding",
    "Transfer-Encoding can't be present with Content-Length",
    "Invalid character in Content-Length",  # a sign, a list, not a number
    "Empty Content-Length",
    "Content-Length overflow",
    "Invalid `Transfer-Encoding` header value",
    "Request has invalid `Transfer-Encoding`",  # not a final chunked
    "Invalid character in chunk",  # its size or its extensions
    "Invalid quoted-pair in chunk",
    "Chunk size overflow",
    "Expected LF after",  # a CR not followed by LF: headers, chunk size or data
    "Expected CRLF",
    "Missing expected CR",
    "Missing expected LF",
    "Data after `Connection",  # bytes behind a request that said Connection: close
    # content codings
    "deflate",  # a deflate body that ends before its stream does
    "Can not decode content-encoding",  # br or zstd without their packages
)


def _parser_category(answer: RawAnswer) -> str:
    first = answer.body.decode("utf-8", "replace").split(":")[0].split("\n")[0]
    return re.sub(r"\d+", "N", first)[:60]


@FUZZ
@given(parts=raw_requests())
async def test_raw_http_gets_envelopes_or_the_parsers_400_and_nothing_is_smuggled(
    target: Target, parts: list[bytes]
) -> None:
    target.figures.examples += 1
    up, log = target.upstream, target.listener.log
    hits, lines = up.hits, len(log.lines)
    ex = await exchange(target.listener.port, *parts, answers=1_000, timeout_s=5)
    assert ex.closed  # by the canary's Connection: close, an error, or the idle timeout
    answers = [a for a in ex.answers if a.status >= 200]  # 100 Continue is interim
    responses = []
    for i, answer in enumerate(answers):
        if not answer.is_json:
            # aiohttp's parser answered: a 400 in text, the last thing on the connection.
            assert answer.status == 400, answer
            assert answer.headers.get("content-type", "").startswith("text/plain"), answer
            assert i == len(answers) - 1, answers
            category = _parser_category(answer)
            target.figures.parser_answers[category] += 1
            assert category.startswith(PARSER_REFUSAL_MESSAGES), answer.body
            continue
        responses.append(check_envelope_answer(answer, target.figures))
    check_records(log.records(lines), responses)
    # Nothing reached the upstream but the calls answered: one request per success.
    assert up.hits - hits == sum(1 for r in responses if r.success), (responses, up.seen[hits:])
    seen = [s.path for s in up.seen[hits:]]
    assert seen.count("/items/canary") <= 1
    target.figures.answers["(canary answered)"] += seen.count("/items/canary")
    if any(not a.is_json for a in answers):
        assert "/items/canary" not in seen

"""Per-call work done once and reused: each memo gives what the uncached path
gives, on its fast path and on its fallback (a new value, a long key, a full memo)."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import io
import json
from pathlib import Path
from typing import Any

import pytest

from gateway import tracing
from gateway.audit import AuditLog
from gateway.audit.schema import AUDIT_FIELDS, Fields
from gateway.call import outbound
from gateway.call.bodies import _decode, _finite, _refuse_constant, parse_body
from gateway.envelope import ExternalCallRequest
from gateway.errors import SecretNotFound
from gateway.policy import AuditSpec
from gateway.policy.egress import decide, upstream_url
from gateway.policy.refs import parse_ref
from gateway.secrets import ResolvedSecret, Secret, SecretResolvers
from gateway.secrets.file import FileResolver
from gateway.upstream import OutboundRequest, UpstreamResponse
from tests.conftest import compile_policy, openai_target

# -- the answer's JSON decoder ---------------------------------------------------------


def _stdlib(text: str | bytes) -> Any:
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite)


@pytest.mark.parametrize(
    "text",
    [
        b'{"a": [1, 2.5, -0.0, 1e308, "\\u00e9"], "b": null}',
        '{"a": 1}',
        '{"a": 1}'.encode("utf-16"),  # a BOM: json.loads detects the encoding
        '{"a": 1}'.encode("utf-16-le"),
        '{"a": 1}'.encode("utf-32-be"),
        b'\xef\xbb\xbf{"a": 1}',  # UTF-8 with a BOM, as bytes: accepted
        '\ufeff{"a": 1}',  # a BOM in a str: refused
        b'{"a": NaN}',
        b'{"a": 1e999}',
        b'{"a": -Infinity}',
        b'{"a": 1, "a": 2}',
        b'"\\ud800"',
        b"[1, 2",
        b"\xff\xfe\x00",
    ],
)
def test_the_shared_decoder_reads_as_json_loads_does(text: str | bytes) -> None:
    try:
        expected: Any = ("value", _stdlib(text))
    except (ValueError, UnicodeDecodeError) as exc:
        expected = ("error", type(exc), str(exc))
    try:
        got: Any = ("value", _decode(text))
    except (ValueError, UnicodeDecodeError) as exc:
        got = ("error", type(exc), str(exc))
    assert got == expected


def test_parse_body_still_refuses_what_json_cannot_write_back() -> None:
    assert parse_body("application/json", b'{"n": 1.5}', 200) == ({"n": 1.5}, True)
    data, is_json = parse_body("application/json", b'{"n": NaN}', 200)
    assert not is_json
    assert data == {"content_type": "application/json", "text": '{"n": NaN}'}


# -- the trace context -------------------------------------------------------------------


def _derived(trace_id: str) -> str:
    return hashlib.sha256(trace_id.encode()).hexdigest()[:32]


def test_trace_ids_are_derived_the_same_way_when_remembered() -> None:
    hex_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    for _ in range(2):  # the first call derives and keeps, the second reads the memo
        assert tracing.trace_id_of("agent-run-7") == _derived("agent-run-7")
        assert tracing.trace_id_of(hex_id) == hex_id
        assert tracing.trace_id_of("0" * 32) == _derived("0" * 32)
    assert tracing._known["agent-run-7"] == _derived("agent-run-7")


def test_a_trace_id_that_is_already_a_w3c_one_is_itself_and_not_remembered() -> None:
    hex_id = "4bf92f3577b34da6a3ce929d0e0e4736"  # as the sidecar generates them
    assert tracing.trace_id_of(hex_id) == hex_id
    assert hex_id not in tracing._known
    # Upper-case hex, a trailing line feed (which the pattern's $ would let by): derived.
    for other in (hex_id.upper(), hex_id + "\n", hex_id[:31]):
        assert tracing.trace_id_of(other) == _derived(other)


def test_trace_id_memo_is_bounded_and_skips_long_ids() -> None:
    long_id = "x" * (tracing._MAX_KNOWN_LENGTH + 1)
    assert tracing.trace_id_of(long_id) == _derived(long_id)
    assert long_id not in tracing._known
    for i in range(tracing._MAX_KNOWN + 10):
        assert tracing.trace_id_of(f"run-{i}") == _derived(f"run-{i}")
        assert len(tracing._known) <= tracing._MAX_KNOWN


def test_outbound_headers_without_agent_headers() -> None:
    headers = tracing.outbound_headers("agent-run-7", {})
    version, trace_id, span, flags = headers["traceparent"].split("-")
    assert list(headers) == ["traceparent"]
    assert (version, trace_id, flags) == ("00", _derived("agent-run-7"), "01")
    assert len(span) == 16
    assert span != "0" * 16


def test_outbound_headers_still_continue_an_agents_trace() -> None:
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    headers = tracing.outbound_headers("ignored", {"TraceParent": parent, "tracestate": "a=1"})
    _, trace_id, span, flags = headers["traceparent"].split("-")
    assert (trace_id, flags) == ("4bf92f3577b34da6a3ce929d0e0e4736", "01")
    assert span != "00f067aa0ba902b7"
    assert headers["tracestate"] == "a=1"


# -- the outbound request's credential ---------------------------------------------------


def _envelope(**fields: Any) -> ExternalCallRequest:
    base: dict[str, Any] = {
        "trace_id": "tr-1",
        "correlation_id": "corr-1",
        "target_system": "openai",
        "endpoint": "/v1/chat/completions",
        "method": "POST",
        "parameters": {"model": "m"},
    }
    return ExternalCallRequest.model_validate({**base, **fields})


POLICY = compile_policy({"openai": openai_target("http://127.0.0.1:9")})
TARGET = POLICY.targets["openai"]


def test_credential_reused_for_the_same_secret_and_rebuilt_for_a_new_one() -> None:
    memo = outbound.Credentials()
    first = ResolvedSecret(Secret("sk-first-value-0123456789"))
    cred = memo.of(TARGET, first)
    assert cred is not None
    assert (cred.header, cred.format, cred.secret) == (
        "Authorization",
        "Bearer {secret}",
        first.secret,
    )
    # A cached secret (the same object, here in a new ResolvedSecret): the same credential.
    assert memo.of(TARGET, ResolvedSecret(first.secret, from_cache=True)) is cred
    rotated = ResolvedSecret(Secret("sk-second-value-0123456789"))
    new = memo.of(TARGET, rotated)
    assert new is not cred
    assert new is not None
    assert new.secret is rotated.secret
    # A target compiled again (a reload) gets its own credential.
    again = compile_policy({"openai": openai_target("http://127.0.0.1:9")}).targets["openai"]
    assert memo.of(again, rotated) is not new
    assert memo.of(TARGET, None) is None


def test_with_credential_builds_the_request_with_or_without_one() -> None:
    draft, _ = outbound.build(_envelope(), TARGET, idempotency_key=None, digest=True)
    bare = outbound.with_credential(draft, TARGET, None)
    assert bare.credential is None
    resolved = ResolvedSecret(Secret("sk-third-value-0123456789"))
    carried = outbound.with_credential(draft, TARGET, resolved)
    assert carried.credential is not None
    assert carried.credential.secret is resolved.secret
    assert carried.headers["traceparent"] == draft.headers["traceparent"]
    for name in ("target", "method", "url", "query", "body", "headers", "content_type"):
        assert getattr(carried, name) == getattr(draft, name), name
        assert getattr(bare, name) == getattr(draft, name), name


# -- the upstream URL and the egress decision -------------------------------------------


def test_upstream_url_remembered_per_endpoint() -> None:
    target = compile_policy({"t": openai_target("http://127.0.0.1:9/base")}).targets["t"]
    url = upstream_url(target, "/v1/a b")
    assert str(url) == "http://127.0.0.1:9/base/v1/a%20b"
    assert upstream_url(target, "/v1/a b") is url
    long = "/v1/" + "x" * 300  # agent-chosen and long: built, not kept
    assert str(upstream_url(target, long)) == "http://127.0.0.1:9/base" + long
    assert target.known_url(long) is None
    for i in range(1100):
        assert upstream_url(target, f"/v1/{i}").raw_path == f"/base/v1/{i}"
    assert len(target._urls) <= 1024


def test_decisions_shared_per_reference() -> None:
    spec = openai_target("http://127.0.0.1:9")
    spec["credential"]["allowed_refs"] = ["env://TEST_OPENAI_KEY", "env://OTHER_KEY"]
    target_policy = compile_policy({"openai": spec})
    first = decide(target_policy, _envelope())
    assert decide(target_policy, _envelope(correlation_id="corr-2")) is first
    assert first.api_key_ref == "env://TEST_OPENAI_KEY"
    assert first.ref == parse_ref("env://TEST_OPENAI_KEY")
    other = decide(target_policy, _envelope(api_key_ref="env://OTHER_KEY"))
    assert other is not first
    assert other.ref == parse_ref("env://OTHER_KEY")


# -- the audit record's redaction --------------------------------------------------------


def _written(record: dict[str, Any]) -> dict[str, Any]:
    stream = io.StringIO()
    log = AuditLog(AuditSpec(), stream, agent_id="agent")
    log.call(record)
    line: dict[str, Any] = json.loads(stream.getvalue())
    return line


def _call_record() -> dict[str, Any]:
    record: dict[str, Any] = dict.fromkeys(AUDIT_FIELDS)
    for name in (Fields.TIMESTAMP, Fields.LEVEL, Fields.EVENT, Fields.SIDECAR_ID):
        record.pop(name)  # AuditLog.call sets these
    record[Fields.AUDIT_SCHEMA] = None
    record[Fields.SUCCESS] = True
    record[Fields.METADATA] = {"task": "t", "api_key": "kept-out", "nested": {"token": "x"}}
    record[Fields.WARNINGS] = ["w"]
    return record


def test_a_call_record_has_its_nesting_fields_redacted() -> None:
    line = _written(_call_record())
    assert set(line) == set(AUDIT_FIELDS)
    assert line[Fields.METADATA] == {
        "task": "t",
        "api_key": "[REDACTED]",
        "nested": {"token": "[REDACTED]"},
    }
    assert line[Fields.WARNINGS] == ["w"]


def test_a_record_with_other_keys_is_searched_whole() -> None:
    record = _call_record()
    record["authorization"] = "Bearer sk-should-not-appear"
    record["extra"] = {"password": "p"}
    line = _written(record)
    assert line["authorization"] == "[REDACTED]"
    assert line["extra"] == {"password": "[REDACTED]"}
    assert line[Fields.METADATA]["api_key"] == "[REDACTED]"


# -- the secret's control-character check ------------------------------------------------


class _Fixed:
    """A resolver that returns what it is told (the same object while unchanged)."""

    local = True

    def __init__(self, value: str) -> None:
        self.resolved = ResolvedSecret(Secret(value), from_cache=True)

    async def resolve(self, ref: Any) -> ResolvedSecret:
        return self.resolved

    def invalidate(self, ref: Any) -> None:
        return None

    async def aclose(self) -> None:
        return None


async def test_a_cached_value_passes_and_a_new_bad_one_is_still_refused() -> None:
    fixed = _Fixed("sk-clean-value-0123456789")
    resolvers = SecretResolvers({"env": fixed})  # type: ignore[dict-item]
    ref = parse_ref("env://KEY")
    for _ in range(2):
        assert await resolvers.resolve(ref) is fixed.resolved
    fixed.resolved = ResolvedSecret(Secret("sk-bad\nvalue-0123456789"), from_cache=True)
    with pytest.raises(SecretNotFound) as info:
        await resolvers.resolve(ref)
    assert info.value.details["reason"] == "invalid_value"
    with pytest.raises(SecretNotFound):  # refused every time, not remembered as checked
        await resolvers.resolve(ref)


async def test_a_rewritten_secret_file_is_checked_again(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("sk-file-value-0123456789\n")
    resolvers = SecretResolvers({"file": FileResolver()})
    ref = parse_ref(f"file://{path}")
    for _ in range(2):
        assert (await resolvers.resolve(ref)).secret.reveal() == "sk-file-value-0123456789"
    path.write_text("sk-file\rvalue-0123456789\n")
    with pytest.raises(SecretNotFound) as info:
        await resolvers.resolve(ref)
    assert info.value.details["reason"] == "invalid_value"


# -- the seam types' constructors --------------------------------------------------------


@pytest.mark.parametrize("cls", [OutboundRequest, UpstreamResponse])
def test_seam_constructors_take_the_fields_in_order(cls: type) -> None:
    params = list(inspect.signature(cls.__init__).parameters)[1:]
    assert params == [f.name for f in dataclasses.fields(cls)]


def test_seam_types_stay_frozen_and_replaceable() -> None:
    request = OutboundRequest(TARGET, "GET", TARGET.base_url, None, None)
    assert request.headers == {}
    assert request.credential is None
    assert request.content_type == "application/json"
    assert OutboundRequest(TARGET, "GET", TARGET.base_url, None, None).headers is not (
        request.headers
    )
    posted = dataclasses.replace(request, method="POST", body=b"{}")
    assert (posted.method, posted.body, posted.url) == ("POST", b"{}", request.url)
    answer = UpstreamResponse(200, "OK", {}, None, b"x", 0.5)
    assert (answer.stream, answer.cut) == (None, False)
    assert dataclasses.replace(answer, cut=True).cut is True
    assert answer == UpstreamResponse(200, "OK", {}, None, b"x", 0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        answer.status = 500  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.method = "PUT"  # type: ignore[misc]

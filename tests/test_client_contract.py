"""The agents' client (clients/python, ``egress_client``) against the sidecar's contract.

The client serialises exactly what the sidecar accepts and parses everything it answers:
their JSON Schemas are compared, generated envelopes are judged alike by both models, the
answer of every error class parses into the client's exception for its code, and real
calls go through a real sidecar (success, stream, refusals, retries, trace context).
"""

from __future__ import annotations

import ast
import asyncio
import copy
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import egress_client
import pytest
from aiohttp import web
from egress_client import AsyncEgressClient, ServerSentEvent, bind_ids
from egress_client._core import payload
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway import envelope as sidecar
from gateway.errors import GatewayError, error_response
from gateway.openapi import error_codes
from tests.conftest import compile_policy, openai_target
from tests.test_stream_relay import Streamer
from tests.test_streams import CHAT_USAGE, chat, sse

CLIENT = Path(__file__).resolve().parent.parent / "clients" / "python"


def _strip(schema: Any) -> Any:
    """A schema without its prose (the two models' docstrings differ, by audience)."""
    if isinstance(schema, dict):
        return {k: _strip(v) for k, v in schema.items() if k != "description"}
    if isinstance(schema, list):
        return [_strip(v) for v in schema]
    return schema


def test_the_request_schemas_are_the_same() -> None:
    for mode in ("validation", "serialization"):
        mine = egress_client.ExternalCallRequest.model_json_schema(mode=mode)
        theirs = sidecar.ExternalCallRequest.model_json_schema(mode=mode)
        assert _strip(mine) == _strip(theirs), mode


def test_the_answer_schemas_are_the_same_but_for_codes_newer_than_the_client() -> None:
    mine = _strip(egress_client.ExternalCallResponse.model_json_schema(mode="serialization"))
    theirs = _strip(sidecar.ExternalCallResponse.model_json_schema(mode="serialization"))
    code = mine["$defs"]["ErrorPayload"]["properties"]["code"]
    # The client keeps an unknown code as a string; everything else is the sidecar's.
    assert code == {"anyOf": [{"$ref": "#/$defs/ErrorCode"}, {"type": "string"}], "title": "Code"}
    normalised = copy.deepcopy(mine)
    normalised["$defs"]["ErrorPayload"]["properties"]["code"] = {"$ref": "#/$defs/ErrorCode"}
    assert normalised == theirs
    assert [c.value for c in egress_client.ErrorCode] == [c.value for c in sidecar.ErrorCode]


def test_every_code_of_the_sidecar_has_the_clients_class_and_default_retryable() -> None:
    for code, entry in error_codes().items():
        cls = egress_client.ERROR_CLASSES[code]
        assert cls.default_retryable is entry["retryable"], code


# Valid envelopes, then at most one field set to a value at or past a bound (or of the
# wrong type): both models must draw the line at the same place.
_ok_text = st.text(st.characters(exclude_categories=("Cc", "Cs")), min_size=1, max_size=40)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_valid = st.fixed_dictionaries(
    {
        "trace_id": _ok_text,
        "correlation_id": _ok_text,
        "target_system": _ok_text,
        "endpoint": st.text(min_size=1, max_size=40),
        "method": st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]),
    },
    optional={
        "parameters": st.dictionaries(st.text(max_size=5), _json, max_size=3),
        "api_key_ref": st.none() | _ok_text,
        "rate_limit_group": st.none() | _ok_text,
        "timeout": st.floats(0, 600, exclude_min=True) | st.integers(1, 600),
        "max_retries": st.integers(0, 10),
        "idempotency_key": st.none() | _ok_text,
        "protocol_version": st.text(st.characters(exclude_categories=("Cc", "Cs")), max_size=16),
        "agent_id": st.none() | _ok_text,
        "headers": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
        "metadata": st.dictionaries(st.text(max_size=5), _json, max_size=2),
        "query": st.dictionaries(st.text(max_size=5), _json, max_size=2),
        "body": st.none()
        | st.fixed_dictionaries({"content_type": _ok_text, "base64": st.text(max_size=8)}),
    },
)
_EDGES: list[tuple[str, Any]] = [
    ("timeout", "5"), ("timeout", 0), ("timeout", -1), ("timeout", 600), ("timeout", 600.001),
    ("timeout", True), ("timeout", None), ("max_retries", True), ("max_retries", 2.0),
    ("max_retries", 10), ("max_retries", 11), ("max_retries", -1), ("max_retries", "3"),
    ("trace_id", ""), ("trace_id", "x" * 256), ("trace_id", "x" * 257), ("trace_id", "a\r\nb"),
    ("correlation_id", "\x85"), ("correlation_id", "\x7f"), ("correlation_id", "\xa0"),
    ("target_system", 5), ("method", "get"), ("method", "FETCH"), ("endpoint", ""),
    ("endpoint", "x" * 2049), ("endpoint", "/a\nb"), ("parameters", []), ("parameters", None),
    ("api_key_ref", ""), ("api_key_ref", "x" * 512), ("api_key_ref", "x" * 513),
    ("idempotency_key", "x" * 255), ("idempotency_key", "x" * 256), ("idempotency_key", "k\x00"),
    ("protocol_version", "x" * 17), ("protocol_version", ""), ("protocol_version", 1),
    ("agent_id", ""), ("headers", {"a": 1}), ("headers", {"a": None}), ("metadata", "m"),
    ("max_retires", 1), ("rate_limit_group", ""), ("success", True), ("query", []),
    ("body", {"content_type": "", "base64": ""}), ("body", {"content_type": "a/b"}),
    ("body", {"content_type": "a\nb", "base64": ""}), ("body", "raw"),
    ("body", {"content_type": "a/b", "base64": "", "name": "f"}),
]  # fmt: skip
_envelopes = st.tuples(_valid, st.none() | st.sampled_from(_EDGES)).map(
    lambda pair: pair[0] if pair[1] is None else {**pair[0], pair[1][0]: pair[1][1]}
)


@settings(max_examples=300, deadline=None)
@given(_envelopes)
def test_the_client_accepts_exactly_what_the_sidecar_accepts(doc: dict[str, Any]) -> None:
    raw = json.dumps(doc)
    try:
        theirs = sidecar.ExternalCallRequest.model_validate_json(raw)
    except ValidationError:
        theirs = None
    try:
        mine = egress_client.ExternalCallRequest.model_validate_json(raw)
    except ValidationError:
        assert theirs is None, doc
        return
    assert theirs is not None, doc
    # What the client sends is read back by the sidecar as the same envelope.
    sent = sidecar.ExternalCallRequest.model_validate_json(payload(mine))
    assert sent.model_dump() == theirs.model_dump() == mine.model_dump()


def _classes(root: type[GatewayError]) -> list[type[GatewayError]]:
    return [root, *(c for sub in root.__subclasses__() for c in _classes(sub))]


@pytest.mark.parametrize("cls", _classes(GatewayError), ids=lambda c: c.__name__)
def test_the_answer_of_every_error_class_parses_into_its_exception(cls: type[GatewayError]):
    error = cls(
        "what happened", details={"reason": "r", "n": 1}, retry_after_s=1.5, status_code=418
    )
    answer = error_response(error, latency_ms=2.0, failed_agent="a", trace_id="t")
    mine = egress_client.ExternalCallResponse.model_validate_json(answer.model_dump_json())
    with pytest.raises(egress_client.EgressError) as caught:
        mine.raise_for_error()
    exc = caught.value
    assert type(exc) is egress_client.ERROR_CLASSES[cls.code.value]
    assert exc.code == cls.code.value
    assert (exc.retryable, exc.suggested_retry_after, exc.status_code) == (cls.retryable, 1.5, 418)
    assert exc.details == {"reason": "r", "n": 1}
    assert mine.model_dump(mode="json") == answer.model_dump(mode="json")


def test_the_client_imports_nothing_of_the_sidecar_and_depends_on_httpx_and_pydantic() -> None:
    imported: set[str] = set()
    for path in (CLIENT / "src" / "egress_client").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names} - {"egress_client"}
    assert third_party == {"httpx", "pydantic", "opentelemetry"}  # the last one optional
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    assert [d.split(">")[0] for d in project["dependencies"]] == ["httpx", "pydantic"]
    assert (CLIENT / "src" / "egress_client" / "py.typed").exists()


# -- round trips through a real sidecar ----------------------------------------------------


async def _sidecar(
    upstream_factory, sidecar_factory, handler, agent_id: str = "test-agent", **target: Any
):
    up = await upstream_factory(handler)
    spec = openai_target(up.url, idempotency={"methods": ["POST"]}, **target)
    policy = compile_policy({"fake-openai": spec}, agent_id=agent_id)
    return up, await sidecar_factory(policy)


PARAMS = {"model": "m", "messages": [{"role": "user", "content": "ping"}]}


async def test_a_call_round_trips(upstream_factory, sidecar_factory):
    async def completion(_: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": [], "usage": {"total_tokens": 21}})

    # The client's agent_id is a claim: equal to the sidecar's agent, it is accepted.
    up, sc = await _sidecar(upstream_factory, sidecar_factory, completion, agent_id="planner-7")
    async with AsyncEgressClient(sc.url, agent_id="planner-7") as client:
        with bind_ids(trace_id="tr-client-1"):
            answer = await client.call(
                "fake-openai",
                "/v1/chat/completions",
                "POST",
                PARAMS,
                correlation_id="step-1",
                idempotency_key="key-1",
                metadata={"step": "plan"},
                timeout=5,
            )
    assert answer.raise_for_error() is answer
    assert (answer.tokens_used, answer.trace_id, answer.correlation_id) == (
        21,
        "tr-client-1",
        "step-1",
    )
    [seen] = up.seen
    assert seen.json() == PARAMS
    assert seen.headers["Idempotency-Key"] == "key-1"
    [record] = sc.audit_records()
    assert (record["agent_id"], record["trace_id"], record["metadata"]) == (
        "planner-7",
        "tr-client-1",
        {"step": "plan"},
    )


async def test_an_upload_and_query_items_arrive_as_given(upstream_factory, sidecar_factory):
    async def ok(_: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": []})

    up, sc = await _sidecar(upstream_factory, sidecar_factory, ok)
    audio = b"RIFF\x00\x01\xff\xfe not text"
    async with AsyncEgressClient(sc.url) as client:
        answer = await client.call(
            "fake-openai",
            "/v1/chat/completions",
            "POST",
            body=egress_client.RequestBody.of("audio/wav", audio),
            query={"alt": "sse", "tag": ["a", "b"]},
        )
    assert answer.raise_for_error().success
    [seen] = up.seen
    assert (seen.body, seen.headers["Content-Type"]) == (audio, "audio/wav")
    assert seen.query["alt"] == "sse"


async def test_refusals_parse_into_their_exceptions(upstream_factory, sidecar_factory):
    async def rejected(_: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "bad model"}}, status=422)

    up, sc = await _sidecar(upstream_factory, sidecar_factory, rejected)
    async with AsyncEgressClient(sc.url) as client:
        denied = await client.call("nowhere", "/v1/chat/completions", "POST", PARAMS)
        with pytest.raises(egress_client.PermissionDenied) as caught:
            denied.raise_for_error()
        assert caught.value.details["reason"]
        upstream = await client.call("fake-openai", "/v1/chat/completions", "POST", PARAMS)
        with pytest.raises(egress_client.UpstreamRejected) as rejected_exc:
            upstream.raise_for_error()
        assert (rejected_exc.value.status_code, rejected_exc.value.data) == (
            422,
            {"error": {"message": "bad model"}},
        )
        mismatch = await client.send(
            client.request("fake-openai", "/v1/chat/completions", "POST").model_copy(
                update={"protocol_version": "9"}
            )
        )
        with pytest.raises(egress_client.SchemaMismatch):
            mismatch.raise_for_error()
        # A value JSON cannot carry is refused, not sent changed (as null).
        infinite = await client.call("fake-openai", "/v1/chat/completions", "POST", {"t": 1e999})
        with pytest.raises(egress_client.InvalidPayload) as invalid:
            infinite.raise_for_error()
        assert invalid.value.details["reason"] == "not_finite"
    assert up.hits == 1


async def test_call_with_retries_waits_the_sidecars_hint(upstream_factory, sidecar_factory):
    answers = iter([429, 429, 200])

    async def limited(_: web.Request) -> web.StreamResponse:
        status = next(answers)
        if status == 429:
            return web.json_response(
                {"error": "slow"}, status=429, headers={"retry-after-ms": "30"}
            )
        return web.json_response({"choices": []})

    up, sc = await _sidecar(upstream_factory, sidecar_factory, limited)
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with AsyncEgressClient(sc.url) as client:
        answer = await client.call_with_retries(
            "fake-openai", "/v1/chat/completions", "POST", PARAMS, max_retries=0, deadline_s=10
        )
    assert answer.success is True
    assert loop.time() - started >= 0.06  # the sidecar's suggested_retry_after, twice
    keys = {seen.headers["Idempotency-Key"] for seen in up.seen}
    assert up.hits == 3
    assert len(keys) == 1  # same ids each attempt: the same derived idempotency key
    codes = [r["error_code"] for r in sc.audit_records()]
    assert codes == ["CAPACITY_EXCEEDED", "CAPACITY_EXCEEDED", None]


async def test_a_stream_round_trips_event_by_event(upstream_factory, sidecar_factory):
    head = sse(chat("Hel"))
    streamer = Streamer(head, sse(chat("lo", "stop"), CHAT_USAGE, "[DONE]"))
    _, sc = await _sidecar(upstream_factory, sidecar_factory, streamer)
    events: list[ServerSentEvent] = []
    async with AsyncEgressClient(sc.url) as client:
        params = {**PARAMS, "stream": True}
        async with client.stream("fake-openai", "/v1/chat/completions", "POST", params) as stream:
            async for event in stream:
                if not events:
                    assert not streamer.release.is_set()  # arrived while the rest is held
                    streamer.release.set()
                events.append(event)
    assert [e.json()["choices"][0]["delta"] for e in events[:2]] == [
        {"content": "Hel"},
        {"content": "lo"},
    ]
    assert events[-1].data == "[DONE]"
    final = stream.response
    assert final is not None
    assert (final.success, final.data, final.tokens_used) == (True, None, 17)
    assert sc.audit_records()[0]["stream"] is True


async def test_a_stream_cut_upstream_ends_with_the_sidecars_verdict(
    upstream_factory, sidecar_factory
):
    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse(chat("Hel")))
        await resp.write_eof()
        return resp

    _, sc = await _sidecar(upstream_factory, sidecar_factory, cut)
    async with AsyncEgressClient(sc.url) as client:
        stream = client.stream("fake-openai", "/v1/chat/completions", "POST", PARAMS)
        async with stream:
            final = await stream.final()
    with pytest.raises(egress_client.StreamInterrupted) as caught:
        final.raise_for_error()
    assert caught.value.retryable is True
    assert caught.value.details.get("source") != "client"  # the sidecar's own verdict


async def test_the_trace_context_reaches_the_upstream(upstream_factory, sidecar_factory):
    otel = pytest.importorskip("opentelemetry.trace")
    trace_id, span_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    ctx = otel.SpanContext(trace_id, span_id, is_remote=True, trace_flags=otel.TraceFlags(1))

    async def ok(_: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": []})

    up, sc = await _sidecar(upstream_factory, sidecar_factory, ok)
    async with AsyncEgressClient(sc.url) as client:
        with otel.use_span(otel.NonRecordingSpan(ctx)):
            answer = await client.call("fake-openai", "/v1/chat/completions", "POST", PARAMS)
    assert answer.trace_id == f"{trace_id:032x}"
    parent = up.seen[0].headers["traceparent"]
    version, trace, parent_id, flags = parent.split("-")
    assert (version, trace, flags) == ("00", f"{trace_id:032x}", "01")
    assert parent_id != f"{span_id:016x}"  # the sidecar's own span for the outbound call


# -- the docs' example (docs/api/envelope.md), against the demo's stand-ins -----------------


def _doc_blocks() -> tuple[str, str]:
    text = (CLIENT.parent.parent / "docs" / "api" / "envelope.md").read_text()
    section = text.split("\n## Python client\n", 1)[1].split("\n## ", 1)[0]
    code, after = section.split("```python\n", 1)[1].split("```\n", 1)
    output = after.split("```\n", 1)[1].split("```", 1)[0]  # the plain block after it
    return code, output


def test_the_docs_example_runs_against_the_demo(demo_sidecar: str) -> None:
    """``python -m gateway.demo.serve`` (stand-ins, OpenBao when installed, the sidecar
    with policies/demo.yaml), then the code of docs/api/envelope.md as a separate program."""
    code, expected = _doc_blocks()
    assert "http://127.0.0.1:18080" in code
    run = subprocess.run(
        [sys.executable, "-c", code.replace("http://127.0.0.1:18080", demo_sidecar)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected

"""Traces, end to end: a real sidecar exporting over OTLP/HTTP to a loopback receiver that
decodes the protobuf (``opentelemetry-proto``), as a collector would.

Asserted: one SERVER span per call continuing the agent's trace (its ``traceparent``, or
the trace the envelope's ``trace_id`` names), one CLIENT span per upstream attempt whose
id the upstream received as parent, the rate-limit and secret stages, the GenAI
attributes, and no secret, prompt or completion anywhere in what was exported. A dead
collector neither slows nor fails a call.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from gateway import telemetry
from gateway.telemetry import tracing_settings
from gateway.tracing import trace_id_of
from tests.conftest import (
    FakeUpstream,
    Sidecar,
    compile_policy,
    envelope,
    openai_target,
    wait_for,
)

SECRET = "sk-fake-TEST-0001-NOTREAL"  # conftest's TEST_OPENAI_KEY
PROMPT = "prompt-canary-4d1e"
COMPLETION = "completion-canary-9b2f"
AGENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
AGENT_SPAN = "00f067aa0ba902b7"


@dataclass
class Collector:
    """A loopback OTLP/HTTP traces receiver: every request decoded, its raw bytes kept."""

    server: TestServer | None = None
    raw: list[bytes] = field(default_factory=list)
    spans: list[tuple[dict[str, Any], Span]] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        assert request.content_type == "application/x-protobuf"
        self.raw.append(body)
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                self.spans.extend((resource, s) for s in scope.spans)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def named(self, prefix: str) -> list[Span]:
        return [s for _, s in self.spans if s.name.startswith(prefix)]

    def server_spans(self) -> list[Span]:
        return [s for _, s in self.spans if s.kind == Span.SPAN_KIND_SERVER]

    def client_spans(self) -> list[Span]:
        spans = [s for _, s in self.spans if s.kind == Span.SPAN_KIND_CLIENT]
        return sorted(spans, key=lambda sp: sp.start_time_unix_nano)


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


def attrs(span: Span) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in span.attributes}


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    found = Collector()
    app = web.Application()
    app.router.add_post("/v1/traces", found._traces)
    found.server = TestServer(app, host="127.0.0.1")
    await found.server.start_server()
    yield found
    await found.server.close()


@pytest.fixture
def tracing_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    def setup(endpoint: str) -> None:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # ms: export at once
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "egress-test")
        for name in ("OTEL_TRACES_SAMPLER", "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER"):
            monkeypatch.delenv(name, raising=False)

    return setup


def chat_answer() -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "model": "fake-model-1-2026-01-01",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": COMPLETION}}],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": 5,
            "total_tokens": 17,
            "prompt_tokens_details": {"cached_tokens": 4},
            "completion_tokens_details": {"reasoning_tokens": 2},
        },
    }


async def _sidecar(
    sidecar_factory: Callable[..., Awaitable[Sidecar]], upstream: FakeUpstream, **extra: Any
) -> Sidecar:
    policy = compile_policy(
        {"fake-openai": openai_target(upstream.url, rate_limit_group="llm")},
        rate_limit_groups={"llm": {"requests_per_second": 100, "burst": 10}},
        **extra,
    )
    return await sidecar_factory(policy)


def _traceparent(header: str) -> tuple[str, str]:
    _, trace_id, span_id, _ = header.split("-")
    return trace_id, span_id


async def test_a_call_is_one_server_span_with_a_client_span_per_attempt(
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    collector: Collector,
    tracing_env: Callable[[str], None],
) -> None:
    tracing_env(collector.endpoint)
    answers = iter([web.json_response({"error": {"message": "busy"}}, status=503)])

    async def handler(_: web.Request) -> web.StreamResponse:
        return next(answers, None) or web.json_response(chat_answer())

    upstream = await upstream_factory(handler)
    sidecar = await _sidecar(sidecar_factory, upstream)
    assert sidecar.gateway.pipeline is not None
    assert sidecar.gateway.pipeline.tracer.enabled
    env = envelope(
        parameters={"model": "fake-model-1", "messages": [{"role": "user", "content": PROMPT}]},
        headers={"traceparent": f"00-{AGENT_TRACE}-{AGENT_SPAN}-01", "tracestate": "agent=1"},
    )
    status, answer = await sidecar.call(env)
    assert (status, answer["success"]) == (200, True), answer

    await wait_for(lambda: len(collector.server_spans()) == 1, 10)
    await wait_for(lambda: len(collector.client_spans()) == 2, 10)
    (server,) = collector.server_spans()
    resource = collector.spans[0][0]
    assert resource["service.name"] == "egress-test"

    # The SERVER span continues the agent's trace, under the agent's span.
    assert server.trace_id.hex() == AGENT_TRACE
    assert server.parent_span_id.hex() == AGENT_SPAN
    assert server.name == "chat fake-model-1"
    s = attrs(server)
    assert s["gen_ai.operation.name"] == "chat"
    assert s["gen_ai.provider.name"] == "openai"
    assert s["gen_ai.request.model"] == "fake-model-1"
    assert s["gen_ai.response.model"] == "fake-model-1-2026-01-01"
    assert s["gen_ai.usage.input_tokens"] == 12
    assert s["gen_ai.usage.output_tokens"] == 5
    assert s["gen_ai.usage.cache_read.input_tokens"] == 4
    assert s["gen_ai.usage.reasoning.output_tokens"] == 2
    assert s["http.response.status_code"] == 200
    assert s["egress.target"] == "fake-openai"
    assert s["egress.attempts"] == 2
    assert [v.string_value for v in s["egress.call_chain"].values] == ["test-agent"]
    assert s["egress.call_chain.depth"] == 1
    assert "error.type" not in s

    # One CLIENT span per attempt, children of the SERVER span; the retry is visible and
    # the upstream got each attempt's own span as its parent.
    clients = collector.client_spans()
    assert [c.parent_span_id for c in clients] == [server.span_id] * 2
    assert {c.trace_id.hex() for c in clients} == {AGENT_TRACE}
    first, second = (attrs(c) for c in clients)
    assert first["http.response.status_code"] == 503
    assert first["error.type"] == "503"
    assert "http.request.resend_count" not in first
    assert second["http.response.status_code"] == 200
    assert second["http.request.resend_count"] == 1
    assert second["server.address"] == "127.0.0.1"
    assert second["url.full"] == f"{upstream.url}/v1/chat/completions"
    assert second["gen_ai.request.model"] == "fake-model-1"
    sent = [_traceparent(seen.headers["traceparent"]) for seen in upstream.seen]
    assert sent == [(AGENT_TRACE, c.span_id.hex()) for c in clients]
    assert all(seen.headers["tracestate"] == "agent=1" for seen in upstream.seen)

    # The stages: a rate-limit wait per attempt, one secret resolution.
    waits = collector.named("rate_limit.wait")
    (secret,) = collector.named("secret.resolve")
    assert len(waits) == 2
    assert {w.parent_span_id for w in [*waits, secret]} == {server.span_id}
    assert attrs(waits[0]) == {"egress.rate_limit_group": "llm"}
    assert attrs(secret) == {"egress.secret.scheme": "env"}
    assert all(sp.kind == Span.SPAN_KIND_INTERNAL for sp in [*waits, secret])

    # Nothing of the prompt, the completion or the secret left the sidecar.
    exported = b"".join(collector.raw)
    for canary in (SECRET, PROMPT, COMPLETION, "TEST_OPENAI_KEY"):
        assert canary.encode() not in exported
    await sidecar.gateway.aclose()


async def test_a_call_that_failed_over_has_a_client_span_per_attempt_of_each_option(
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    collector: Collector,
    tracing_env: Callable[[str], None],
) -> None:
    tracing_env(collector.endpoint)

    async def busy(_: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "busy"}}, status=503)

    async def answers(_: web.Request) -> web.StreamResponse:
        return web.json_response(chat_answer())

    primary = await upstream_factory(busy)
    backup = await upstream_factory(answers)
    first = openai_target(primary.url, fallbacks=[{"target": "backup", "model": "backup-model"}])
    first["retry"] = {**first["retry"], "max_retries": 1}
    sidecar = await sidecar_factory(
        compile_policy({"fake-openai": first, "backup": openai_target(backup.url)})
    )
    env = envelope(
        parameters={"model": "fake-model-1", "messages": [{"role": "user", "content": PROMPT}]},
        max_retries=1,
    )
    status, answer = await sidecar.call(env)
    assert (status, answer["served_by"]) == (200, {"target": "backup", "model": "backup-model"})

    await wait_for(lambda: len(collector.server_spans()) == 1, 10)
    await wait_for(lambda: len(collector.client_spans()) == 3, 10)
    (server,) = collector.server_spans()
    clients = collector.client_spans()
    assert [c.parent_span_id for c in clients] == [server.span_id] * 3  # under the call's
    seen = [
        (
            a["egress.target"],
            a["gen_ai.request.model"],
            a["http.response.status_code"],
            a.get("error.type"),
        )
        for a in map(attrs, clients)
    ]
    assert seen == [
        ("fake-openai", "fake-model-1", 503, "503"),
        ("fake-openai", "fake-model-1", 503, "503"),
        ("backup", "backup-model", 200, None),
    ]
    assert [c.name for c in clients] == ["chat fake-model-1"] * 2 + ["chat backup-model"]
    assert attrs(clients[2])["url.full"] == f"{backup.url}/v1/chat/completions"
    # Each upstream got its own attempt's span as its parent.
    sent = [_traceparent(s.headers["traceparent"])[1] for s in [*primary.seen, *backup.seen]]
    assert sent == [c.span_id.hex() for c in clients]
    assert attrs(server)["egress.attempts"] == 3
    await sidecar.gateway.aclose()


async def test_without_a_traceparent_the_trace_is_the_one_trace_id_names(
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    collector: Collector,
    tracing_env: Callable[[str], None],
) -> None:
    tracing_env(collector.endpoint)

    async def refuse(_: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "no", "type": "invalid"}}, status=400)

    upstream = await upstream_factory(refuse)
    sidecar = await _sidecar(sidecar_factory, upstream)
    status, answer = await sidecar.call(envelope(trace_id="agent-run-42"))
    assert status == 400
    assert answer["error"]["code"] == "UPSTREAM_REJECTED"
    status, _ = await sidecar.call(envelope(target_system="nowhere"))
    assert status == 403

    await wait_for(lambda: len(collector.server_spans()) == 2, 10)
    rejected, denied = sorted(collector.server_spans(), key=lambda sp: sp.start_time_unix_nano)
    assert rejected.trace_id.hex() == trace_id_of("agent-run-42")
    assert rejected.parent_span_id == b""  # a root: the agent sent no span to hang under
    assert rejected.status.code == rejected.status.STATUS_CODE_ERROR
    assert attrs(rejected)["error.type"] == "UPSTREAM_REJECTED"
    assert attrs(rejected)["egress.upstream.status_code"] == 400
    (client,) = collector.client_spans()
    assert attrs(client)["error.type"] == "400"
    assert upstream.seen[0].headers["traceparent"].split("-")[2] == client.span_id.hex()
    # A target the policy does not know: no GenAI attributes, no target, one span.
    assert denied.name == "egress denied"  # named by its decision: no target was known
    assert attrs(denied)["error.type"] == "PERMISSION_DENIED"
    assert not [k for k in attrs(denied) if k.startswith("gen_ai.") or k == "egress.target"]
    await sidecar.gateway.aclose()


async def test_a_shadow_denial_and_an_invalid_call_say_so_in_their_spans(
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    collector: Collector,
    tracing_env: Callable[[str], None],
) -> None:
    tracing_env(collector.endpoint)

    async def answer(_: web.Request) -> web.StreamResponse:
        return web.json_response(chat_answer())

    upstream = await upstream_factory(answer)
    sidecar = await _sidecar(
        sidecar_factory,
        upstream,
        prices={"fake-model-1": {"input_usd_per_mtok": 1000.0, "output_usd_per_mtok": 1000.0}},
        budgets={"tiny": {"limit_usd": 0.001, "window": "daily", "mode": "shadow",
                          "max_output_tokens": 16}},
    )  # fmt: skip
    status, _ = await sidecar.call(envelope())
    assert status == 200  # a shadow rule never refuses
    status, _ = await sidecar.call(envelope(timeout="5"))  # "5" is not a number
    assert status == 400

    await wait_for(lambda: len(collector.server_spans()) == 2, 10)
    shadowed, invalid = sorted(collector.server_spans(), key=lambda sp: sp.start_time_unix_nano)
    assert attrs(shadowed)["egress.decision"] == "shadow_denied"
    rules = attrs(shadowed)["egress.shadow_denied"]  # an array value
    assert [v.string_value for v in rules.values] == ["budget:tiny"]
    assert invalid.name == "egress invalid"
    assert attrs(invalid)["egress.decision"] == "invalid"
    await sidecar.gateway.aclose()


async def test_a_relayed_stream_records_its_first_chunk_and_response_model(
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    collector: Collector,
    tracing_env: Callable[[str], None],
) -> None:
    tracing_env(collector.endpoint)
    chunks = [
        {"model": "fake-stream-2", "choices": [{"delta": {"content": COMPLETION}}]},
        {"model": "fake-stream-2", "choices": [{"delta": {}, "finish_reason": "stop"}]},
        {
            "model": "fake-stream-2",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        },
    ]

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    upstream = await upstream_factory(stream)
    sidecar = await _sidecar(sidecar_factory, upstream)
    async with sidecar.session.post(
        sidecar.url + "/v1/calls",
        json=envelope(parameters={"model": "fake-stream", "stream": True, "messages": []}),
        headers={"Accept": "text/event-stream"},
    ) as resp:
        body = await resp.read()
    assert COMPLETION.encode() in body
    assert b"event: egress.response" in body

    await wait_for(lambda: len(collector.server_spans()) == 1, 10)
    await wait_for(lambda: len(collector.client_spans()) == 1, 10)
    (server,) = collector.server_spans()
    (client,) = collector.client_spans()
    s, c = attrs(server), attrs(client)
    assert s["gen_ai.response.model"] == "fake-stream-2"
    assert (s["gen_ai.usage.input_tokens"], s["gen_ai.usage.output_tokens"]) == (3, 1)
    assert 0 < s["gen_ai.response.time_to_first_chunk"] < 5
    assert 0 < c["gen_ai.response.time_to_first_chunk"] < 5
    assert [e.name for e in client.events] == ["first_chunk"]
    # The CLIENT span lasts until the stream was closed, inside the SERVER span.
    assert server.start_time_unix_nano <= client.start_time_unix_nano
    assert client.end_time_unix_nano <= server.end_time_unix_nano
    assert COMPLETION.encode() not in b"".join(collector.raw)
    await sidecar.gateway.aclose()


async def test_a_dead_collector_neither_slows_nor_fails_a_call(
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    tracing_env: Callable[[str], None],
) -> None:
    # A port that was just free: nothing listens, every export is refused.
    probe = TestServer(web.Application(), host="127.0.0.1")
    await probe.start_server()
    dead = f"http://127.0.0.1:{probe.port}"
    await probe.close()
    tracing_env(dead)

    async def ok(_: web.Request) -> web.StreamResponse:
        return web.json_response(chat_answer())

    upstream = await upstream_factory(ok)
    sidecar = await _sidecar(sidecar_factory, upstream)
    started = time.monotonic()
    for i in range(20):
        status, answer = await sidecar.call(envelope(correlation_id=f"c-{i}"))
        assert (status, answer["success"]) == (200, True)
    # Generous: 20 loopback calls take tens of ms; an export on the loop would take seconds.
    assert time.monotonic() - started < 5
    assert len(sidecar.audit_records()) == 20
    closing = time.monotonic()
    await sidecar.gateway.aclose()
    assert time.monotonic() - closing < telemetry.otel.CLOSE_TIMEOUT_S + 1.5


def test_tracing_is_off_by_default_and_costs_no_import() -> None:
    code = (
        "import sys, os\n"
        "from gateway.server.runtime import Gateway\n"
        "from gateway import telemetry\n"
        "from gateway.policy import parse_policy, PolicySet\n"
        "p = PolicySet.compile(parse_policy('version: 1\\nagent_id: a\\n', 'p.yaml'))\n"
        "assert telemetry.start(p.policy.telemetry, os.environ) is telemetry.NO_TELEMETRY\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == "[]"


EP = "OTEL_EXPORTER_OTLP_ENDPOINT"
POLICY_EP = {"endpoint": "http://p:4318"}
DEFAULT = ("http://p:4318/v1/traces", "egress-gateway", 1.0)


@pytest.mark.parametrize(
    ("environ", "policy", "expected"),
    [
        ({}, None, None),
        ({}, {}, None),
        ({EP: "http://c:4318"}, None, ("http://c:4318/v1/traces", "egress-gateway", 1.0)),
        ({EP: "http://c:4318/"}, None, ("http://c:4318/v1/traces", "egress-gateway", 1.0)),
        ({EP: "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"}, None,
         ("http://t/x", "egress-gateway", 1.0)),
        ({}, {**POLICY_EP, "sample_ratio": 0.25, "service_name": "planner"},
         ("http://p:4318/v1/traces", "planner", 0.25)),
        ({EP: "http://env:4318", "OTEL_SERVICE_NAME": "svc"}, POLICY_EP,
         ("http://env:4318/v1/traces", "svc", 1.0)),
        ({"OTEL_TRACES_SAMPLER": "always_off"}, {**POLICY_EP, "sample_ratio": 0.5},
         ("http://p:4318/v1/traces", "egress-gateway", None)),
        ({"OTEL_SDK_DISABLED": "true"}, POLICY_EP, None),
        ({"OTEL_TRACES_EXPORTER": "none"}, POLICY_EP, None),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, POLICY_EP, DEFAULT),
        ({}, POLICY_EP, DEFAULT),
    ],
)  # fmt: skip
def test_tracing_settings_environment_wins_over_the_policy(
    environ: dict[str, str], policy: dict[str, Any] | None, expected: tuple[Any, ...] | None
) -> None:
    from gateway.policy.models import TelemetrySpec

    spec = TelemetrySpec.model_validate({"tracing": policy}) if policy is not None else None
    settings = tracing_settings(spec, environ)
    got = (settings.endpoint, settings.service_name, settings.sample_ratio) if settings else None
    assert got == expected


async def test_noop_trace_passes_the_send_through(upstream: FakeUpstream) -> None:
    # Off, the hooks are the plain calls: the stage context does nothing, send is send.
    trace = telemetry.current()
    assert trace is telemetry.NOOP_TRACE
    with trace.span(telemetry.RATE_LIMIT_WAIT, "llm") as stage:
        stage.set("k", 1)
    with pytest.raises(ValueError, match="boom"), trace.span(telemetry.CREDENTIAL_RESOLVE, "env"):
        raise ValueError("boom")
    await asyncio.sleep(0)


def test_without_the_sdk_tracing_stays_off_and_says_so(tmp_path: Path) -> None:
    # An import hook that hides opentelemetry, as in an image built without the extra.
    code = (
        "import sys, io\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'opentelemetry':\n"
        "            raise ImportError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from gateway import audit, telemetry\n"
        "audit.configure_logging(sys.stdout)\n"
        "t = telemetry.start(None, {'OTEL_EXPORTER_OTLP_ENDPOINT': 'http://c:4318'})\n"
        "assert t is telemetry.NO_TELEMETRY\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )  # fmt: skip
    (line,) = [json.loads(x) for x in out.stdout.splitlines() if x.strip()]
    assert line["event"] == "tracing_unavailable"
    assert "otel extra" in line["reason"]

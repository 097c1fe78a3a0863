"""The published contract: ``GET /openapi.json`` and ``docs/openapi.json``.

The document is current, valid OpenAPI 3.1, agrees with the error-code table of
docs/api/envelope.md, is served by both listeners, and every answer of a real sidecar
conforms to it: a set of answers made on purpose (success, stream, each family of refusal
and failure), then schemathesis against a live ``python -m gateway serve`` (bounded examples).
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import schemathesis
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, settings
from jsonschema import Draft202012Validator
from openapi_spec_validator import OpenAPIV31SpecValidator

from gateway.envelope import ErrorCode
from gateway.openapi import build_document, document_bytes
from gateway.server import create_ops_app
from tests.conftest import compile_policy, envelope, openai_target, policy_yaml
from tests.test_streams import CHAT_USAGE, chat, sse

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "docs" / "openapi.json"
DOC = build_document()


def test_the_committed_document_is_current() -> None:
    assert COMMITTED.read_bytes() == document_bytes(), (
        "docs/openapi.json is stale: regenerate it with "
        "`.venv/bin/python -m gateway.openapi > docs/openapi.json`"
    )


def test_the_document_is_valid_openapi_3_1() -> None:
    OpenAPIV31SpecValidator(json.loads(COMMITTED.read_text())).validate()
    assert DOC["openapi"].startswith("3.1.")
    for schema in DOC["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)


def test_it_describes_what_exists_and_nothing_else() -> None:
    assert set(DOC["paths"]) == {"/v1/calls", "/healthz", "/readyz", "/metrics", "/openapi.json"}
    assert not any(path.startswith(("/proxy", "/mcp")) for path in DOC["paths"])  # not built
    call = DOC["paths"]["/v1/calls"]["post"]
    assert set(call["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    schemas = DOC["components"]["schemas"]
    assert schemas["ErrorCode"]["enum"] == [code.value for code in ErrorCode]
    assert schemas["ExternalCallRequest"]["additionalProperties"] is False


def _documented_codes() -> dict[str, tuple[str, str]]:
    text = (ROOT / "docs" / "api" / "envelope.md").read_text()
    section = text.split("### Error codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([A-Z_]+)` \| ([^|]+) \| ([^|]+) \|", section, re.MULTILINE)
    return {code: (http.strip(), retryable.strip()) for code, http, retryable in rows}


def test_every_error_code_has_the_documented_status_and_retryable_flag() -> None:
    documented = _documented_codes()
    codes = DOC["x-error-codes"]
    assert set(codes) == set(documented) == {code.value for code in ErrorCode}
    for code, entry in codes.items():
        http, retryable = documented[code]
        assert retryable.startswith("yes" if entry["retryable"] else "no"), code
        for status in entry["http_status"]:
            upstreams = status.startswith("4") and "4xx" in http  # "the upstream's 4xx"
            assert status in http or upstreams, (code, status, http)
        responses = DOC["paths"]["/v1/calls"]["post"]["responses"]
        for status in entry["http_status"]:
            schema = responses[status]["content"]["application/json"]["schema"]
            assert code in schema["allOf"][1]["properties"]["error"]["properties"]["code"]["enum"]


# -- real answers conform ------------------------------------------------------------------


def _response_schema(path: str, method: str, status: int, content_type: str) -> dict[str, Any]:
    responses = DOC["paths"][path][method]["responses"]
    declared = responses.get(str(status)) or responses.get(f"{status // 100}XX")
    assert declared is not None, f"{method.upper()} {path}: HTTP {status} is not in the document"
    media = content_type.split(";")[0].strip()
    assert media in declared["content"], f"{media} is not declared for HTTP {status}"
    return dict(declared["content"][media]["schema"])


def assert_conforms(path: str, method: str, status: int, content_type: str, body: bytes) -> None:
    schema = _response_schema(path, method, status, content_type)
    if content_type.startswith("application/json"):
        # References resolve against the document's components.
        validator = Draft202012Validator({**schema, "components": DOC["components"]})
        validator.validate(json.loads(body))


def _final_of_stream(raw: bytes) -> dict[str, Any]:
    _, sep, last = raw.rpartition(b"event: egress.response\ndata: ")
    assert sep, raw[-200:]
    return json.loads(last)


async def _answer(session: aiohttp.ClientSession, url: str, body: Any, **headers: str):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers.setdefault("Content-Type", "application/json")
    async with session.post(url + "/v1/calls", data=raw, headers=headers) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


async def test_answers_of_every_kind_conform(upstream_factory, sidecar_factory):
    async def upstream(request: web.Request) -> web.StreamResponse:
        model = (await request.json()).get("model")
        if model == "stream":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(sse(chat("hi", "stop"), CHAT_USAGE, "[DONE]"))
            return resp
        if isinstance(model, str) and model.isdigit():
            return web.json_response({"error": {"message": model}}, status=int(model))
        return web.json_response({"choices": [], "usage": {"total_tokens": 3}})

    up = await upstream_factory(upstream)
    target = openai_target(up.url, idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(
        compile_policy(
            {"fake-openai": target},
            server={"max_request_bytes": 4096},
            rate_limit_groups={"tight": {"requests_per_second": 0.01, "max_queue_s": 0}},
        )
    )

    keys = iter(range(100))

    def env(**kw: Any) -> dict[str, Any]:
        return envelope(idempotency_key=f"k-{next(keys)}", **kw)

    seen: list[tuple[int, str]] = []
    cases: list[tuple[Any, dict[str, str], int]] = [
        (env(), {}, 200),
        (env(parameters={"model": "stream"}), {"Accept": "text/event-stream"}, 200),
        (env(parameters={"model": "404"}, max_retries=0), {}, 404),
        (env(parameters={"model": "409"}, max_retries=0), {}, 409),
        (env(parameters={"model": "503"}, max_retries=0), {}, 502),
        (env(parameters={"model": "429"}, max_retries=0), {}, 429),
        (env(target_system="nowhere"), {}, 403),
        (env(protocol_version="9"), {}, 400),
        (b"{not json", {}, 400),
        (env(metadata={"pad": "x" * 8000}), {}, 413),
        (env(rate_limit_group="tight"), {}, 200),
        (env(rate_limit_group="tight"), {}, 429),
    ]
    for body, headers, expected in cases:
        status, content_type, raw = await _answer(sc.session, sc.url, body, **headers)
        assert status == expected, raw[:300]
        assert_conforms("/v1/calls", "post", status, content_type, raw)
        if content_type.startswith("text/event-stream"):
            final = _final_of_stream(raw)
            schema = {"$ref": "#/components/schemas/ExternalCallResponse"}
            Draft202012Validator({**schema, "components": DOC["components"]}).validate(final)
        seen.append((status, content_type))
    # A key reused for another request: 422.
    first = envelope(idempotency_key="same")
    await _answer(sc.session, sc.url, first)
    status, content_type, raw = await _answer(
        sc.session, sc.url, {**first, "parameters": {"model": "other"}}
    )
    assert status == 422
    assert_conforms("/v1/calls", "post", status, content_type, raw)
    assert ("text/event-stream", 200) in {(c.split(";")[0], s) for s, c in seen}

    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        async with sc.session.get(sc.url + path) as resp:
            assert_conforms(path, "get", resp.status, resp.content_type, await resp.read())


async def test_both_listeners_serve_the_document(sidecar_factory):
    sc = await sidecar_factory(compile_policy({}))
    ops = TestServer(create_ops_app(sc.gateway), host="127.0.0.1")
    await ops.start_server()
    try:
        for url in (sc.url, f"http://127.0.0.1:{ops.port}"):
            async with sc.session.get(url + "/openapi.json") as resp:
                assert resp.status == 200
                assert resp.content_type == "application/json"
                assert await resp.read() == COMMITTED.read_bytes()
        async with sc.session.get(f"http://127.0.0.1:{ops.port}/v1/calls") as resp:
            assert resp.status == 404  # the ops listener does not serve calls
    finally:
        await ops.close()


async def test_a_wrong_method_is_405_with_allow(sidecar_factory):
    sc = await sidecar_factory(compile_policy({}))
    async with sc.session.get(sc.url + "/v1/calls") as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"  # RFC 9110, 15.5.6
        assert (await resp.json())["error"]["code"] == "INVALID_PAYLOAD"


# -- schemathesis against a live sidecar -----------------------------------------------------


@pytest.fixture(scope="module")
def live_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``python -m gateway serve`` on ephemeral ports; its policy's one target points at
    a port where nothing listens (schemathesis's envelopes hardly ever name it)."""
    policy = tmp_path_factory.mktemp("openapi") / "policy.json"
    target = openai_target("http://127.0.0.1:9", retry={"max_retries": 0})
    policy.write_text(policy_yaml({"t": target}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    serve = ["serve", "--policy", str(policy), "--port", "0", "--ops-port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", *serve],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    lines: queue.Queue[bytes] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout

    def read() -> None:
        for line in stdout:
            lines.put(line)
        lines.put(b"")  # the process closed its stdout: it exited

    threading.Thread(target=read, daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=30)
            assert line, f"the sidecar exited with {proc.wait()}"
            record = json.loads(line)
            if record.get("event") == "listening":
                break
        yield {"calls": "http://" + record["calls"], "ops": "http://" + record["ops"]}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stdout.close()


# The committed document (checked current above); the sidecar under test serves the same.
live_schema = schemathesis.openapi.from_dict(json.loads(COMMITTED.read_text()))
# Left out: positive_data_acceptance. A schema-valid envelope may still be refused with
# 400 on purpose: a protocol_version this sidecar does not speak (SCHEMA_MISMATCH), a
# rate_limit_group its policy does not define, control characters, metadata over its
# bounds; whether an envelope is acceptable depends on the policy, not the schema.
_EXCLUDED = [schemathesis.checks.positive_data_acceptance]


@live_schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_schemathesis_finds_no_nonconforming_answer_on_the_calls_listener(case, live_sidecar):
    case.call_and_validate(base_url=live_sidecar["calls"], excluded_checks=_EXCLUDED, timeout=10)


@live_schema.exclude(path="/v1/calls").parametrize()
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_schemathesis_finds_no_nonconforming_answer_on_the_ops_listener(case, live_sidecar):
    case.call_and_validate(base_url=live_sidecar["ops"], excluded_checks=_EXCLUDED, timeout=10)

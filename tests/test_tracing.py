"""W3C Trace Context propagation to the upstream."""

from __future__ import annotations

import hashlib
import re

import pytest

from gateway.tracing import outbound_headers, trace_id_of
from tests.conftest import compile_policy, envelope, openai_target

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
AGENT_PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_trace_id_kept_when_already_w3c():
    assert trace_id_of("4bf92f3577b34da6a3ce929d0e0e4736") == "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize("trace_id", ["tr-test-0001", "0" * 32, "4BF92F3577B34DA6A3CE929D0E0E4736"])
def test_trace_id_derived_otherwise(trace_id):
    assert trace_id_of(trace_id) == hashlib.sha256(trace_id.encode()).hexdigest()[:32]


def test_agent_traceparent_is_continued_with_a_new_parent_id():
    headers = outbound_headers("tr-1", {"TraceParent": AGENT_PARENT, "tracestate": "vendor=x"})
    match = TRACEPARENT.match(headers["traceparent"])
    assert match
    assert match[1] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert match[2] != "00f067aa0ba902b7"
    assert match[3] == "01"
    assert headers["tracestate"] == "vendor=x"


@pytest.mark.parametrize(
    "bad",
    [
        "garbage",
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ],
)
def test_invalid_agent_traceparent_restarts_from_trace_id(bad):
    headers = outbound_headers("tr-1", {"traceparent": bad, "tracestate": "vendor=x"})
    match = TRACEPARENT.match(headers["traceparent"])
    assert match
    assert match[1] == trace_id_of("tr-1")
    assert "tracestate" not in headers  # state of a discarded trace is not passed on


async def test_upstream_receives_traceparent_and_audit_records_it(upstream, sidecar_factory):
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(upstream.url)}))
    assert (await sc.call(envelope()))[0] == 200
    assert (await sc.call(envelope(headers={"traceparent": AGENT_PARENT}, correlation_id="c2")))[
        0
    ] == 200
    first, second = (s.headers["traceparent"] for s in upstream.seen)
    assert TRACEPARENT.match(first)[1] == trace_id_of("tr-test-0001")
    assert TRACEPARENT.match(second)[1] == "4bf92f3577b34da6a3ce929d0e0e4736"
    records = sc.audit_records()
    assert [r["traceparent"] for r in records] == [first, second]

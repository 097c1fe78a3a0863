"""Ids for the envelope: the caller's, the bound ones, the OpenTelemetry span's, or new."""

from __future__ import annotations

import asyncio
import re

import pytest

from egress_client import EgressClient, bind_ids

otel = pytest.importorskip("opentelemetry.trace")

TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
SPAN = 0x00F067AA0BA902B7


def _span(state: str | None = None):
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    trace_state = TraceState.from_header([state]) if state else None
    ctx = SpanContext(
        TRACE, SPAN, is_remote=False, trace_flags=TraceFlags(1), trace_state=trace_state
    )
    return otel.use_span(NonRecordingSpan(ctx))


def _request(**options):
    with EgressClient("http://127.0.0.1:1") as client:
        return client.request("t", "/x", "GET", **options)


def test_without_anything_new_ids_are_made_per_call() -> None:
    a, b = _request(), _request()
    assert re.fullmatch(r"[0-9a-f]{32}", a.trace_id)
    assert re.fullmatch(r"[0-9a-f]{16}", a.correlation_id)
    assert a.trace_id != b.trace_id
    assert "traceparent" not in a.headers


def test_the_span_gives_the_ids_and_the_traceparent() -> None:
    with _span("vendor=abc"):
        request = _request()
    assert request.trace_id == f"{TRACE:032x}"  # the sidecar uses it as the W3C trace-id
    assert request.correlation_id == f"{SPAN:016x}"
    assert request.headers == {
        "traceparent": f"00-{TRACE:032x}-{SPAN:016x}-01",
        "tracestate": "vendor=abc",
    }


def test_bound_ids_beat_the_span_and_the_callers_beat_both() -> None:
    with _span(), bind_ids(trace_id="bound-trace", correlation_id="bound-step"):
        bound = _request()
        given = _request(trace_id="mine", correlation_id="step-9")
        partly = _request(correlation_id="step-10")
    assert (bound.trace_id, bound.correlation_id) == ("bound-trace", "bound-step")
    assert (given.trace_id, given.correlation_id) == ("mine", "step-9")
    assert (partly.trace_id, partly.correlation_id) == ("bound-trace", "step-10")
    # The span's traceparent still goes along: the upstream joins the agent's trace.
    assert bound.headers["traceparent"].startswith(f"00-{TRACE:032x}-")
    after = _request()
    assert after.trace_id not in ("bound-trace", f"{TRACE:032x}")


def test_a_traceparent_the_caller_gives_is_kept() -> None:
    mine = "00-11111111111111111111111111111111-2222222222222222-00"
    with _span():
        request = _request(headers={"Traceparent": mine})
    assert request.headers == {"Traceparent": mine}


async def test_bound_ids_are_per_task() -> None:
    async def step(name: str) -> str:
        with bind_ids(correlation_id=name):
            await asyncio.sleep(0)  # let the other task bind its own meanwhile
            return _request().correlation_id

    with bind_ids(trace_id="one-trace"):
        got = await asyncio.gather(step("a"), step("b"))
        assert _request().trace_id == "one-trace"
    assert got == ["a", "b"]

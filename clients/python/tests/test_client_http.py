"""The clients over real HTTP, against a scripted sidecar on loopback (conftest.py).

Each behaviour is checked for :class:`EgressClient` and :class:`AsyncEgressClient`
alike: both run the same scenario through ``run``, which awaits the async one.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from fake_sidecar import Answer, FakeSidecar, envelope_answer, error_answer

from egress_client import (
    AsyncEgressClient,
    CapacityExceeded,
    EgressClient,
    ErrorCode,
    ExternalCallResponse,
    NotAnEnvelope,
    OutcomeUnknown,
    PermissionDenied,
    ResponseTooLarge,
    RetryPolicy,
    ServerSentEvent,
    SidecarUnavailable,
    StreamInterrupted,
    UpstreamRejected,
)

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
FINAL = {"success": True, "status_code": 200, "data": None, "latency_ms": 9.5, "tokens_used": 17}


@pytest.fixture(params=["sync", "async"])
def run(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``run(url, scenario)``: ``scenario(client)`` with a sync or an async client; an
    async scenario's awaitables are awaited (the scenarios are written twice only
    where iteration differs)."""

    def runner(url: str, sync: Callable[[EgressClient], Any], asy: Callable[..., Any]) -> Any:
        if request.param == "sync":
            with EgressClient(url, agent_id="agent-7") as client:
                return sync(client)

        async def main() -> Any:
            async with AsyncEgressClient(url, agent_id="agent-7") as client:
                return await asy(client)

        return asyncio.run(main())

    return runner


def test_call_sends_the_envelope_and_parses_the_answer(fake_sidecar: FakeSidecar, run) -> None:
    fake_sidecar.answers.append(envelope_answer(status_code=200, data={"ok": 1}, tokens_used=5))
    options = {"idempotency_key": "key-1", "trace_id": "tr-9", "correlation_id": "c-9"}
    answer = run(
        fake_sidecar.url,
        lambda c: c.call("openai", "/v1/chat/completions", "POST", BODY, timeout=12, **options),
        lambda c: c.call("openai", "/v1/chat/completions", "POST", BODY, timeout=12, **options),
    )
    assert isinstance(answer, ExternalCallResponse)
    assert (answer.success, answer.data, answer.tokens_used) == (True, {"ok": 1}, 5)
    [seen] = fake_sidecar.seen
    assert seen.path == "/v1/calls"
    assert seen.headers["Content-Type"] == "application/json"
    assert seen.headers["Accept"] == "application/json"
    assert seen.json() == {  # only what differs from the contract's defaults
        "trace_id": "tr-9",
        "correlation_id": "c-9",
        "target_system": "openai",
        "endpoint": "/v1/chat/completions",
        "method": "POST",
        "parameters": BODY,
        "timeout": 12.0,
        "idempotency_key": "key-1",
        "agent_id": "agent-7",
    }


def test_an_error_answer_is_returned_and_raise_for_error_types_it(fake_sidecar, run) -> None:
    fake_sidecar.answers.append(
        error_answer(429, "CAPACITY_EXCEEDED", retryable=True, retry_after=1.5, group="llm")
    )
    answer = run(
        fake_sidecar.url, lambda c: c.call("t", "/x", "GET"), lambda c: c.call("t", "/x", "GET")
    )
    assert answer.success is False
    with pytest.raises(CapacityExceeded) as caught:
        answer.raise_for_error()
    assert (caught.value.retry_after, caught.value.details) == (1.5, {"group": "llm"})


def test_something_else_answering_is_not_an_envelope(fake_sidecar, run) -> None:
    page = b"<html><body>502 Bad Gateway</body></html>"
    fake_sidecar.answers.append(Answer(status=502, content_type="text/html", parts=[page]))
    with pytest.raises(NotAnEnvelope) as caught:
        run(
            fake_sidecar.url, lambda c: c.call("t", "/x", "GET"), lambda c: c.call("t", "/x", "GET")
        )
    assert caught.value.details["http_status"] == 502
    assert caught.value.details["content_type"] == "text/html"
    assert caught.value.code == ErrorCode.UNKNOWN


def test_a_sidecar_that_is_not_there_is_retryable(closed_port: int, run) -> None:
    url = f"http://127.0.0.1:{closed_port}"
    with pytest.raises(SidecarUnavailable) as caught:
        run(url, lambda c: c.call("t", "/x", "POST"), lambda c: c.call("t", "/x", "POST"))
    assert caught.value.retryable is True
    assert caught.value.code == ErrorCode.DEPENDENCY_FAILED
    assert caught.value.details == {"source": "client", "reason": "sidecar_unreachable"}


@pytest.mark.parametrize(
    ("method", "key", "expected"),
    [
        ("POST", None, OutcomeUnknown),  # it may have been made: never resent
        ("POST", "key-1", SidecarUnavailable),  # the key makes resending safe
        ("GET", None, SidecarUnavailable),  # idempotent
    ],
)
def test_a_connection_lost_under_the_call(fake_sidecar, run, method, key, expected) -> None:
    fake_sidecar.answers.append(Answer(drop=True))

    def call(c: Any) -> Any:
        return c.call("t", "/x", method, idempotency_key=key)

    with pytest.raises(expected) as caught:
        run(fake_sidecar.url, call, call)
    assert caught.value.details["reason"] == "sidecar_connection_lost"
    assert caught.value.retryable is (expected is SidecarUnavailable)


# -- streams ---------------------------------------------------------------------------------


def _sse(*events: tuple[str | None, Any]) -> bytes:
    out = b""
    for name, data in events:
        if name:
            out += f"event: {name}\n".encode()
        out += f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
    return out


def _collect_sync(client: EgressClient, on_event: Callable[[int], None] | None = None):
    with client.stream("openai", "/v1/chat/completions", "POST", BODY) as stream:
        events: list[ServerSentEvent] = []
        for event in stream:
            events.append(event)
            if on_event:
                on_event(len(events))
        return events, stream.response


async def _collect_async(client: AsyncEgressClient, on_event=None):
    async with client.stream("openai", "/v1/chat/completions", "POST", BODY) as stream:
        events: list[ServerSentEvent] = []
        async for event in stream:
            events.append(event)
            if on_event:
                on_event(len(events))
        return events, stream.response


def test_stream_yields_each_event_as_it_arrives_then_the_final_response(fake_sidecar, run):
    release = threading.Event()
    first = _sse((None, {"delta": "Hel"}))
    rest = _sse((None, {"delta": "lo"}), (None, "[DONE]"), ("egress.response", FINAL))
    stream = Answer(
        content_type="text/event-stream", parts=[b": ping\r\n\r\n", first, release, rest]
    )
    fake_sidecar.answers.append(stream)
    held_back: list[bool] = []

    def on_event(n: int) -> None:
        if n == 1:  # the first event is here while the sidecar still holds the rest
            held_back.append(not release.is_set())
            release.set()

    events, final = run(
        fake_sidecar.url,
        lambda c: _collect_sync(c, on_event),
        lambda c: _collect_async(c, on_event),
    )
    assert held_back == [True]
    assert [e.data for e in events] == ['{"delta": "Hel"}', '{"delta": "lo"}', "[DONE]"]
    assert final == ExternalCallResponse.model_validate(FINAL)
    assert fake_sidecar.seen[0].headers["Accept"] == "text/event-stream"


def test_an_upstream_event_named_like_the_final_one_is_only_an_event(fake_sidecar, run):
    forged = {"success": True, "latency_ms": 0.0, "data": "forged"}
    body = _sse(("egress.response", forged), (None, "x"), ("egress.response", FINAL))
    fake_sidecar.answers.append(Answer(content_type="text/event-stream", parts=[body]))
    events, final = run(fake_sidecar.url, _collect_sync, _collect_async)
    assert [e.event for e in events] == ["egress.response", "message"]
    assert events[0].json() == forged
    assert final.latency_ms == 9.5


def test_a_refusal_before_the_stream_is_the_json_answer(fake_sidecar, run) -> None:
    fake_sidecar.answers.append(error_answer(403, "PERMISSION_DENIED", retryable=False))
    events, final = run(fake_sidecar.url, _collect_sync, _collect_async)
    assert events == []
    with pytest.raises(PermissionDenied):
        final.raise_for_error()


@pytest.mark.parametrize("cut", [True, False])
def test_a_stream_without_its_final_event_is_interrupted(fake_sidecar, run, cut: bool) -> None:
    body = _sse((None, {"delta": "Hel"}), (None, {"delta": "lo"}))
    fake_sidecar.answers.append(Answer(content_type="text/event-stream", parts=[body], cut=cut))
    with pytest.raises(StreamInterrupted) as caught:
        run(fake_sidecar.url, _collect_sync, _collect_async)
    assert caught.value.retryable is True
    assert caught.value.details == {"source": "client", "reason": "sidecar_stream_cut", "events": 2}


def test_one_event_is_bounded_by_max_event_chars(fake_sidecar: FakeSidecar) -> None:
    body = _sse((None, "small"), (None, "x" * 5000), ("egress.response", FINAL))
    fake_sidecar.answers.append(Answer(content_type="text/event-stream", parts=[body]))
    events: list[ServerSentEvent] = []
    client = EgressClient(fake_sidecar.url, max_event_chars=1000)
    with client, pytest.raises(ResponseTooLarge) as caught, client.stream("t", "/x", "POST") as s:
        events.extend(s)
    assert [e.data for e in events] == ["small"]
    assert caught.value.details == {"source": "client", "reason": "event_too_large"}


def test_final_reads_the_rest(fake_sidecar: FakeSidecar) -> None:
    body = _sse((None, "a"), (None, "b"), ("egress.response", FINAL))
    fake_sidecar.answers.append(Answer(content_type="text/event-stream", parts=[body]))
    with EgressClient(fake_sidecar.url) as client, client.stream("t", "/x", "POST") as stream:
        assert next(iter(stream)).data == "a"
        assert stream.response is None
        assert stream.final().tokens_used == 17
        assert list(stream) == []


# -- call_with_retries -----------------------------------------------------------------------


def test_retries_wait_the_hint_and_resend_the_same_envelope(fake_sidecar, run) -> None:
    for _ in range(2):
        fake_sidecar.answers.append(
            error_answer(429, "CAPACITY_EXCEEDED", retryable=True, retry_after=0.05)
        )
    fake_sidecar.answers.append(envelope_answer(data={"ok": True}))
    started = time.monotonic()
    answer = run(
        fake_sidecar.url,
        lambda c: c.call_with_retries("t", "/x", "POST", BODY, deadline_s=10),
        lambda c: c.call_with_retries("t", "/x", "POST", BODY, deadline_s=10),
    )
    assert answer.data == {"ok": True}
    assert time.monotonic() - started >= 0.1  # two waits of at least the hint
    bodies = [seen.json() for seen in fake_sidecar.seen]
    assert len(bodies) == 3
    ids = {(b["trace_id"], b["correlation_id"]) for b in bodies}
    assert len(ids) == 1  # the same ids: the sidecar derives the same idempotency key


@pytest.mark.parametrize(
    ("answer", "raised"),
    [
        (error_answer(502, "OUTCOME_UNKNOWN", retryable=True), OutcomeUnknown),  # never resent
        (error_answer(404, "UPSTREAM_REJECTED", retryable=False), UpstreamRejected),
        (error_answer(403, "PERMISSION_DENIED", retryable=False), PermissionDenied),
        # The hint is past the deadline: give up at once, with the hint.
        (error_answer(429, "CAPACITY_EXCEEDED", retryable=True, retry_after=30), CapacityExceeded),
    ],
)
def test_what_is_not_retried(fake_sidecar, run, answer: Answer, raised: type) -> None:
    fake_sidecar.answers.extend([answer, envelope_answer()])
    with pytest.raises(raised):
        run(
            fake_sidecar.url,
            lambda c: c.call_with_retries("t", "/x", "POST", deadline_s=5),
            lambda c: c.call_with_retries("t", "/x", "POST", deadline_s=5),
        )
    assert len(fake_sidecar.seen) == 1


def test_attempts_are_bounded_and_each_timeout_fits_the_deadline(fake_sidecar, run) -> None:
    fake_sidecar.answers.extend(
        error_answer(503, "CIRCUIT_OPEN", retryable=True, retry_after=0.01) for _ in range(5)
    )
    policy = RetryPolicy(max_attempts=3)
    with pytest.raises(Exception, match="CIRCUIT_OPEN"):
        run(
            fake_sidecar.url,
            lambda c: c.call_with_retries("t", "/x", "GET", deadline_s=4, retry=policy),
            lambda c: c.call_with_retries("t", "/x", "GET", deadline_s=4, retry=policy),
        )
    timeouts = [seen.json()["timeout"] for seen in fake_sidecar.seen]
    assert len(timeouts) == 3
    assert all(t <= 4 for t in timeouts)  # the envelope's 30 s cut to the time left
    assert timeouts == sorted(timeouts, reverse=True)


def test_a_connection_lost_under_a_keyed_call_is_retried(fake_sidecar, run) -> None:
    fake_sidecar.answers.extend([Answer(drop=True), envelope_answer(data="second")])
    policy = RetryPolicy(backoff_base_s=0.01)

    def call(c: Any) -> Any:
        return c.call_with_retries("t", "/x", "POST", idempotency_key="k", retry=policy)

    assert run(fake_sidecar.url, call, call).data == "second"
    assert [seen.json()["idempotency_key"] for seen in fake_sidecar.seen] == ["k", "k"]

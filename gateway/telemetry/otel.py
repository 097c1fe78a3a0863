"""The OpenTelemetry SDK side of :mod:`gateway.telemetry` (the only user of opentelemetry).

Imported only when tracing is on. Spans of one call:

* ``SERVER`` span per call (the sidecar serves the agent), continuing the agent's trace:
  the parent is the envelope's ``headers.traceparent`` (W3C Trace Context) when valid,
  else the span is a root in the trace whose id :func:`gateway.tracing.trace_id_of`
  gives the envelope's ``trace_id`` (so one agent transaction is one trace, as the
  outbound ``traceparent`` always said). Named ``{operation} {model}`` for a model call,
  else ``egress {target}`` (``egress {decision}``, e.g. ``egress invalid``, when no target
  was established); it carries the call's outcome (``egress.decision``: ``shadow_denied``
  when a ``mode: shadow`` rule would have refused it) and its GenAI attributes
  (:mod:`gateway.telemetry.genai`).
* ``CLIENT`` span per upstream attempt (retries are one span each, with
  ``http.request.resend_count``); the upstream's ``traceparent`` names it as parent. A
  relayed stream's span lasts until the stream is closed and records the first chunk.
* ``INTERNAL`` spans for the rate-limit wait and the secret resolution.

Export: OTLP/HTTP protobuf (``OTLPSpanExporter``) behind a ``BatchSpanProcessor``, whose
own thread does the export: a call only appends a finished span to a bounded queue
(``OTEL_BSP_MAX_QUEUE_SIZE``, spans dropped when full), so a slow or dead collector never
slows or fails a call. The provider is private to this object (not the global one).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

from opentelemetry import trace as otel_trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import gateway
from gateway.audit import get_logger
from gateway.errors import GatewayError
from gateway.providers import GenAICall
from gateway.record import decision_of
from gateway.telemetry import (
    STAGE_SUBJECTS,
    CallTrace,
    Telemetry,
    TracingSettings,
    _activate,
    _deactivate,
)
from gateway.telemetry import genai as g
from gateway.tracing import TRACE_HEADERS, trace_id_of
from gateway.upstream import TransportError

if TYPE_CHECKING:
    import contextvars

    from gateway.envelope import ExternalCallRequest, ExternalCallResponse
    from gateway.record import CallRecord, LiveCall
    from gateway.upstream import OutboundRequest, Upstream, UpstreamResponse

_log = get_logger("gateway.telemetry")
#: The longest :meth:`OtelTelemetry.aclose` waits for the last export (a dead collector
#: must not hold the pod's termination): what is not sent by then is dropped.
CLOSE_TIMEOUT_S: Final = 2.0
_PROPAGATOR: Final = TraceContextTextMapPropagator()
_ROOT: Final = Context()


class _EnvelopeIds(RandomIdGenerator):
    """Random ids, except the next root span's trace id when one is set (the envelope's).
    Set and used within one synchronous ``start_span`` on the event loop's thread."""

    def __init__(self) -> None:
        self.next_trace_id = 0

    def generate_trace_id(self) -> int:
        trace_id, self.next_trace_id = self.next_trace_id, 0
        return trace_id or super().generate_trace_id()


def _wall_ns(monotonic_s: float) -> int:
    """The wall-clock time in ns of a ``time.monotonic()`` instant in the past."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _error_type(exc: BaseException) -> str:
    """``error.type``: the sidecar's error code, the transport failure's kind, else the
    exception's class name (never its message)."""
    if isinstance(exc, GatewayError):
        return exc.code.value
    if isinstance(exc, TransportError):
        return exc.kind
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return type(exc).__name__


def _fail(span: Span, error_type: str) -> None:
    span.set_attribute(g.ERROR_TYPE, error_type)
    span.set_status(Status(StatusCode.ERROR, error_type))


class _Stage:
    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def set(self, key: str, value: str | int | float | bool) -> None:
        self._span.set_attribute(key, value)


class _TracedStream:
    """An upstream event stream whose attempt span ends when it is closed."""

    __slots__ = ("_first", "_inner", "_open", "_sent_ns", "_span")

    def __init__(self, inner: Any, span: Span, sent_ns: int) -> None:
        self._inner, self._span, self._sent_ns = inner, span, sent_ns
        self._first = self._open = True

    async def read(self) -> bytes:
        try:
            chunk: bytes = await self._inner.read()
        except TransportError as exc:
            _fail(self._span, exc.kind)
            raise
        if self._first and chunk:
            self._first = False
            now = time.time_ns()
            self._span.set_attribute(g.TIME_TO_FIRST_CHUNK, (now - self._sent_ns) / 1e9)
            self._span.add_event("first_chunk", timestamp=now)
        return chunk

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            if self._open:
                self._open = False
                self._span.end()


class OtelCallTrace(CallTrace):
    """The spans of one call (see the module docstring)."""

    __slots__ = ("_attempts", "_call", "_live", "_owner", "_parent", "_span", "_token")

    def __init__(self, owner: OtelTelemetry, live: LiveCall) -> None:
        self._owner = owner
        self._live = live
        self._span: Span | None = None
        self._parent: Context = _ROOT
        self._attempts = 0
        self._call: GenAICall | None = None
        self._token: contextvars.Token[CallTrace] | None = None

    def _server(self) -> Span:
        """The call's SERVER span, started (at the call's start) on first use: its
        parent is known once the envelope has been read."""
        if self._span is not None:
            return self._span
        live, owner = self._live, self._owner
        request = live.request
        parent = _ROOT
        if request is not None:
            carrier = {k.lower(): v for k, v in request.headers.items()}
            carrier = {k: v for k, v in carrier.items() if k in TRACE_HEADERS}
            if carrier:
                parent = _PROPAGATOR.extract(carrier)
            if not otel_trace.get_current_span(parent).get_span_context().is_valid:
                parent = _ROOT
                owner.ids.next_trace_id = int(trace_id_of(request.trace_id), 16)
            self._call = g.request_of(request, live.target)
        span = self._span = owner.tracer.start_span(
            "egress",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=_wall_ns(live.started),
        )
        owner.ids.next_trace_id = 0
        self._parent = otel_trace.set_span_in_context(span, _ROOT)
        return span

    def span(self, name: str, subject: str) -> AbstractContextManager[_Stage]:
        return self._stage(name, subject)

    @contextmanager
    def _stage(self, name: str, subject: str) -> Iterator[_Stage]:
        self._server()
        attributes = {STAGE_SUBJECTS.get(name, "egress.subject"): subject}
        span = self._owner.tracer.start_span(name, context=self._parent, attributes=attributes)
        try:
            yield _Stage(span)
        except BaseException as exc:
            _fail(span, _error_type(exc))
            raise
        finally:
            span.end()

    async def send(
        self,
        upstream: Upstream,
        outbound: OutboundRequest,
        *,
        timeout_s: float,
        stream: bool,
        request: ExternalCallRequest | None = None,
    ) -> UpstreamResponse:
        self._server()
        self._attempts += 1
        call = self._call
        if request is not None and request is not self._live.request:
            # A fallback's attempt (or the request as sent: a pinned model): its own model.
            call = g.request_of(request, outbound.target)
        attrs = g.http_client_attributes(outbound.method, outbound.url, self._attempts)
        attrs.update(g.request_attributes(call))
        attrs["egress.target"] = outbound.target.name
        span = self._owner.tracer.start_span(
            g.span_name(call, outbound.method),
            context=self._parent,
            kind=SpanKind.CLIENT,
            attributes=attrs,
        )
        ids = span.get_span_context()
        headers = dict(outbound.headers)
        headers["traceparent"] = f"00-{ids.trace_id:032x}-{ids.span_id:016x}-{ids.trace_flags:02x}"
        sent_ns = time.time_ns()
        try:
            answer = await upstream.send(
                replace(outbound, headers=headers), timeout_s=timeout_s, stream=stream
            )
        except BaseException as exc:
            _fail(span, _error_type(exc))
            span.end()
            raise
        span.set_attribute("http.response.status_code", answer.status)
        if answer.status >= 400:  # HTTP client spans: a 4xx or 5xx answer is an error
            _fail(span, str(answer.status))
        if answer.stream is None:
            span.end()
            return answer
        return replace(answer, stream=_TracedStream(answer.stream, span, sent_ns))

    def end(self, record: CallRecord, status: int, response: ExternalCallResponse) -> None:
        try:
            self._finish(record, status, response)
        except Exception as exc:  # noqa: BLE001 - tracing must never fail a call
            _log.warning("trace_not_recorded", error=type(exc).__name__)
        finally:
            if self._token is not None:
                _deactivate(self._token)
                self._token = None

    def _finish(self, record: CallRecord, status: int, response: ExternalCallResponse) -> None:
        span = self._server()
        target = record.target.name if record.target is not None else None
        outcome = g.outcome_of(record, response)
        # As the audit record says it (gateway.record.decision_of): allowed, but a mode:
        # shadow rule would have refused it, is shadow_denied.
        decision = decision_of(record)
        # A call refused before its target was known (an invalid envelope) is named by
        # its decision, never "egress " with nothing after it.
        fallback = f"egress {target}" if target else f"egress {decision}"
        span.update_name(g.span_name(outcome.call if outcome else None, fallback))
        attrs = g.outcome_attributes(outcome)
        attrs["http.response.status_code"] = status
        attrs["egress.decision"] = decision
        if record.shadow_denied:
            span.set_attribute("egress.shadow_denied", list(record.shadow_denied))
        attrs["egress.agent_id"] = record.agent_id
        attrs["egress.attempts"] = record.attempts
        if target is not None:
            attrs["egress.target"] = target
        if record.request is not None:
            attrs["egress.correlation_id"] = record.request.correlation_id
        if record.rate_limit_group is not None:
            attrs["egress.rate_limit_group"] = record.rate_limit_group
        if record.chain is not None and record.chain.agents:  # agents calling agents
            span.set_attribute("egress.call_chain", list(record.chain.agents))  # a string array
            attrs["egress.call_chain.depth"] = record.chain.depth
        if response.status_code is not None:
            attrs["egress.upstream.status_code"] = response.status_code
        stream = record.stream
        if stream is not None and stream.first_byte_s is not None:
            attrs[g.TIME_TO_FIRST_CHUNK] = stream.first_byte_s
        error = response.error
        if error is not None:
            attrs["egress.error.code"] = error.code.value
            attrs["egress.error.retryable"] = error.retryable
        span.set_attributes(attrs)
        if error is not None:
            _fail(span, error.code.value)
        span.end()


class OtelTelemetry(Telemetry):
    """Tracing on: a private ``TracerProvider`` exporting over OTLP/HTTP in batches."""

    enabled = True

    def __init__(self, settings: TracingSettings) -> None:
        self.settings = settings
        self.ids = _EnvelopeIds()
        sampler = (
            ParentBased(TraceIdRatioBased(settings.sample_ratio))
            if settings.sample_ratio is not None
            else None  # OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG decide
        )
        resource = Resource.create(
            {"service.name": settings.service_name, "service.version": gateway.__version__}
        )
        self._provider = TracerProvider(resource=resource, sampler=sampler, id_generator=self.ids)
        self._provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.endpoint))
        )
        self.tracer = self._provider.get_tracer("gateway", gateway.__version__)
        self._closed = False

    def begin(self, call: LiveCall) -> CallTrace:
        trace = OtelCallTrace(self, call)
        trace._token = _activate(trace)
        return trace

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export every finished span now (blocking; for tests and shutdown)."""
        return self._provider.force_flush(int(timeout_s * 1000))

    async def aclose(self) -> None:
        """Export what is queued and stop, waiting at most :data:`CLOSE_TIMEOUT_S`."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def wake() -> None:
            if not done.done():
                done.set_result(None)

        def shut() -> None:
            try:
                self._provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    loop.call_soon_threadsafe(wake)

        # A daemon thread, not the default executor, whose threads the interpreter joins
        # at exit: a dead collector must not keep the process alive.
        threading.Thread(target=shut, name="otel-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), CLOSE_TIMEOUT_S)
        except TimeoutError:
            _log.warning("trace_export_abandoned", waited_s=CLOSE_TIMEOUT_S)

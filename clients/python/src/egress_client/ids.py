"""The ids every envelope carries (``trace_id``, ``correlation_id``), found for the caller.

For each id, the first of: the caller's argument; the value bound with :func:`bind_ids`
in the current context (a :class:`contextvars.ContextVar`, so each asyncio task and
thread sees its own); the current OpenTelemetry span (when ``opentelemetry-api`` is
installed and a span is recording: its trace-id, 32 hex digits, which the sidecar uses
as the W3C trace-id as is, and its span-id); a new random id.

With an OpenTelemetry span, the envelope's ``headers`` also get its W3C ``traceparent``
(and ``tracestate``), which the sidecar continues on the outbound call (its
docs/operations.md): the upstream's spans join the agent's trace.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

try:  # optional: only an agent that traces has it
    from opentelemetry import trace as _otel_trace
except ImportError:  # pragma: no cover - exercised where opentelemetry-api is absent
    _otel_trace = None  # type: ignore[assignment]

_TRACE_ID: ContextVar[str | None] = ContextVar("egress_trace_id", default=None)
_CORRELATION_ID: ContextVar[str | None] = ContextVar("egress_correlation_id", default=None)
_TRACE_HEADERS = frozenset({"traceparent", "tracestate"})


@contextlib.contextmanager
def bind_ids(trace_id: str | None = None, correlation_id: str | None = None) -> Iterator[None]:
    """Within the ``with`` block (and tasks started in it), calls that name no ids use
    these. A None leaves the id as it was bound outside."""
    tokens = []
    if trace_id is not None:
        tokens.append((_TRACE_ID, _TRACE_ID.set(trace_id)))
    if correlation_id is not None:
        tokens.append((_CORRELATION_ID, _CORRELATION_ID.set(correlation_id)))
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


@dataclass(frozen=True)
class CallIds:
    """The ids of one call, and the trace headers to add to its envelope."""

    trace_id: str
    correlation_id: str
    trace_headers: dict[str, str]


def _otel_span() -> tuple[str, str, dict[str, str]] | None:
    """(trace-id, span-id, W3C headers) of the current span, or None."""
    if _otel_trace is None:
        return None
    ctx: Any = _otel_trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    trace_id, span_id = f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
    headers = {"traceparent": f"00-{trace_id}-{span_id}-{int(ctx.trace_flags):02x}"}
    state = ctx.trace_state.to_header() if ctx.trace_state else ""
    if state:
        headers["tracestate"] = state
    return trace_id, span_id, headers


def resolve_ids(
    trace_id: str | None, correlation_id: str | None, headers: Mapping[str, str]
) -> CallIds:
    """The ids for one call (the order of the module docstring). ``headers`` are the
    caller's envelope headers: a ``traceparent`` given there is never replaced."""
    trace_id = trace_id or _TRACE_ID.get()
    correlation_id = correlation_id or _CORRELATION_ID.get()
    span = _otel_span()
    trace_headers: dict[str, str] = {}
    if span is not None:
        trace_id = trace_id or span[0]
        correlation_id = correlation_id or span[1]
        if not any(name.lower() in _TRACE_HEADERS for name in headers):
            trace_headers = span[2]
    return CallIds(
        trace_id=trace_id or uuid.uuid4().hex,
        correlation_id=correlation_id or uuid.uuid4().hex[:16],
        trace_headers=trace_headers,
    )

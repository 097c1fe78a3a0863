"""Traces of the sidecar's calls, exported with OpenTelemetry; off unless configured.

The call path sees this small interface only, never an OpenTelemetry type:

* :meth:`Telemetry.begin` (once per call, in ``Pipeline.handle``) gives the call's
  :class:`CallTrace` and makes it :func:`current` in the call's task; its
  :meth:`CallTrace.end` (in the same ``finally`` as the audit record) ends it;
* :meth:`CallTrace.span` wraps a stage (the rate-limit wait, the secret resolution);
* :meth:`CallTrace.send` sends one upstream attempt (a CLIENT span per attempt, whose id
  the upstream gets in ``traceparent``, with the attempt's target and model: a call that
  failed over shows each option's attempts).

Off (the default), :data:`NO_TELEMETRY` hands out :data:`NOOP_TRACE`, whose methods do
nothing and allocate nothing; OpenTelemetry is not even imported (its SDK lives in
:mod:`gateway.telemetry.otel`, imported by :func:`start` only when tracing is on).

On when an OTLP endpoint is configured: the standard variables
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, or ``OTEL_EXPORTER_OTLP_ENDPOINT`` plus
``/v1/traces``) win over the policy's ``telemetry.tracing.endpoint``;
``OTEL_SDK_DISABLED=true`` or an ``OTEL_TRACES_EXPORTER`` without ``otlp`` turn it off.
``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER(_ARG)``,
``OTEL_EXPORTER_OTLP_(TRACES_)HEADERS/TIMEOUT/COMPRESSION`` and ``OTEL_BSP_*`` are read
as the OpenTelemetry specification says (docs/operations.md, "Traces").
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

if TYPE_CHECKING:
    from gateway.envelope import ExternalCallRequest, ExternalCallResponse
    from gateway.policy.models import TelemetrySpec
    from gateway.record import CallRecord, LiveCall
    from gateway.upstream import OutboundRequest, Upstream, UpstreamResponse

#: Span names of the stages (:meth:`CallTrace.span`), and the attribute each names its
#: subject with: the rate-limit group, the secret reference's scheme (never the ref).
RATE_LIMIT_WAIT: Final = "rate_limit.wait"
CREDENTIAL_RESOLVE: Final = "secret.resolve"
STAGE_SUBJECTS: Final = {
    RATE_LIMIT_WAIT: "egress.rate_limit_group",
    CREDENTIAL_RESOLVE: "egress.secret.scheme",
}
TRACES_PATH: Final = "/v1/traces"


class StageSpan(Protocol):
    """What a stage's span takes while it runs: one attribute at a time."""

    def set(self, key: str, value: str | int | float | bool) -> None: ...


class CallTrace:
    """One call's trace. This base class is the no-op (:data:`NOOP_TRACE`)."""

    __slots__ = ()

    def span(self, name: str, subject: str) -> AbstractContextManager[StageSpan]:
        """A child span of the call around a stage: ``name`` is :data:`RATE_LIMIT_WAIT` or
        :data:`CREDENTIAL_RESOLVE`, ``subject`` its group or scheme (:data:`STAGE_SUBJECTS`).
        An exception leaving it is recorded as its ``error.type`` and re-raised."""
        return _NOOP_STAGE

    def send(
        self,
        upstream: Upstream,
        outbound: OutboundRequest,
        *,
        timeout_s: float,
        stream: bool,
        request: ExternalCallRequest | None = None,
    ) -> Awaitable[UpstreamResponse]:
        """``upstream.send(outbound, ...)``, as one CLIENT span of the call, named and
        described by ``request`` (the attempt's: a fallback's target and model; None:
        the call's)."""
        return upstream.send(outbound, timeout_s=timeout_s, stream=stream)

    def end(self, record: CallRecord, status: int, response: ExternalCallResponse) -> None:
        """End the call's span with what the call learned (``record``) and how it was
        answered (``status``, ``response``)."""


class _NoopStage:
    __slots__ = ()

    def __enter__(self) -> _NoopStage:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def set(self, key: str, value: str | int | float | bool) -> None:
        return None


NOOP_TRACE: Final = CallTrace()
_NOOP_STAGE: Final = _NoopStage()
_CURRENT: contextvars.ContextVar[CallTrace] = contextvars.ContextVar(
    "egress_call_trace", default=NOOP_TRACE
)


#: ``current()``: the trace of the call running in this task (:data:`NOOP_TRACE` when
#: off). The context variable's own bound ``get``: no Python frame on the hot path.
current: Final[Callable[[], CallTrace]] = _CURRENT.get


class Telemetry:
    """Hands out call traces. This base class is tracing off (:data:`NO_TELEMETRY`)."""

    enabled = False

    def begin(self, call: LiveCall) -> CallTrace:
        """The trace of ``call`` (read while it runs), made :func:`current` until its end."""
        return NOOP_TRACE

    async def aclose(self) -> None:
        """Export what is left (bounded in time) and stop. Idempotent."""


NO_TELEMETRY: Final = Telemetry()


def _activate(trace: CallTrace) -> contextvars.Token[CallTrace]:
    """Make ``trace`` current (for :mod:`gateway.telemetry.otel`)."""
    return _CURRENT.set(trace)


def _deactivate(token: contextvars.Token[CallTrace]) -> None:
    _CURRENT.reset(token)


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """Where and how spans go: ``endpoint`` the full OTLP/HTTP traces URL; the service
    name; ``sample_ratio`` for new traces, None when ``OTEL_TRACES_SAMPLER`` decides."""

    endpoint: str
    service_name: str
    sample_ratio: float | None


def tracing_settings(
    spec: TelemetrySpec | None, environ: Mapping[str, str]
) -> TracingSettings | None:
    """The tracing settings from the environment and the policy's ``telemetry`` block
    (the environment wins, as the OpenTelemetry specification's variables are meant to),
    or None when tracing is off (pure)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporters = environ.get("OTEL_TRACES_EXPORTER")
    if exporters is not None and "otlp" not in {e.strip() for e in exporters.split(",")}:
        return None
    tracing = spec.tracing if spec is not None else None
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if not endpoint:
        base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or (
            tracing.endpoint if tracing is not None and tracing.endpoint else ""
        )
        if not base:
            return None
        endpoint = base.rstrip("/") + TRACES_PATH
    service = environ.get("OTEL_SERVICE_NAME", "").strip() or (
        tracing.service_name if tracing is not None else "egress-gateway"
    )
    ratio = None
    if not environ.get("OTEL_TRACES_SAMPLER", "").strip():
        ratio = tracing.sample_ratio if tracing is not None else 1.0
    return TracingSettings(endpoint, service, ratio)


def start(spec: TelemetrySpec | None, environ: Mapping[str, str]) -> Telemetry:
    """Tracing as configured: :data:`NO_TELEMETRY` when off, else an exporting
    :class:`Telemetry` (imports the OpenTelemetry SDK; without the ``otel`` extra an
    error line is logged and tracing stays off). Close it with ``aclose``."""
    settings = tracing_settings(spec, environ)
    if settings is None:
        return NO_TELEMETRY
    try:
        from gateway.telemetry.otel import OtelTelemetry
    except ImportError as exc:
        # Observability must not take the data path down: the calls still go, untraced.
        from gateway.audit import get_logger

        get_logger("gateway.telemetry").error(
            "tracing_unavailable",
            reason=f"{exc.name or 'opentelemetry'} is not installed (the otel extra)",
            note="calls are served without traces",
        )
        return NO_TELEMETRY
    return OtelTelemetry(settings)

"""What the sync and async clients share: building the envelope, reading the answer,
translating transport failures, telling the sidecar's final stream event apart (pure)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final, TypedDict

import httpx
from pydantic import ValidationError

from egress_client.errors import (
    EgressError,
    NotAnEnvelope,
    OutcomeUnknown,
    ResponseTooLarge,
    SidecarUnavailable,
    StreamInterrupted,
)
from egress_client.ids import resolve_ids
from egress_client.models import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT_S,
    IDEMPOTENT_METHODS,
    ExternalCallRequest,
    ExternalCallResponse,
    HttpMethod,
    RequestBody,
)
from egress_client.sse import ServerSentEvent

#: The sidecar's calls listener by default (its docs, docs/running.md); the sidecar's own
#: ``egress-gateway call`` reads the same variable.
DEFAULT_BASE_URL: Final = "http://127.0.0.1:8181"
#: Where the sidecar is: the variable the Helm chart sets for the agent, then the older
#: name the CLI used to read (still honoured).
BASE_URL_ENV: Final = "EGRESS_GATEWAY_URL"
LEGACY_BASE_URL_ENV: Final = "GATEWAY_URL"
CALLS_PATH: Final = "/v1/calls"
#: The type of the sidecar's last event on a stream (design: "Streaming to the agent").
FINAL_EVENT: Final = "egress.response"
EVENT_STREAM: Final = "text/event-stream"


class CallOptions(TypedDict, total=False):
    """The envelope's optional fields (the sidecar's docs/api/envelope.md),
    plus the ids, which are found for the caller when not given (:mod:`egress_client.ids`)."""

    api_key_ref: str | None
    rate_limit_group: str | None
    timeout: float
    max_retries: int
    idempotency_key: str | None
    trace_id: str | None
    correlation_id: str | None
    agent_id: str | None
    headers: Mapping[str, str] | None
    metadata: Mapping[str, Any] | None
    query: Mapping[str, Any] | None
    body: RequestBody | None


def base_url(given: str | None) -> str:
    return (
        given
        or os.environ.get(BASE_URL_ENV)
        or os.environ.get(LEGACY_BASE_URL_ENV)
        or DEFAULT_BASE_URL
    ).rstrip("/")


def build_request(
    target: str,
    endpoint: str,
    method: HttpMethod,
    parameters: Mapping[str, Any] | None,
    options: CallOptions,
    *,
    default_agent_id: str | None,
) -> ExternalCallRequest:
    """The envelope for one call; raises pydantic's ``ValidationError`` for a value the
    sidecar would refuse (before anything is sent)."""
    headers = dict(options.get("headers") or {})
    ids = resolve_ids(options.get("trace_id"), options.get("correlation_id"), headers)
    headers.update(ids.trace_headers)
    return ExternalCallRequest(
        trace_id=ids.trace_id,
        correlation_id=ids.correlation_id,
        target_system=target,
        endpoint=endpoint,
        method=method,
        parameters=dict(parameters or {}),
        api_key_ref=options.get("api_key_ref"),
        rate_limit_group=options.get("rate_limit_group"),
        timeout=options.get("timeout", DEFAULT_TIMEOUT_S),
        max_retries=options.get("max_retries", DEFAULT_MAX_RETRIES),
        idempotency_key=options.get("idempotency_key"),
        agent_id=options.get("agent_id", default_agent_id),
        headers=headers,
        metadata=dict(options.get("metadata") or {}),
        query=dict(options.get("query") or {}),
        body=options.get("body"),
    )


def payload(request: ExternalCallRequest) -> bytes:
    """The envelope's JSON: fields left at their defaults are not sent, so that an older
    sidecar never meets a field added after it."""
    return request.model_dump_json(exclude_defaults=True).encode()


def http_headers(*, stream: bool) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "Accept": EVENT_STREAM if stream else "application/json",
    }


def http_timeout(
    request: ExternalCallRequest, *, connect_s: float, margin_s: float
) -> httpx.Timeout:
    # The sidecar answers within the envelope's deadline (AGENT_TIMEOUT at worst); the
    # margin covers its own overhead, so a client timeout means the sidecar is stuck.
    return httpx.Timeout(request.timeout + margin_s, connect=connect_s)


def decode_answer(status: int, content_type: str, body: bytes) -> ExternalCallResponse:
    """The envelope the sidecar answered with; :class:`NotAnEnvelope` when something
    else answered."""
    try:
        return ExternalCallResponse.model_validate_json(body)
    except ValidationError:
        raise NotAnEnvelope(
            f"the answer (HTTP {status}, {content_type or 'no content type'}) is not an "
            "ExternalCallResponse: is the URL the sidecar's calls listener?",
            details={
                "source": "client",
                "reason": "not_an_envelope",
                "http_status": status,
                "content_type": content_type,
                "body_start": body[:200].decode("utf-8", "replace"),
            },
        ) from None


def transport_error(exc: httpx.RequestError, request: ExternalCallRequest) -> EgressError:
    """A failure to talk to the sidecar, as the agent must treat it. Nothing was sent
    (connect or pool failures, or the request not written whole: the sidecar acts only
    on a whole envelope): retryable. Sent but no answer: retryable only for a call safe
    to resend (idempotent method or an idempotency key), else OUTCOME_UNKNOWN."""
    said = f"{type(exc).__name__}: {exc}"[:300]
    never_sent = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)
    never_sent = never_sent or isinstance(exc, httpx.WriteError | httpx.WriteTimeout)
    if never_sent:
        return SidecarUnavailable(
            f"the sidecar could not be reached ({said}); is it running?",
            details={"source": "client", "reason": "sidecar_unreachable"},
        )
    if request.method in IDEMPOTENT_METHODS or request.idempotency_key is not None:
        return SidecarUnavailable(
            f"the connection to the sidecar broke before its answer ({said}); the call is "
            "safe to resend",
            details={"source": "client", "reason": "sidecar_connection_lost"},
        )
    return OutcomeUnknown(
        f"the connection to the sidecar broke before its answer ({said}); the call may "
        "have been made: give it an idempotency_key to make resending safe",
        details={"source": "client", "reason": "sidecar_connection_lost"},
    )


def stream_cut(events: int) -> StreamInterrupted:
    return StreamInterrupted(
        f"the sidecar's stream ended without its {FINAL_EVENT} event after {events} "
        "events: the answer is partial",
        details={"source": "client", "reason": "sidecar_stream_cut", "events": events},
    )


def event_too_large(said: str) -> ResponseTooLarge:
    return ResponseTooLarge(
        f"{said} (the client's max_event_chars): the stream was closed",
        details={"source": "client", "reason": "event_too_large"},
    )


class FinalEvent:
    """Holds back each ``egress.response`` event until the next one arrives: the
    sidecar's is the stream's last event, so one followed by anything is the upstream's
    own (relayed unchanged) and is passed on as an ordinary event."""

    def __init__(self) -> None:
        self.held: ServerSentEvent | None = None
        self.relayed = 0

    def push(self, events: list[ServerSentEvent]) -> list[ServerSentEvent]:
        out: list[ServerSentEvent] = []
        for event in events:
            if self.held is not None:
                out.append(self.held)
                self.held = None
            if event.event == FINAL_EVENT:
                self.held = event
            else:
                out.append(event)
        self.relayed += len(out)
        return out

    def response(self) -> ExternalCallResponse:
        """The final response, once the stream has ended; raises StreamInterrupted when
        it never came and NotAnEnvelope when its data is not an answer."""
        if self.held is None:
            raise stream_cut(self.relayed)
        return decode_answer(200, EVENT_STREAM, self.held.data.encode())

"""The envelope API: ``POST /v1/calls`` (design.md, "The envelope"; docs/api/envelope.md).

The body is an ExternalCallRequest; the answer is always an ExternalCallResponse JSON,
whatever happened, with an HTTP status that mirrors the outcome. With ``Accept:
text/event-stream`` a 2xx event stream is relayed as it arrives (a ``200
text/event-stream`` answer opened at the upstream's first events, the upstream's bytes
as they came), ending with one ``event: egress.response`` whose data is the
ExternalCallResponse (``data`` null: the agent has had the events). The answer is
written by :mod:`gateway.api.http`.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Final, Protocol

from gateway.agents.identity import Identity, identify
from gateway.api import http
from gateway.api.http import Answer, Head, Incoming
from gateway.audit import get_logger
from gateway.call.relay import AGENT_STALLED, Relay
from gateway.envelope import ExternalCallResponse
from gateway.errors import GatewayError
from gateway.fastjson import answer_json

CALLS_PATH: Final = "/v1/calls"
_STREAM_HEAD: Final = Head(
    status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
)
_log = get_logger("gateway.server")


class Runtime(http.Sidecar, Protocol):
    """What the envelope API needs of the running sidecar (:class:`gateway.server.Gateway`)."""

    def rendered_answer(self, response: ExternalCallResponse) -> bytes | None: ...

    async def call(
        self, body: bytes, *, relay: Relay | None = None, identity: Identity | None = None
    ) -> tuple[int, ExternalCallResponse]: ...


def handler(runtime: Runtime) -> http.Handler:
    """The handler of :data:`CALLS_PATH` for ``runtime``."""
    return http.handler(partial(_Exchange, runtime), "handler_error")


def json_answer(status: int, response: ExternalCallResponse, raw: bytes | None = None) -> Answer:
    """``response`` as the JSON answer, with HTTP ``status``; ``raw``: its JSON bytes when
    they were already written (an answer just stored for its idempotency key: the same
    bytes, not a second serialisation)."""
    if raw is None:
        try:
            raw = answer_json(response)
        except ValueError as exc:  # the pipeline rules this out; if not, still an envelope
            _log.error("answer_not_writable", error=str(exc)[:200], trace_id=response.trace_id)
            note = {"content_type": None, "text": "the answer's data could not be written as JSON"}
            raw = answer_json(response.model_copy(update={"data": note}))
    return Answer(status=status, body=raw, content_type="application/json")


def refusal(
    runtime: Runtime,
    exc: GatewayError,
    *,
    started: float,
    method: str,
    path: str,
    audited: bool,
    identity: Identity | None,
) -> Answer:
    """The answer to a request refused before the pipeline (which audits its own
    answers); with ``audited`` it gets its one audit record (the calls listener's), of
    ``identity`` (who called; None: the policy's ``agent_id``)."""
    response = runtime.refused_early(
        exc,
        started=started,
        http_method=method,
        http_path=path,
        audited=audited,
        identity=identity,
    )
    return json_answer(exc.http_status, response)


class _Exchange:
    """One envelope (:class:`gateway.api.http.Exchange`)."""

    __slots__ = ("_incoming", "_runtime", "started", "streams")

    def __init__(self, runtime: Runtime, incoming: Incoming) -> None:
        self._runtime = runtime
        self._incoming = incoming
        self.started = time.monotonic()
        # design.md, "Streaming to the agent"
        self.streams = "text/event-stream" in incoming.headers.get("Accept", "")

    async def call(self, stream: Relay | None) -> tuple[int, ExternalCallResponse]:
        """Read the envelope and run it. Raises InvalidPayload for a body too large, not
        readable or late (:meth:`gateway.api.http.Incoming.read`): refused here, audited."""
        incoming = self._incoming
        runtime = self._runtime
        limit = runtime.policy.policy.server.max_request_bytes
        size = incoming.content_length
        if size is not None and size > limit:
            raise http.too_large(size, limit)
        body = await incoming.read(limit)
        identity = identify(incoming.transport, incoming.headers, runtime.agents)
        return await runtime.call(body, relay=stream, identity=identity)

    def answer(self, status: int, response: ExternalCallResponse) -> Answer:
        return json_answer(status, response, self._runtime.rendered_answer(response))

    def refused(self, exc: GatewayError) -> Answer:
        incoming = self._incoming
        return refusal(
            self._runtime,
            exc,
            started=self.started,
            method=incoming.method,
            path=incoming.raw_path,
            audited=True,
            identity=identify(incoming.transport, incoming.headers, self._runtime.agents),
        )

    def head(self) -> Head:
        return _STREAM_HEAD

    def frame(self, chunk: bytes) -> bytes:
        return chunk  # the upstream's whole events, as they came

    def end(self, status: int, response: ExternalCallResponse) -> bytes | None:
        if response.error is not None and response.error.details.get("reason") == AGENT_STALLED:
            return None  # it reads nothing: the final event would hang
        final = answer_json(response.model_copy(update={"data": None}))
        return b"event: egress.response\ndata: " + final + b"\n\n"

"""Dead letters: calls that failed for good, kept for an operator to replay or discard
(design.md, "Approvals, dead letters and the operator console";
docs/features/approvals.md).

On a target with ``dead_letter: true``, a call is kept when it reached the upstream at
least once and ended with a retryable error (its retries are spent: DEPENDENCY_FAILED,
CAPACITY_EXCEEDED from the upstream, AGENT_TIMEOUT, STREAM_INTERRUPTED...) or with
OUTCOME_UNKNOWN (:func:`keeps`, pure). What is kept: the envelope (the API it came in by,
its ids and idempotency key, the secret *reference* at most: credentials are injected
at send time and never part of it; registered secret values are scrubbed from the
text), the error (code, message, details) and the number of attempts.

This sidecar's dead letters are held in memory, bounded by ``dead_letters.max_count``
and ``max_bytes`` (the oldest dropped first, counted in
``egress_gateway_dead_letters_dropped_total``). A new one is counted in
``egress_gateway_dead_letters_total{target}`` (the chart's alert
``EgressGatewayDeadLetters`` fires on it) and is an audit event (``dead_letter_kept``).

:meth:`DeadLetters.take` hands a dead letter to its replay exactly once (the ops route
runs it through the pipeline as an envelope with the call's idempotency key, so that an
upstream honouring the key never applies it twice); :meth:`DeadLetters.discard` drops
it. Both are audit events with the operator's name.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from gateway import redaction
from gateway.audit import AuditLog
from gateway.envelope import ErrorCode, ErrorPayload, ExternalCallRequest, ExternalCallResponse

#: Headers never kept, whatever a target forwards (credentials, cookies).
_SENSITIVE: Final = frozenset({"authorization", "proxy-authorization", "cookie", "x-api-key"})


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One kept call. ``request``: the envelope as JSON (``api`` ``mcp``: ``parameters``
    hold the JSON-RPC request); ``error``: the answer's ErrorPayload as JSON; times Unix s."""

    id: str
    target: str
    api: str
    agent: str
    trace_id: str
    correlation_id: str
    idempotency_key: str | None
    request: dict[str, Any]
    error: dict[str, Any]
    attempts: int
    created_at: float
    size: int = field(default=0, compare=False)

    def summary(self) -> dict[str, Any]:
        """The dead letter as the ops routes and the console show it."""
        return {
            "id": self.id,
            "target": self.target,
            "api": self.api,
            "agent": self.agent,
            "trace_id": self.trace_id,
            "correlation_id": self.correlation_id,
            "idempotency_key": self.idempotency_key,
            "request": self.request,
            "error": self.error,
            "attempts": self.attempts,
            "created_at": self.created_at,
            "bytes": self.size,
        }

    def replay_envelope(self) -> bytes:
        """The envelope a replay sends: the kept request with its idempotency key."""
        envelope = dict(self.request)
        if self.idempotency_key is not None:
            envelope["idempotency_key"] = self.idempotency_key
        return json.dumps(envelope).encode()


def keeps(error: ErrorPayload, attempts: int, sent: bool) -> bool:
    """Whether a failed call is a dead letter (module docstring): sent at least once, and
    OUTCOME_UNKNOWN, a retryable error, or one whose outcome is unknown (a call the stop
    switch cancelled after sending it: ``details.outcome``)."""
    if attempts == 0 or not sent:
        return False
    if error.code is ErrorCode.OUTCOME_UNKNOWN or error.retryable:
        return True
    return error.details.get("outcome") == "unknown"


def stored_request(request: ExternalCallRequest, api: str) -> dict[str, Any]:
    """The envelope of ``request`` as kept: JSON, no sensitive header, an MCP request's
    body as its JSON-RPC ``parameters`` (the form an envelope to an MCP target takes)."""
    kept = request.model_dump(mode="json", exclude_none=True)
    kept["headers"] = {k: v for k, v in request.headers.items() if k.lower() not in _SENSITIVE}
    body = kept.get("body")
    if api == "mcp" and isinstance(body, dict):
        try:
            kept["parameters"] = json.loads(base64.b64decode(body["base64"]))
            del kept["body"]
        except ValueError:
            pass  # left as bytes: its replay is refused like any MCP envelope with a body
    return json.loads(redaction.scrub(json.dumps(kept)))  # type: ignore[no-any-return]


class DeadLetters:
    """This sidecar's dead letters, oldest first, within ``max_count`` and ``max_bytes``.
    ``on_kept(target)`` and ``on_dropped(count)`` feed the metrics."""

    def __init__(
        self,
        *,
        max_count: int,
        max_bytes: int,
        audit: AuditLog | None = None,
        on_kept: Callable[[str], None] | None = None,
        on_dropped: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._letters: OrderedDict[str, DeadLetter] = OrderedDict()
        self._bytes = 0
        self.max_count, self.max_bytes = max_count, max_bytes
        self.audit = audit
        self._on_kept = on_kept or (lambda _target: None)
        self._on_dropped = on_dropped or (lambda _count: None)
        self._clock = clock

    def update(self, max_count: int, max_bytes: int) -> None:
        """New bounds (a reload); the oldest past them are dropped at once."""
        self.max_count, self.max_bytes = max_count, max_bytes
        self._trim()

    def keep(self, **fields: Any) -> DeadLetter:
        """Keep a dead letter of the :class:`DeadLetter` fields (``id``, ``created_at``
        and ``size`` are set here); returns it."""
        size = len(json.dumps(fields["request"])) + len(json.dumps(fields["error"]))
        letter = DeadLetter(
            id="dl_" + secrets.token_hex(10), created_at=self._clock(), size=size, **fields
        )
        self._letters[letter.id] = letter
        self._bytes += size
        self._on_kept(letter.target)
        self._event("dead_letter_kept", letter, error_code=letter.error.get("code"))
        self._trim()
        return letter

    def after(self, call: Any, response: ExternalCallResponse) -> DeadLetter | None:
        """The pipeline's hook, once per answered call (``call``: its
        :class:`gateway.call.record.CallContext`): keeps the call when its target has
        ``dead_letter: true`` and :func:`keeps` says so; the dead letter, or None."""
        target, request, error = call.target, call.request, response.error
        if target is None or request is None or error is None or not target.spec.dead_letter:
            return None
        log = call.attempt_log
        if call.replayed or not keeps(error, log.attempts, log.sent):
            return None
        return self.keep(
            target=target.name,
            api=call.api,
            agent=call.agent_id,
            trace_id=request.trace_id,
            correlation_id=request.correlation_id,
            idempotency_key=call.idempotency_key,
            request=stored_request(request, call.api),
            error=error.model_dump(mode="json", exclude={"stack_trace"}),
            attempts=log.attempts,
        )

    def _trim(self) -> None:
        dropped = 0
        while self._letters and (
            len(self._letters) > self.max_count or self._bytes > self.max_bytes
        ):
            _, oldest = self._letters.popitem(last=False)
            self._bytes -= oldest.size
            dropped += 1
        if dropped:
            self._on_dropped(dropped)

    def list(self) -> list[DeadLetter]:
        """The dead letters, newest first."""
        return list(reversed(self._letters.values()))

    def get(self, letter_id: str) -> DeadLetter | None:
        """One dead letter, or None."""
        return self._letters.get(letter_id)

    def take(self, letter_id: str, who: str) -> DeadLetter | None:
        """Remove a dead letter to replay it (once: a second take gets None)."""
        letter = self._letters.pop(letter_id, None)
        if letter is not None:
            self._bytes -= letter.size
            self._event("dead_letter_replayed", letter, by=who)
        return letter

    def discard(self, letter_id: str, who: str) -> DeadLetter | None:
        """Drop a dead letter; None when there is none by that id."""
        letter = self._letters.pop(letter_id, None)
        if letter is not None:
            self._bytes -= letter.size
            self._event("dead_letter_discarded", letter, by=who)
        return letter

    def _event(self, name: str, letter: DeadLetter, **extra: Any) -> None:
        if self.audit is not None:
            self.audit.event(
                name,
                dead_letter_id=letter.id,
                target_system=letter.target,
                trace_id=letter.trace_id,
                correlation_id=letter.correlation_id,
                idempotency_key=letter.idempotency_key,
                requesting_agent=letter.agent,
                **extra,
            )

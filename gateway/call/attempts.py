"""The attempts of one call: rate-limit admission, circuit breaker, send, retry.

For each attempt, in order: wait for the rate-limit group (the first attempt reserves
the call's token estimate, retries only a request slot), take a permit from the target's
circuit breaker (CIRCUIT_OPEN at once when it is open or probing), send, record the
outcome on the permit (5xx, 529, timeouts and connection failures count as failures;
4xx do not; an interrupted attempt counts as nothing), read what an error answer says
beyond its status (:func:`gateway.providers.error_hint`: quota errors, ``x-should-retry``)
and the error it makes (:mod:`gateway.call.statuses`), feed the provider's rate-limit
headers back to the group (not those of a quota error), then decide whether to retry
(:mod:`gateway.call.retry`). Every wait fits inside the
call's deadline; when the next one would not, the call ends at once with
``suggested_retry_after``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final

from gateway import telemetry
from gateway.breaker import Permit, TargetBreaker
from gateway.call.bodies import parse_body
from gateway.call.relay import Relay, Relayed, relay_stream
from gateway.call.retry import (
    DONE,
    MAX_RETRY_AFTER_S,
    Outcome,
    RetryBudget,
    next_step,
    parse_retry_after,
    status_retryable,
    transport_retryable,
    unanswered_resendable,
)
from gateway.call.statuses import status_error
from gateway.call.stream import StreamJudge, judge_body
from gateway.envelope import IDEMPOTENT_METHODS, ExternalCallRequest
from gateway.errors import (
    CapacityExceeded,
    DeadlineExceeded,
    DependencyFailed,
    EgressDenied,
    GatewayError,
    OutcomeUnknown,
    PermissionDenied,
)
from gateway.policy import CompiledTarget
from gateway.providers import ErrorHint, error_hint, request_model
from gateway.ratelimit import RateLimitGroup, provider_hold_s
from gateway.upstream import (
    POOL_FULL,
    Credential,
    OutboundRequest,
    TransportError,
    Upstream,
    UpstreamResponse,
)

_new_budget = tuple.__new__

#: Refusals of a redirect (``details.reason``, :func:`gateway.policy.egress.redirect_hop`
#: and :mod:`gateway.upstream.client`): raised after the upstream answered the request.
_REFUSED_REDIRECTS: Final = frozenset(
    {
        "cross_origin_redirect",
        "redirect_outside_allowlist",
        "invalid_redirect_location",
        "too_many_redirects",
    }
)


@dataclass(slots=True)
class AttemptLog:
    """What the attempts learned, for the audit record and metrics."""

    attempts: int = 0
    upstream_latency_s: float | None = None
    response_bytes: int | None = None
    rate_limit_wait_s: float = 0.0
    admitted: bool = False  # the first admission reserved the call's token estimate
    #: An attempt's request may have reached the upstream (answered, or lost after being
    #: sent, or interrupted while sending): what a budget's reservation is kept for.
    sent: bool = False
    #: An attempt may have been billed: answered other than with an error status (a
    #: 2xx, a redirect), or lost or interrupted after it was sent. An attempt answered
    #: 4xx or 5xx is not: the providers do not bill them (what a budget releases).
    billed: bool = False
    warnings: list[str] = field(default_factory=list)
    #: Rate-limit groups in shadow mode that would have refused the call.
    shadow_denied: list[str] = field(default_factory=list)
    #: Set when the answer was relayed as a stream (what was relayed, its verdict, usage).
    relayed: Relayed | None = None
    #: The last attempt's answer as the upstream gave it (status, headers, body), None
    #: when the last attempt got none: what the drop-in routes write back unchanged.
    answer: UpstreamResponse | None = None
    #: Each attempt, for the audit record's ``tried`` (:func:`tried_entry`): kept from
    #: the start when given a list (a call that may fail over), else only once a retry
    #: is decided (a call answered at once pays nothing for it).
    tried: list[dict[str, Any]] | None = None


@dataclass(slots=True)
class Attempts:
    """Runs the attempts of one call. ``refresh_credential`` resolves the secret again
    after an upstream 401 on a cached credential (once per call); it returns None when
    the credential did not come from a cache."""

    upstream: Upstream
    target: CompiledTarget
    request: ExternalCallRequest
    outbound: OutboundRequest
    deadline: float
    has_idempotency_key: bool
    rng: random.Random
    group: RateLimitGroup | None = None
    tokens_reserved: int = 0
    breaker: TargetBreaker | None = None
    refresh_credential: Callable[[], Awaitable[Credential | None]] | None = None
    #: A key pool's next key after a 429 or quota refusal (gateway.call.keys): awaited
    #: with the wait the upstream asked for (seconds; None: none) and whether the key is
    #: spent (quota); its credential and reference name, or None when every key rests.
    next_key: Callable[[float | None, bool], Awaitable[tuple[Credential, str] | None]] | None = None
    #: Where a 2xx event stream goes as it arrives (the agent asked for a stream).
    relay: Relay | None = None
    started: float = 0.0
    max_response_bytes: int = 0
    #: Awaited before resending after an attempt the upstream may have acted on (sent,
    #: its answer lost or cut): books that attempt's cost (a budget's reservation) and
    #: raises to stop the resend (BudgetExceeded).
    before_resend: Callable[[], Awaitable[None]] | None = None
    #: What the agent gets of a relayed stream's whole events (None: all of them as
    #: they came): removes what the sidecar added (gateway.providers.asking_usage).
    rewrite: Callable[[bytes], bytes] | None = None
    #: The drift check of a relayed stream (:attr:`gateway.call.relay.Relayed.gate`):
    #: its events are held until one names a model, and refused by it.
    model_gate: Callable[[str], GatewayError | None] | None = None
    #: Read the model a relayed stream names (the judge's ``model``), for the record.
    watch_model: bool = False
    #: The "send" of a target that is not spoken to over HTTP (a database target's
    #: statement, :meth:`gateway.database.registry.Databases.run`), given the attempt's
    #: timeout in seconds; None: the HTTP request through ``upstream``.
    send: Callable[[float], Awaitable[UpstreamResponse]] | None = None
    log: AttemptLog = field(default_factory=AttemptLog)
    #: The reference name of the key the attempts send with (a key pool's rotation
    #: changes it): the audit record's, never the key.
    key_ref: str | None = None
    #: A 401 made the credential be resolved again (once per call).
    refreshed: bool = field(default=False, init=False)
    #: When the current attempt started (``time.monotonic()``, after its admission)
    #: and the key it was sent with (a rotation changes :attr:`key_ref` before the
    #: attempt is noted).
    began: float = field(default=0.0, init=False)
    began_key: str | None = field(default=None, init=False)

    async def run(self) -> UpstreamResponse:
        """The upstream's final 2xx answer. Raises a GatewayError otherwise: the attempts
        run until :func:`gateway.call.retry.next_step` says stop, which is the one end."""
        budget: RetryBudget | None = None  # made once an attempt fails (most calls: never)
        retry_number = 0
        log = self.log
        while True:
            made = log.attempts
            try:
                outcome, answer = await self._attempt()
            except GatewayError as exc:  # an open breaker, a refused redirect...
                if log.tried is not None:
                    self._note(Outcome(exc), None, sent=log.attempts > made)
                raise
            if outcome is DONE:  # next_step's stop: no budget, no step to decide
                assert answer is not None
                if log.tried is not None:  # a call that may fail over: noted as next_step's
                    log.tried.append(self._answered_entry(answer))
                return answer
            if budget is None:
                retry = self.target.spec.retry
                # tuple.__new__: the named tuple without its Python-level __new__
                budget = _new_budget(
                    RetryBudget,
                    (
                        min(self.request.max_retries, retry.max_retries),
                        self.deadline,
                        retry.backoff_base_s,
                        retry.backoff_max_s,
                    ),
                )
            step = next_step(outcome, retry_number, budget, time.monotonic(), self.rng)
            if log.tried is not None or step.action == "retry":
                self._note(outcome, answer, sent=log.attempts > made)
            if step.action == "stop":
                break
            if step.wait_s is not None:
                await asyncio.sleep(step.wait_s)
            if step.resend:
                await self._before_resend()
            retry_number += step.counted
        error = outcome.error
        if error is None:
            assert answer is not None
            return answer
        if step.reason == "deadline":
            if error.retry_after_s is None:
                error.retry_after_s = step.wait_s
            error.details.setdefault("retry_stopped", "next wait would pass the deadline")
        raise error

    async def _attempt(self) -> tuple[Outcome, UpstreamResponse | None]:
        """One attempt: admission, a breaker permit, the send; its outcome and answer."""
        log = self.log
        log.answer = None
        if self.deadline - time.monotonic() <= 0:
            return Outcome(deadline_error("waiting to retry")), None
        if self.group is not None:  # else no admission: no coroutine for it
            await self._admit(first=log.attempts == 0)
        self.began = now = time.monotonic()
        self.began_key = self.key_ref
        remaining = self.deadline - now
        if remaining <= 0:
            return Outcome(deadline_error("waiting for rate-limit capacity")), None
        attempt_timeout = min(self.target.attempt_timeout_s, remaining)
        permit = self.breaker.acquire(attempt_timeout_s=attempt_timeout) if self.breaker else None
        log.attempts += 1
        try:
            answer = await self._send(attempt_timeout)
        except TransportError as exc:
            log.sent, log.billed = log.sent or exc.sent, log.billed or exc.sent
            _settle(permit, None, exc.kind)
            return self._transport_outcome(exc), None
        except BaseException as exc:
            # Interrupted while sending, it may have gone out; refused by the egress
            # checks (PermissionDenied, EgressDenied) before connecting, it did not,
            # unless the refusal is of the upstream's redirect: it had the request.
            # Nor did one refused for want of a connection (all the target's were busy).
            log.sent = log.sent or (
                not isinstance(exc, PermissionDenied | EgressDenied | CapacityExceeded)
                or exc.details.get("reason") in _REFUSED_REDIRECTS
                or (isinstance(exc, CapacityExceeded) and exc.details.get("reason") != POOL_FULL)
            )
            log.billed = log.billed or log.sent
            if permit is not None:
                permit.release()  # interrupted or refused locally: counts as nothing
            raise
        log.sent, log.billed = True, log.billed or answer.status < 400
        _settle(permit, answer.status, None)
        log.answer = answer
        log.upstream_latency_s = answer.elapsed_s
        log.response_bytes = len(answer.body)
        if 200 <= answer.status < 300:
            self._feed_back(answer, None)
            if answer.stream is not None:
                return await self._relayed_outcome(answer), answer
            # Read whole: done, unless it is a stream whose end calls for an error
            # (resent as a relayed one that reached nobody would be).
            judged, _ = judge_body(
                self.target.spec.usage,
                self.target.name,
                answer.content_type,
                answer.body,
                answer.status,
                cut=answer.cut,
                idle=answer.idle,
                head=self.request.method == "HEAD",
            )
            if judged is None:
                return DONE, answer
            safe = self._safe_to_resend()
            return Outcome.stream_end(judged, relayed=False, safe_to_resend=safe), answer
        return await self._status_outcome(answer), answer

    def _note(self, outcome: Outcome, answer: UpstreamResponse | None, *, sent: bool) -> None:
        """The attempt that just ended into :attr:`AttemptLog.tried` (started when the
        first retry is decided: the first attempt is still the one just ended); ``sent``
        False: it ended before sending (the deadline passed while waiting)."""
        tried = self.log.tried
        if tried is None:
            tried = self.log.tried = []
        tried.append(self._entry(outcome, answer, sent=sent))

    def _answered_entry(self, answer: UpstreamResponse) -> dict[str, Any]:
        """The entry :meth:`_entry` makes of an attempt that ended :data:`DONE` (sent,
        answered, no error), built in one frame: the same keys, in the same order, with
        the same values (:func:`tried_entry`)."""
        target = self.target
        request = self.request
        return {
            "target": target.name,
            "model": request_model(target.spec.usage, request.endpoint, request.parameters),
            "api_key_ref": self.began_key,
            "attempts": 1,
            "outcome": "ok",
            "upstream_status": answer.status,
            "reason": None,
            "response_bytes": self.log.response_bytes,
            "duration_ms": round((time.monotonic() - self.began) * 1000, 3),
        }

    def _entry(
        self, outcome: Outcome, answer: UpstreamResponse | None, *, sent: bool
    ) -> dict[str, Any]:
        """One attempt in the audit record (:func:`tried_entry`)."""
        error = outcome.error
        code = "ok" if error is None else error.code.value
        if outcome.refreshed:
            code = "credential_changed"  # a 401 resolved again, or a rested key's successor
        return tried_entry(
            self.target,
            self.request,
            self.began_key if sent else self.key_ref,
            code,
            status=answer.status if answer is not None else None,
            reason=error.details.get("reason") if error is not None else None,
            response_bytes=self.log.response_bytes if answer is not None else None,
            duration_s=time.monotonic() - self.began if sent else 0.0,
            sent=sent,
        )

    def _transport_outcome(self, exc: TransportError) -> Outcome:
        """A transport failure: retryable as :func:`transport_retryable` says (a reset
        before the answer's head on an inference endpoint: :func:`unanswered_resendable`);
        a request that may have been acted on and cannot be sent again is OUTCOME_UNKNOWN."""
        spec, request = self.target.spec, self.request
        retryable, unknown = transport_retryable(
            exc.kind,
            sent=exc.sent,
            method=request.method,
            has_idempotency_key=self.has_idempotency_key,
            retry_on=spec.retry.retry_on,
            answered=exc.answered,
            resend_unanswered=unanswered_resendable(
                spec.retry.resend_unanswered, spec.usage, request.endpoint, request.parameters
            ),
        )
        if unknown:
            return Outcome(self._unknown_outcome(exc))
        return Outcome(self._transport_failure(exc), retryable, resend=exc.sent)

    async def _relayed_outcome(self, answer: UpstreamResponse) -> Outcome:
        """A 2xx stream relayed to the agent: done, unless its end calls for an error;
        the upstream did act, so it is sent again only when that is safe, as for a lost
        answer, and never once an event has been relayed."""
        judged = await self._relay(answer)
        if judged is None:
            return DONE
        relayed = self.relay is not None and self.relay.started
        return Outcome.stream_end(judged, relayed=relayed, safe_to_resend=self._safe_to_resend())

    async def _status_outcome(self, answer: UpstreamResponse) -> Outcome:
        """A non-2xx answer: its error (:func:`gateway.call.statuses.status_error`),
        retryable as the target's ``retry_on`` and the upstream's hint say, with the wait
        the upstream asked for. A 401 on a cached credential resolves it again and resends
        once (maybe rotated)."""
        parsed = parse_body(answer.content_type, answer.body, answer.status)
        hint = error_hint(
            self.target.spec.usage,
            answer.status,
            answer.headers,
            parsed[0] if parsed[1] else None,
        )
        self._feed_back(answer, hint)
        if answer.status == 401 and not self.refreshed and self.refresh_credential is not None:
            self.refreshed = True
            credential = await self.refresh_credential()
            if credential is not None:
                self.outbound = replace(self.outbound, credential=credential)
                self.log.warnings.append("credential refreshed after upstream 401")
                return Outcome(refreshed=True)
        retry_after = parse_retry_after(answer.headers, time.time())
        if retry_after is None and hint is not None and hint.retry_after_s is not None:
            retry_after = min(hint.retry_after_s, MAX_RETRY_AFTER_S)  # e.g. Gemini RetryInfo
        quota = hint is not None and hint.verdict == "quota"
        if self.next_key is not None and (answer.status == 429 or quota):
            rotated = await self.next_key(retry_after, quota)
            if rotated is not None:  # the pool's next key serves, at once
                credential, self.key_ref = rotated
                self.outbound = replace(self.outbound, credential=credential)
                return Outcome(refreshed=True)
        error = status_error(answer, retry_after, self.target.name, hint, parsed)
        retryable = status_retryable(answer.status, self.target.spec.retry.retry_on, hint)
        return Outcome(error, retryable, retry_after_s=retry_after)

    def _send(self, timeout_s: float) -> Awaitable[UpstreamResponse]:
        """The attempt's send: :attr:`send` when given (a database target's statement),
        else the HTTP request through the upstream client."""
        if self.send is not None:
            return self.send(timeout_s)
        return telemetry.current().send(
            self.upstream,
            self.outbound,
            timeout_s=timeout_s,
            stream=self.relay is not None,
            request=self.request,
        )

    async def _before_resend(self) -> None:
        if self.before_resend is not None:
            await self.before_resend()

    def _safe_to_resend(self) -> bool:
        """The upstream acted on a request that may be sent again: an idempotent method
        (RFC 9110 section 9.2.2) or an idempotency key."""
        return self.request.method in IDEMPOTENT_METHODS or self.has_idempotency_key

    async def _relay(self, answer: UpstreamResponse) -> GatewayError | None:
        """Relay ``answer``'s stream; None when it ended complete, else its error."""
        assert self.relay is not None
        relayed = self.log.relayed = Relayed(
            StreamJudge(self.target.spec.usage, self.target.name),
            kept=bytearray() if self.has_idempotency_key else None,
            gate=self.model_gate,
        )
        relayed.judge.watch_model = self.watch_model or self.model_gate is not None
        try:
            # In a task of its own: a task's wake-up resumes every coroutine frame it
            # awaits through, so each chunk would resume the ~20 frames of the call above
            # the relay (server, API, pipeline, idempotency, attempts) besides the relay's
            # few. Cancelling the call's task cancels the task it waits on: a stop, the
            # agent hanging up and the bounds above reach the relay as before.
            await asyncio.ensure_future(relay_stream(
                answer.stream,
                self.relay,
                relayed,
                started=self.started,
                deadline=self.deadline,
                idle_timeout_s=self.target.spec.stream_idle_timeout_s,
                max_bytes=self.max_response_bytes,
                first_event_timeout_s=self.target.spec.first_byte_timeout_s,
                rewrite=self.rewrite,
            ))  # fmt: skip
        except GatewayError as exc:
            return exc
        finally:
            self.log.response_bytes = relayed.bytes
        return None

    async def _admit(self, *, first: bool) -> None:
        assert self.group is not None
        with telemetry.current().span(telemetry.RATE_LIMIT_WAIT, self.group.name):
            waited = await self.group.acquire(
                tokens=self.tokens_reserved if first else 0,
                deadline=self.deadline,
                warnings=self.log.warnings,  # e.g. a cluster group that fell back to local
                shadow=self.log.shadow_denied,
            )
        self.log.admitted = True
        self.log.rate_limit_wait_s += waited

    def _feed_back(self, answer: UpstreamResponse, hint: ErrorHint | None) -> None:
        if self.group is None:
            return
        if hint is not None and hint.verdict == "quota":
            # Spent quota or credit belongs to the account, not to the group's pace: a hold
            # (up to an hour, from a Retry-After or a daily reset) would stall every target
            # sharing the group with CAPACITY_EXCEEDED and outlast a top-up. Each call
            # learns it in one cheap round trip instead.
            return
        hold = provider_hold_s(answer.headers, answer.status, time.time())
        if hold:
            self.group.hold_for(hold, reason=f"upstream {answer.status} rate-limit headers")

    def _transport_failure(self, exc: TransportError) -> GatewayError:
        """The error to answer with for a transport failure whose outcome is known."""
        deadline_hit = time.monotonic() >= self.deadline - 0.001
        if exc.kind == "timeout":
            return DeadlineExceeded(
                exc.message if not deadline_hit else f"{exc.message}; the call's deadline passed",
                details={
                    "reason": "deadline" if deadline_hit else "attempt_timeout",
                    "target": self.target.name,
                },
            )
        return DependencyFailed(
            f"{exc.message}; the upstream could not be reached",
            details={"reason": exc.kind, "target": self.target.name},
        )

    def _unknown_outcome(self, exc: TransportError) -> OutcomeUnknown:
        return OutcomeUnknown(
            f"{exc.message} after the request was sent; it may or may not have been "
            "processed, and it was not resent because the call is not idempotent (no "
            "idempotency key; a provider's inference call is resent only when its "
            "connection closed before any answer and the target's "
            "retry.resend_unanswered is on). Check the upstream before retrying.",
            details={"reason": exc.kind, "target": self.target.name},
        )


def tried_entry(
    target: CompiledTarget,
    request: ExternalCallRequest,
    key_ref: str | None,
    outcome: str,
    *,
    status: int | None = None,
    reason: Any = None,
    response_bytes: int | None = None,
    duration_s: float = 0.0,
    sent: bool = True,
) -> dict[str, Any]:
    """One attempt in the audit record's ``tried`` (docs/audit.md): its ``target``,
    ``model`` (the request's, in the target's dialect; None without one), ``api_key_ref``
    (the key's reference name, never the key), ``outcome`` (``ok``, an error code, or
    ``credential_changed``: a 401 resolved again or a rested key's successor sent it
    again), ``upstream_status``, ``reason`` (a transport failure's kind: connect, reset,
    timeout; or the error's own reason), ``response_bytes``, ``duration_ms`` (from its
    send, after any rate-limit wait) and ``attempts``: 1, or 0 for one refused before
    anything was sent (an open breaker, a refused fallback, a secret not resolved)."""
    return {
        "target": target.name,
        "model": request_model(target.spec.usage, request.endpoint, request.parameters),
        "api_key_ref": key_ref,
        "attempts": 1 if sent else 0,
        "outcome": outcome,
        "upstream_status": status,
        "reason": reason,
        "response_bytes": response_bytes,
        "duration_ms": round(duration_s * 1000, 3),
    }


def _settle(permit: Permit | None, status: int | None, kind: str | None) -> None:
    if permit is not None:
        permit.record(status, kind)


def deadline_error(while_doing: str) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"the call's deadline (the envelope's timeout) passed while {while_doing}",
        details={"reason": "deadline"},
    )

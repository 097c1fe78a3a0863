"""One call through the stages, in order, inside the envelope's deadline.

    intake -> egress decision -> idempotency -> rate-limit group -> circuit breaker
    -> secret -> upstream attempts (retries, backoff, Retry-After) -> usage -> answer

Every call, whatever happens, ends with exactly one :class:`ExternalCallResponse` and
exactly one audit record (written in a ``finally``). A bug inside the sidecar becomes an
UNKNOWN answer that points at the audit record, never a stack trace on the wire (unless
``server.debug`` is on).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlencode

from gateway import egress as egress_rules
from gateway.audit import AuditLog, get_logger
from gateway.bodies import media_type, parse_body
from gateway.envelope import IDEMPOTENT_METHODS, ExternalCallRequest, ExternalCallResponse
from gateway.errors import (
    CapacityExceeded,
    DeadlineExceeded,
    DependencyFailed,
    GatewayError,
    InternalError,
    InvalidPayload,
    OutcomeUnknown,
    PermissionDenied,
    ShuttingDown,
    UpstreamRejected,
    error_response,
)
from gateway.intake import decode_json, parse_request
from gateway.policy import CompiledTarget, PolicySet
from gateway.retry import backoff_s, parse_retry_after, status_retryable, transport_retryable
from gateway.secrets import ResolvedSecret, SecretResolvers, parse_ref
from gateway.upstream import Credential, OutboundRequest, TransportError, Upstream, UpstreamResponse
from gateway.usage import TokenUsage, extract_usage

_log = get_logger("gateway.pipeline")
_CLAIMED = ("trace_id", "correlation_id", "target_system", "endpoint", "method", "agent_id")


@dataclass(slots=True)
class CallContext:
    """What one call learned on its way; becomes the audit record."""

    started: float
    request: ExternalCallRequest | None = None
    target: CompiledTarget | None = None
    api_key_ref: str | None = None
    attempts: int = 0
    upstream_latency_s: float | None = None
    usage: TokenUsage | None = None
    request_bytes: int = 0
    request_sha256: str | None = None
    response_bytes: int | None = None
    rate_limit_group: str | None = None
    rate_limit_wait_s: float = 0.0
    idempotency_key: str | None = None
    replayed: bool = False
    decision: str = "invalid"
    warnings: list[str] = field(default_factory=list)
    #: Identifiers read from an envelope that failed validation, for its audit record.
    claimed: dict[str, str] = field(default_factory=dict)


class Pipeline:
    """Runs calls against the current policy. Swap ``policy`` whole to reload."""

    def __init__(
        self,
        policy: PolicySet,
        *,
        resolvers: SecretResolvers,
        upstream: Upstream,
        audit: AuditLog,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy
        self.resolvers = resolvers
        self.upstream = upstream
        self.audit = audit
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        #: Set by the runtime when it cancels calls that outlived the drain time.
        self.aborting = False

    async def handle(self, body: bytes) -> tuple[int, ExternalCallResponse]:
        """Run one call from its raw envelope bytes. Returns (HTTP status, answer)."""
        ctx = CallContext(started=time.monotonic())
        ctx.request_bytes = len(body)
        policy = self.policy  # one policy for the whole call, even across a reload
        agent_id = policy.policy.agent_id
        status, response = 500, None
        try:
            raw = decode_json(body)
            if isinstance(raw, dict):
                ctx.claimed = {k: raw[k][:256] for k in _CLAIMED if isinstance(raw.get(k), str)}
            intake = parse_request(raw, unknown_fields=policy.policy.envelope.unknown_fields)
            request = ctx.request = intake.request
            ctx.api_key_ref = egress_rules.loggable_ref(request.api_key_ref)
            if intake.unknown_fields:
                ctx.warnings.append("unknown envelope fields ignored: " + ", ".join(intake.unknown_fields))
                _log.warning("unknown_envelope_fields", fields=list(intake.unknown_fields),
                             trace_id=request.trace_id, correlation_id=request.correlation_id)
            agent_id = request.agent_id or agent_id
            ctx.decision = "denied"
            decision = egress_rules.decide(policy, request)
            ctx.target, ctx.api_key_ref = decision.target, decision.api_key_ref
            ctx.decision = "allowed"
            deadline = ctx.started + request.timeout
            response = await self._call(policy, request, decision.target, ctx, deadline)
            status = 200
        except GatewayError as exc:
            status = _answer_status(exc)
            response = self._failure(exc, ctx, agent_id)
        except asyncio.CancelledError:
            interrupted = _interrupted_error(ctx)
            status = interrupted.http_status
            response = self._failure(interrupted, ctx, agent_id)
            task = asyncio.current_task()
            if not self.aborting or task is None:
                raise
            # Cancelled by our own shutdown (drain time over): answer instead of vanishing.
            task.uncancel()
        except Exception as exc:  # noqa: BLE001 - a bug must still get an answer
            _log.exception("internal_error", trace_id=_trace(ctx), correlation_id=_corr(ctx))
            err = InternalError(
                "the sidecar failed unexpectedly; the audit log has the details under this "
                "call's trace_id and correlation_id",
                details={"exception": type(exc).__name__},
            )
            status = 500
            response = self._failure(err, ctx, agent_id)
            if policy.policy.server.debug:
                assert response.error is not None
                response = response.model_copy(update={"error": response.error.model_copy(
                    update={"stack_trace": traceback.format_exc()})})
        finally:
            if response is not None:
                self._write_audit(ctx, response, agent_id)
        return status, response

    # -- stages ---------------------------------------------------------------------------

    async def _call(
        self,
        policy: PolicySet,
        request: ExternalCallRequest,
        target: CompiledTarget,
        ctx: CallContext,
        deadline: float,
    ) -> ExternalCallResponse:
        spec = target.spec
        url = egress_rules.upstream_url(target, request.endpoint)
        query = egress_rules.query_items(request.method, request.parameters)
        body = None
        if query is None:
            body = json.dumps(request.parameters, ensure_ascii=False, separators=(",", ":")).encode()
            ctx.request_sha256 = hashlib.sha256(body).hexdigest()
        else:
            ctx.request_sha256 = hashlib.sha256(urlencode(query).encode()).hexdigest()
        headers = {**spec.static_headers, **request.headers}
        if spec.idempotency is not None and request.method in spec.idempotency.methods:
            ctx.idempotency_key = request.idempotency_key or _derived_key(request)
            headers[spec.idempotency.header] = ctx.idempotency_key
        ctx.rate_limit_group = request.rate_limit_group or spec.rate_limit_group
        if request.rate_limit_group and request.rate_limit_group not in policy.policy.rate_limit_groups:
            raise InvalidPayload(
                f"rate_limit_group {request.rate_limit_group!r} is not defined in the policy",
                details={"reason": "unknown_rate_limit_group", "group": request.rate_limit_group},
            )

        resolved = await self._resolve(ctx, deadline)
        outbound = OutboundRequest(
            target=target, method=request.method, url=url, query=query, body=body,
            headers=headers, credential=_credential(target, resolved),
        )
        answer = await self._attempts(request, target, outbound, ctx, deadline, resolved)
        data, _ = parse_body(answer.content_type, answer.body, answer.status)
        ctx.usage = extract_usage(spec.usage, data)
        return ExternalCallResponse(
            success=True,
            status_code=answer.status,
            data=data,
            latency_ms=round((time.monotonic() - ctx.started) * 1000, 3),
            tokens_used=ctx.usage.total if ctx.usage else None,
            trace_id=request.trace_id,
            correlation_id=request.correlation_id,
        )

    async def _resolve(self, ctx: CallContext, deadline: float) -> ResolvedSecret | None:
        if ctx.api_key_ref is None:
            return None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _deadline_error("resolving the secret")
        try:
            async with asyncio.timeout(remaining):
                resolved = await self.resolvers.resolve(parse_ref(ctx.api_key_ref))
        except TimeoutError:
            raise _deadline_error("resolving the secret") from None
        ctx.warnings.extend(resolved.warnings)
        return resolved

    async def _attempts(
        self,
        request: ExternalCallRequest,
        target: CompiledTarget,
        outbound: OutboundRequest,
        ctx: CallContext,
        deadline: float,
        resolved: ResolvedSecret | None,
    ) -> UpstreamResponse:
        retry = target.spec.retry
        retries_allowed = min(request.max_retries, retry.max_retries)
        rotated = False
        retry_number = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _deadline_error("waiting to retry")
            ctx.attempts += 1
            attempt_timeout = min(target.spec.timeout_s, remaining)
            try:
                answer = await self.upstream.send(outbound, timeout_s=attempt_timeout)
            except TransportError as exc:
                retryable, unknown = transport_retryable(
                    exc.kind, sent=exc.sent, method=request.method,
                    has_idempotency_key=ctx.idempotency_key is not None, retry_on=retry.retry_on,
                )
                if unknown:
                    raise OutcomeUnknown(
                        f"{exc.message} after the request was sent; it may or may not have "
                        "been processed, and it was not resent because the call is not "
                        "idempotent (no idempotency key). Check the upstream before retrying.",
                        details={"reason": exc.kind, "target": target.name},
                    ) from None
                final = _transport_error(exc, time.monotonic() >= deadline - 0.001, target.name)
                wait = backoff_s(retry_number, retry.backoff_base_s, retry.backoff_max_s, self._rng)
                if not retryable or retry_number >= retries_allowed:
                    raise final from None
                await self._wait_or_raise(wait, deadline, final)
                retry_number += 1
                continue
            ctx.upstream_latency_s = answer.elapsed_s
            ctx.response_bytes = len(answer.body)
            status = answer.status
            if status < 300:
                return answer
            if status == 401 and resolved is not None and resolved.from_cache and not rotated:
                # A cached credential that the upstream refuses may have been rotated.
                rotated = True
                assert ctx.api_key_ref is not None
                ref = parse_ref(ctx.api_key_ref)
                self.resolvers.invalidate(ref)
                resolved = await self._resolve(ctx, deadline)
                outbound = _with_credential(outbound, _credential(target, resolved))
                ctx.warnings.append("credential refreshed after upstream 401")
                continue
            retry_after = parse_retry_after(answer.headers, time.time())
            final_error = _status_error(answer, retry_after, target.name)
            if not status_retryable(status, retry.retry_on) or retry_number >= retries_allowed:
                raise final_error
            wait = retry_after if retry_after is not None else backoff_s(
                retry_number, retry.backoff_base_s, retry.backoff_max_s, self._rng)
            await self._wait_or_raise(wait, deadline, final_error)
            retry_number += 1

    @staticmethod
    async def _wait_or_raise(wait: float, deadline: float, final: GatewayError) -> None:
        """Sleep ``wait`` seconds before a retry, or raise ``final`` if it would not fit."""
        if time.monotonic() + wait >= deadline:
            if final.retry_after_s is None:
                final.retry_after_s = wait
            final.details.setdefault("retry_stopped", "next wait would pass the deadline")
            raise final
        await asyncio.sleep(wait)

    # -- answers and audit ----------------------------------------------------------------

    def _failure(self, exc: GatewayError, ctx: CallContext, agent_id: str) -> ExternalCallResponse:
        request = ctx.request
        return error_response(
            exc,
            latency_ms=(time.monotonic() - ctx.started) * 1000,
            failed_agent=agent_id,
            trace_id=request.trace_id if request else None,
            correlation_id=request.correlation_id if request else None,
        )

    def _write_audit(self, ctx: CallContext, response: ExternalCallResponse, agent_id: str) -> None:
        request, target, usage, error = ctx.request, ctx.target, ctx.usage, response.error
        ids: dict[str, Any] = (
            {k: getattr(request, k) for k in _CLAIMED} if request else dict(ctx.claimed)
        )
        record: dict[str, Any] = {
            "agent_id": agent_id if request else ids.get("agent_id") or agent_id,
            "trace_id": ids.get("trace_id"),
            "correlation_id": ids.get("correlation_id"),
            "target_system": ids.get("target_system"),
            "endpoint": ids.get("endpoint"),
            "method": ids.get("method"),
            "upstream": egress_rules.origin_label(target.base_url) if target else None,
            "decision": "replayed" if ctx.replayed else ctx.decision,
            "success": response.success,
            "status_code": response.status_code,
            "error_code": error.code.value if error else None,
            "retryable": error.retryable if error else None,
            "attempts": ctx.attempts,
            "latency_ms": response.latency_ms,
            "upstream_latency_ms": (
                round(ctx.upstream_latency_s * 1000, 3) if ctx.upstream_latency_s is not None else None
            ),
            "tokens_used": usage.total if usage else None,
            "tokens_input": usage.input if usage else None,
            "tokens_output": usage.output if usage else None,
            "tokens_cached": usage.cached if usage else None,
            "request_bytes": ctx.request_bytes,
            "request_sha256": ctx.request_sha256,
            "response_bytes": ctx.response_bytes,
            "api_key_ref": ctx.api_key_ref,
            "rate_limit_group": ctx.rate_limit_group,
            "rate_limit_wait_ms": round(ctx.rate_limit_wait_s * 1000, 3),
            "idempotency_key": ctx.idempotency_key,
            "replayed": ctx.replayed,
            "warnings": ctx.warnings,
            "metadata": request.metadata if request else {},
        }
        if error is not None and error.code.value in ("EGRESS_DENIED",):
            record["warnings"] = [*ctx.warnings, f"egress denied: {error.message}"]
        self.audit.call(record)


def _interrupted_error(ctx: CallContext) -> GatewayError:
    request = ctx.request
    safe = request is not None and (
        request.method in IDEMPOTENT_METHODS or ctx.idempotency_key is not None
    )
    if ctx.attempts and not safe:
        return OutcomeUnknown(
            "the sidecar shut down while the request was with the upstream; it may or may "
            "not have been processed. Check the upstream before retrying.",
            details={"reason": "shutdown"},
        )
    return ShuttingDown(
        "the sidecar shut down before the call finished; it is safe to retry",
        details={"reason": "shutdown"}, retry_after_s=1.0,
    )


def _answer_status(exc: GatewayError) -> int:
    if isinstance(exc, UpstreamRejected) and exc.status_code and 400 <= exc.status_code < 500:
        return exc.status_code
    return exc.http_status


def _derived_key(request: ExternalCallRequest) -> str:
    """A stable key from the transaction and the operation: resending the same envelope
    gives the same key."""
    material = "\x1f".join(
        (request.trace_id, request.correlation_id, request.target_system, request.method,
         request.endpoint)
    )
    return "egw-" + hashlib.sha256(material.encode()).hexdigest()[:40]


def _credential(target: CompiledTarget, resolved: ResolvedSecret | None) -> Credential | None:
    cred = target.spec.credential
    if cred is None or resolved is None:
        return None
    return Credential(resolved.secret, cred.header, cred.query_param, cred.format)


def _with_credential(outbound: OutboundRequest, credential: Credential | None) -> OutboundRequest:
    return replace(outbound, credential=credential)


def _deadline_error(while_doing: str) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"the call's deadline (the envelope's timeout) passed while {while_doing}",
        details={"reason": "deadline"},
    )


def _transport_error(exc: TransportError, deadline_hit: bool, target: str) -> GatewayError:
    if exc.kind == "timeout":
        return DeadlineExceeded(
            exc.message if not deadline_hit else f"{exc.message}; the call's deadline passed",
            details={"reason": "deadline" if deadline_hit else "attempt_timeout", "target": target},
        )
    return DependencyFailed(
        f"{exc.message}; the upstream could not be reached",
        details={"reason": exc.kind, "target": target},
    )


def _status_error(answer: UpstreamResponse, retry_after: float | None, target: str) -> GatewayError:
    status = answer.status
    data, is_json = parse_body(answer.content_type, answer.body, status)
    described = f"{status} {answer.reason}".strip()
    if not is_json and answer.body:
        described += f" with a {media_type(answer.content_type) or 'untyped'} body (not JSON)"
    details: dict[str, Any] = {"target": target, "upstream_status": status}
    common: Mapping[str, Any] = {"status_code": status, "data": data, "details": details}
    if status == 429:
        details["source"] = "upstream"
        return CapacityExceeded(
            f"the upstream is rate limiting: it answered {described}", retry_after_s=retry_after,
            **common,
        )
    if status >= 500:
        return DependencyFailed(
            f"the upstream failed: it answered {described}", retry_after_s=retry_after, **common
        )
    if status in (401, 403):
        details["reason"] = "upstream_denied"
        return PermissionDenied(
            f"the upstream refused the credential or the operation: it answered {described}",
            **common,
        )
    if status < 400:
        return UpstreamRejected(
            f"the upstream answered {described} (a redirect that was not followed)",
            http_status=502, **common,
        )
    return UpstreamRejected(f"the upstream rejected the request: it answered {described}", **common)


def _trace(ctx: CallContext) -> str | None:
    return ctx.request.trace_id if ctx.request else None


def _corr(ctx: CallContext) -> str | None:
    return ctx.request.correlation_id if ctx.request else None

"""Approvals: a call the policy names (a target's ``approval:``) waits for a person's yes
(design.md, "Approvals, dead letters and the operator console";
docs/features/approvals.md).

The rules (pure): :func:`held_call` says whether a call needs approval and what an
approval of it is bound to (a :class:`HeldCall`: target, tool or endpoint, method, the
arguments in canonical JSON, agent, trace; :meth:`HeldCall.binding` is its SHA-256).
An approval covers that call and nothing else: other arguments, another trace or agent
make another request.

The service (:class:`Approvals`) records requests in a store (:class:`ApprovalStore`:
this process's memory, or Redis in cluster scope, :mod:`gateway.agents.approvals_redis`)
and holds the call::

    open (the request of this binding, or a new one)
      approved -> claim (atomic: one call runs per approval, across replicas) -> run
      denied   -> APPROVAL_DENIED
      pending  -> wait for a decision until the call's deadline -> APPROVAL_PENDING
      used or expired -> a new request

A request's states: ``pending`` -> ``approved`` | ``denied`` (an operator) ->
``used`` (approved, claimed by its call); ``expired`` when ``ttl_s`` passed (pending:
from the request; approved or denied: from the decision; the same call then asks
anew). A store that cannot be reached ends the call with DEPENDENCY_FAILED (``details.reason:
approval_store_unavailable``): a held call never runs unapproved. Every request,
decision and claim is an audit event (``approval_requested``, ``approval_decided``,
``approval_used``: who, when, what).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Final, Literal, Protocol

from gateway import redaction
from gateway.audit import AuditLog
from gateway.envelope import ExternalCallRequest
from gateway.errors import (
    ApprovalDenied,
    ApprovalPending,
    DependencyFailed,
    InvalidPayload,
    PermissionDenied,
)
from gateway.idempotency.keys import canonical_json
from gateway.policy.desk import ApprovalSpec
from gateway.policy.egress import endpoint_name
from gateway.providers import a2a as a2a_rpc
from gateway.providers import mcp as rpc
from gateway.tracing import TRACE_HEADERS

#: Seconds between two reads of a request's state while a call waits (the Redis store;
#: the memory store wakes the call at the decision).
POLL_S: Final = 0.1
#: The longest arguments text a request keeps (characters of canonical JSON): a larger
#: one is kept as ``{"truncated": true, "chars", "sha256", "start"}``, so that requests
#: an agent can make at will hold bounded memory (the binding covers the whole call).
MAX_KEPT_ARGUMENTS: Final = 16_384
#: Opening a request again after a lost claim or an expiry, at most this often per call.
MAX_REOPENS: Final = 8
Verdict = Literal["approved", "denied"]
#: The fields of a request record (strings, as a Redis hash holds them).
FIELDS: Final = (
    "id", "state", "binding", "target", "kind", "name", "method", "arguments", "agent",
    "trace", "approvers", "requested_at", "expires_at", "ttl_s", "decided_by",
    "decided_at", "used_at", "api_key_ref",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class HeldCall:
    """What an approval is bound to. ``kind``: ``tool`` (an MCP ``tools/call``; ``name``
    the tool, or the tools of a batch joined by commas) or ``endpoint`` (``name`` the
    envelope's endpoint); ``arguments``: the tool's arguments (a list for a batch), or
    ``{parameters, query, body}`` of an endpoint, with ``headers`` when the agent set
    headers that go upstream (``forward_headers``; trace headers are not the call's);
    ``api_key_ref``: the secret reference the agent picked (None: the target's own), as
    another key acts as another account."""

    target: str
    kind: Literal["tool", "endpoint"]
    name: str
    method: str
    arguments: Any
    agent: str
    trace: str
    api_key_ref: str | None = None

    def binding(self) -> str:
        """SHA-256 hex of the canonical JSON of every field: the identity of the call."""
        fields = {
            "target": self.target,
            "kind": self.kind,
            "name": self.name,
            "method": self.method,
            "arguments": self.arguments,
            "agent": self.agent,
            "trace": self.trace,
        }
        if self.api_key_ref is not None:
            fields["api_key_ref"] = self.api_key_ref
        return hashlib.sha256(canonical_json(fields)).hexdigest()


def held_call(
    spec: ApprovalSpec,
    target: str,
    request: ExternalCallRequest,
    exchange: rpc.McpExchange | None,
    agent: str,
    a2a: Any = None,
) -> HeldCall | None:
    """The :class:`HeldCall` of a call the target's ``approval:`` names, else None: an
    MCP ``tools/call`` (in ``exchange``) whose tool matches a ``tools`` glob, or an
    endpoint and method an ``endpoints`` rule matches (globs by :func:`fnmatchcase`, on
    :func:`~gateway.policy.egress.endpoint_name`: every spelling of the path is held);
    ``a2a``: the call's A2A exchange, if any (:func:`_endpoint_arguments`)."""
    if exchange is not None:
        held = [
            m.params
            for m in exchange.messages
            if m.method == rpc.TOOLS_CALL
            and isinstance(m.params, dict)
            and any(fnmatchcase(str(m.params.get("name")), g) for g in spec.tools)
        ]
        if not held:
            return None
        names = ",".join(str(p.get("name")) for p in held)
        args = [p.get("arguments") for p in held]
        return HeldCall(target, "tool", names, request.method, args[0] if len(args) == 1 else args,
                        agent, request.trace_id, request.api_key_ref)  # fmt: skip
    method = request.method.upper()
    name = endpoint_name(request.endpoint)  # "/a/" and "/%61" are "/a" (what is sent)
    for rule in spec.endpoints:
        if method in rule.methods and fnmatchcase(name, endpoint_name(rule.path)):
            arguments = _endpoint_arguments(request, a2a)
            headers = {
                k.lower(): v for k, v in request.headers.items() if k.lower() not in TRACE_HEADERS
            }
            if headers:  # what the upstream acts on too (an account, a version)
                arguments["headers"] = headers
            return HeldCall(
                target, "endpoint", request.endpoint, method, arguments, agent, request.trace_id,
                request.api_key_ref,
            )  # fmt: skip
    return None


def _endpoint_arguments(request: ExternalCallRequest, a2a: Any) -> dict[str, Any]:
    """What an endpoint's held call is bound to and shows: ``{parameters, query, body}``;
    for an A2A JSON-RPC request (``a2a``, its :class:`~gateway.providers.a2a.A2aExchange`)
    its method and params as a person reads them, without what changes on every send
    (the JSON-RPC id, the message's id, the call chain the sidecar writes into its
    ``metadata``)."""
    if isinstance(a2a, a2a_rpc.A2aExchange):
        return a2a_rpc.said(a2a)
    body = request.body.model_dump() if request.body is not None else None
    return {"parameters": request.parameters, "query": request.query, "body": body}


class StoreUnavailable(Exception):
    """The approval store cannot be reached (Redis down); the message names it safely."""


class ApprovalStore(Protocol):
    """Where requests live. Records are ``dict[str, str]`` of :data:`FIELDS`; times are
    Unix seconds. Every method may raise :class:`StoreUnavailable`."""

    async def open(
        self, binding: str, record: dict[str, str], ttl_s: float
    ) -> tuple[dict[str, str], bool]:
        """The live request of ``binding`` (not used, not expired), else ``record``
        stored as a new one; ``(record, created)``."""

    async def decide(self, approval_id: str, verdict: Verdict, who: str, now: float) -> str:
        """``ok``, ``unknown``, ``expired`` or ``already`` (decided before)."""

    async def claim(self, approval_id: str, now: float) -> bool:
        """Mark an approved, unexpired request used; True for exactly one caller."""

    async def get(self, approval_id: str) -> dict[str, str] | None:
        """The request, or None (unknown, or expired long ago)."""

    async def recent(self, limit: int) -> list[dict[str, str]]:
        """Up to ``limit`` requests, newest first."""

    async def wait(self, approval_id: str, timeout_s: float) -> None:
        """Return when the request may have changed, or after ``timeout_s``."""

    async def aclose(self) -> None:
        """Release the store's resources. Idempotent."""


def effective_state(record: dict[str, str], now: float) -> str:
    """The state as of ``now``: ``expired`` once a pending, approved or denied request is
    past its ``expires_at`` (a denial, too, holds only ``ttl_s``)."""
    state = record.get("state", "unknown")
    if state in ("pending", "approved", "denied") and float(record.get("expires_at", "0")) <= now:
        return "expired"
    return state


class MemoryApprovalStore:
    """The requests of this process (``approvals.scope: local``), at most
    ``max_entries`` (the oldest forgotten first)."""

    def __init__(
        self, *, max_entries: int = 10_000, clock: Callable[[], float] = time.time
    ) -> None:
        self._records: dict[str, dict[str, str]] = {}
        self._bindings: dict[str, str] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self._max = max_entries
        self._clock = clock

    async def open(
        self, binding: str, record: dict[str, str], ttl_s: float
    ) -> tuple[dict[str, str], bool]:
        known = self._records.get(self._bindings.get(binding, ""))
        now = self._clock()
        if known is not None and effective_state(known, now) not in ("used", "expired"):
            return dict(known), False
        while len(self._records) >= self._max:
            oldest = self._records.pop(next(iter(self._records)))
            self._changed.pop(oldest["id"], None)
            if self._bindings.get(oldest["binding"]) == oldest["id"]:
                del self._bindings[oldest["binding"]]
        self._records[record["id"]] = dict(record)
        self._bindings[binding] = record["id"]
        return dict(record), True

    async def decide(self, approval_id: str, verdict: Verdict, who: str, now: float) -> str:
        record = self._records.get(approval_id)
        if record is None:
            return "unknown"
        state = effective_state(record, now)
        if state != "pending":
            return "expired" if state == "expired" else "already"
        expires = now + float(record["ttl_s"])
        record.update(state=verdict, decided_by=who, decided_at=repr(now), expires_at=repr(expires))
        self._wake(approval_id)
        return "ok"

    async def claim(self, approval_id: str, now: float) -> bool:
        record = self._records.get(approval_id)
        if record is None or effective_state(record, now) != "approved":
            return False
        record.update(state="used", used_at=repr(now))
        if self._bindings.get(record["binding"]) == approval_id:
            del self._bindings[record["binding"]]
        self._wake(approval_id)
        return True

    async def get(self, approval_id: str) -> dict[str, str] | None:
        record = self._records.get(approval_id)
        return dict(record) if record is not None else None

    async def recent(self, limit: int) -> list[dict[str, str]]:
        return [dict(r) for r in list(self._records.values())[::-1][:limit]]

    async def wait(self, approval_id: str, timeout_s: float) -> None:
        event = self._changed.setdefault(approval_id, asyncio.Event())
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await event.wait()
        except TimeoutError:
            pass

    def _wake(self, approval_id: str) -> None:
        event = self._changed.pop(approval_id, None)
        if event is not None:
            event.set()

    async def aclose(self) -> None:
        return None


def new_id() -> str:
    """A request id: ``apr_`` and 20 random hex digits (unguessable, URL-safe)."""
    return "apr_" + secrets.token_hex(10)


class Approvals:
    """Holds calls until they are approved, records requests and decisions (module
    docstring). ``store`` is this process's memory or the cluster's Redis; ``audit``
    receives the events; ``clock`` is Unix time (records), the deadline is monotonic."""

    def __init__(
        self,
        store: ApprovalStore,
        audit: AuditLog | None = None,
        *,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.audit = audit
        self._clock = clock
        self._on_change = on_change or (lambda _event: None)

    async def hold(self, spec: ApprovalSpec, call: HeldCall, deadline: float) -> str:
        """Return when ``call`` may run (its approval claimed: the approval id), within
        ``deadline`` (``time.monotonic()``). Raises ApprovalDenied, ApprovalPending
        (``details.approval_id``, ``retry_after_s``: ``spec.retry_after_s``), or
        DependencyFailed when the store cannot be reached."""
        try:
            record, reopens = await self._open(spec, call), 0
            while True:
                state = effective_state(record, self._clock())
                if state == "approved" and await self.store.claim(record["id"], self._clock()):
                    self._event("approval_used", record, by=record.get("decided_by"))
                    return record["id"]
                if state == "denied":
                    raise _denied(record)
                if state != "pending" and reopens < MAX_REOPENS:  # used, expired, claim lost
                    record, reopens = await self._open(spec, call), reopens + 1
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or state != "pending":
                    raise _pending(record, spec)
                await self.store.wait(record["id"], min(remaining, POLL_S))
                record = await self.store.get(record["id"]) or record
        except StoreUnavailable as exc:
            raise DependencyFailed(
                f"the approval store is unavailable ({exc}); the call needs an approval and "
                "was not sent",
                details={"reason": "approval_store_unavailable"},
                retry_after_s=spec.retry_after_s,
            ) from None

    async def check(
        self,
        spec: ApprovalSpec | None,
        target: str,
        request: ExternalCallRequest,
        exchange: rpc.McpExchange | None,
        agent: str,
        deadline: float,
        a2a: Any = None,
    ) -> str | None:
        """The pipeline's hook, before anything is sent: holds the call when ``spec`` (the
        target's ``approval:``) names it (:func:`held_call`, :meth:`hold`); the claimed
        approval's id, or None for a call that needs none."""
        if spec is None:
            return None
        call = held_call(spec, target, request, exchange, agent, a2a)
        return None if call is None else await self.hold(spec, call, deadline)

    async def _open(self, spec: ApprovalSpec, call: HeldCall) -> dict[str, str]:
        now = self._clock()
        binding = call.binding()
        record = {
            "id": new_id(),
            "state": "pending",
            "binding": binding,
            "target": call.target,
            "kind": call.kind,
            "name": call.name,
            "method": call.method,
            "arguments": _kept_arguments(call.arguments),
            "agent": call.agent,
            "trace": call.trace,
            "approvers": ",".join(spec.approvers),
            "requested_at": repr(now),
            "expires_at": repr(now + spec.ttl_s),
            "ttl_s": repr(spec.ttl_s),
        }
        if call.api_key_ref is not None:
            record["api_key_ref"] = call.api_key_ref
        stored, created = await self.store.open(binding, record, spec.ttl_s)
        if created:
            self._event("approval_requested", stored)
        return stored

    async def decide(self, approval_id: str, verdict: Verdict, who: str) -> dict[str, str]:
        """An operator's decision on a pending request; the updated record. Raises
        InvalidPayload 404 (unknown id), 409 (decided before), 410 (expired),
        PermissionDenied 403 (``who`` is not among the request's approvers), or
        DependencyFailed (store unavailable)."""
        try:
            record = await self.store.get(approval_id)
            if record is None:
                raise _bad(f"no approval request {approval_id!r}", "unknown_approval", 404)
            approvers = [a for a in record.get("approvers", "").split(",") if a]
            if approvers and who not in approvers:
                raise PermissionDenied(
                    f"operator {who!r} may not decide this request (approvers: "
                    f"{', '.join(approvers)})",
                    details={"reason": "not_an_approver", "approval_id": approval_id},
                )
            outcome = await self.store.decide(approval_id, verdict, who, self._clock())
            if outcome == "unknown":
                raise _bad(f"no approval request {approval_id!r}", "unknown_approval", 404)
            if outcome == "expired":
                raise _bad(f"approval request {approval_id} expired", "approval_expired", 410)
            if outcome == "already":
                current = await self.store.get(approval_id) or record
                raise _bad(
                    f"approval request {approval_id} was already decided "
                    f"({current.get('state')} by {current.get('decided_by') or 'nobody'})",
                    "already_decided",
                    409,
                )
            decided = await self.store.get(approval_id) or record
        except StoreUnavailable as exc:
            raise DependencyFailed(
                f"the approval store is unavailable ({exc})",
                details={"reason": "approval_store_unavailable"},
            ) from None
        self._event("approval_decided", decided, by=who, verdict=verdict)
        return decided

    def _event(self, name: str, record: dict[str, str], **extra: Any) -> None:
        self._on_change(name)
        if self.audit is None:
            return
        self.audit.event(
            name,
            approval_id=record["id"],
            target_system=record.get("target"),
            approval_kind=record.get("kind"),
            approval_name=record.get("name"),
            method=record.get("method"),
            arguments_sha256=hashlib.sha256(record.get("arguments", "").encode()).hexdigest(),
            requesting_agent=record.get("agent"),
            trace_id=record.get("trace"),
            **extra,
        )

    async def aclose(self) -> None:
        """Close the store. Idempotent."""
        await self.store.aclose()


def _kept_arguments(arguments: Any) -> str:
    """The arguments as a request keeps and shows them: canonical JSON, secrets scrubbed,
    at most :data:`MAX_KEPT_ARGUMENTS` characters (else their start, size and hash)."""
    text = redaction.scrub(canonical_json(arguments).decode("utf-8"))
    if len(text) <= MAX_KEPT_ARGUMENTS:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()
    head = {"truncated": True, "chars": len(text), "sha256": digest}
    return json.dumps({**head, "start": text[:MAX_KEPT_ARGUMENTS]}, ensure_ascii=False)


def _pending(record: dict[str, str], spec: ApprovalSpec) -> ApprovalPending:
    return ApprovalPending(
        f"this call waits for an operator's approval (request {record['id']}); send the "
        "same call again (same arguments and trace) once it is approved",
        details={"approval_id": record["id"], "target_system": record.get("target")},
        retry_after_s=spec.retry_after_s,
    )


def _denied(record: dict[str, str]) -> ApprovalDenied:
    return ApprovalDenied(
        f"an operator refused this call (request {record['id']}); do not send it again",
        details={"approval_id": record["id"], "decided_by": record.get("decided_by")},
    )


def _bad(message: str, reason: str, status: int) -> InvalidPayload:
    return InvalidPayload(message, details={"reason": reason}, http_status=status)

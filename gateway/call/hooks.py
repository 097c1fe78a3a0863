"""What an API adds to the stages every call shares (:mod:`gateway.call.pipeline`).

The pipeline runs the same stages for every API; where an API reads a kind of target its
own way (an MCP target's rules on an envelope's ``parameters``, on an MCP route's body,
or refused on a drop-in route; a database target's statement bound from an envelope,
refused on a drop-in route), its entry point hands the pipeline its
:class:`CallHooks` (:data:`ENVELOPE`, :data:`ROUTE`, :data:`DROP_IN`; the MCP rules are
:mod:`gateway.call.mcp`'s), so that no stage branches on the API.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

from gateway.call import a2a, mcp
from gateway.call.record import CallContext, Reading
from gateway.call.relay import Relay
from gateway.database import DbLog, bind
from gateway.envelope import ExternalCallRequest, ExternalCallResponse
from gateway.errors import InvalidPayload, PermissionDenied
from gateway.policy import CompiledTarget
from gateway.policy.database import StatementSpec


class CallHooks(Protocol):
    """An API's part in the shared stages, pure (no I/O)."""

    def checked(
        self,
        request: ExternalCallRequest,
        target: CompiledTarget,
        ctx: CallContext,
        relay: Relay | None,
    ) -> tuple[ExternalCallRequest, Relay | None, Reading | None]:
        """After the egress decision allowed ``request`` to ``target``: the request to run,
        where its stream may go (None: the answer is read whole) and what reading it
        learned for the record (None: nothing), its refusal among it
        (:class:`gateway.call.record.Reading`: nothing is sent). Raises the GatewayError
        that refuses it when there is nothing else to record."""

    def answered(self, ctx: CallContext, response: ExternalCallResponse) -> ExternalCallResponse:
        """The call's answer, as this API gives it back (read, filtered)."""

    def records(self, ctx: CallContext, record: dict[str, Any]) -> list[dict[str, Any]]:
        """The audit records of the call, from its one record."""

    def labels(self, ctx: CallContext, record: dict[str, Any]) -> tuple[str, str, str] | None:
        """``(method, tool, outcome)`` of the MCP metrics for one record, or None (not an
        MCP exchange)."""


# -- each API's hooks ------------------------------------------------------------------


class _Exchanges:
    """Audit records and metric labels: one per JSON-RPC request of an MCP exchange."""

    records = staticmethod(mcp.audit_records)

    def labels(self, ctx: CallContext, record: dict[str, Any]) -> tuple[str, str, str] | None:
        return mcp.metric_labels(ctx, record) if ctx.mcp is not None else None


class _Envelope(_Exchanges):
    """An envelope: an MCP target's rules on its ``parameters``
    (:func:`gateway.call.mcp.check_envelope`); its answer read whole (never relayed: it
    is filtered) and filtered."""

    def checked(
        self,
        request: ExternalCallRequest,
        target: CompiledTarget,
        ctx: CallContext,
        relay: Relay | None,
    ) -> tuple[ExternalCallRequest, Relay | None, Reading | None]:
        _agent_route_only(target)
        if target.spec.database is not None:  # a named statement (gateway.database)
            return request, None, _statement(request, target.spec.database.statements)
        if target.spec.mcp is None:
            return request, relay, None
        checked, reading = mcp.check_envelope(request, target)
        return checked, None, reading

    answered = staticmethod(mcp.read_envelope_answer)


class _Route(_Exchanges):
    """The MCP route (``/mcp/{target}``): checked at intake
    (:func:`gateway.call.mcp.mcp_intake`); its answer read
    (:func:`gateway.call.mcp.read_route_answer`), its stream by the route's relay."""

    def checked(
        self,
        request: ExternalCallRequest,
        target: CompiledTarget,
        ctx: CallContext,
        relay: Relay | None,
    ) -> tuple[ExternalCallRequest, Relay | None, Reading | None]:
        return request, relay, None

    answered = staticmethod(mcp.read_route_answer)


class _DropIn:
    """A drop-in route (``/proxy/...``): an MCP target is refused (the route would pass
    batches and lists unread); the rest as it comes."""

    def checked(
        self,
        request: ExternalCallRequest,
        target: CompiledTarget,
        ctx: CallContext,
        relay: Relay | None,
    ) -> tuple[ExternalCallRequest, Relay | None, Reading | None]:
        if target.spec.mcp is not None:
            raise PermissionDenied(
                f"target {target.name!r} is an MCP server: point the MCP client at "
                f"/mcp/{target.name}",
                details={"reason": "mcp_route_only"},
            )
        _agent_route_only(target)
        if target.spec.database is not None:
            raise InvalidPayload(
                f"target {target.name!r} is a database: call it with an envelope naming a "
                "statement (POST /v1/calls), not through a drop-in route",
                details={"reason": "not_for_database", "target": target.name},
            )
        return request, relay, None

    def answered(self, ctx: CallContext, response: ExternalCallResponse) -> ExternalCallResponse:
        return response

    def records(self, ctx: CallContext, record: dict[str, Any]) -> list[dict[str, Any]]:
        return [record]

    def labels(self, ctx: CallContext, record: dict[str, Any]) -> tuple[str, str, str] | None:
        return None


class _A2a:
    """The A2A route (``/a2a/{target}``): checked at intake
    (:func:`gateway.call.a2a.a2a_intake`); a message carries the chain in its
    ``metadata`` (:func:`gateway.call.a2a.checked`); its answer read
    (:func:`gateway.call.a2a.read_answer`); one record per JSON-RPC request."""

    def checked(
        self,
        request: ExternalCallRequest,
        target: CompiledTarget,
        ctx: CallContext,
        relay: Relay | None,
    ) -> tuple[ExternalCallRequest, Relay | None, Reading | None]:
        request, relay = a2a.checked(request, ctx, relay)
        return request, relay, None

    answered = staticmethod(a2a.read_answer)
    records = staticmethod(a2a.audit_records)

    def labels(self, ctx: CallContext, record: dict[str, Any]) -> tuple[str, str, str] | None:
        return None


def _statement(request: ExternalCallRequest, statements: dict[str, StatementSpec]) -> Reading:
    """A database target's call: the statement ``request`` names, bound
    (:func:`gateway.database.bind`), or its refusal, in a record of ``api: database``."""
    try:
        return Reading("database", bind(request, statements), DbLog())
    except Exception as exc:  # noqa: BLE001 - the pipeline raises it (ctx.read)
        return Reading("database", db=DbLog(), refusal=exc)


def _agent_route_only(target: CompiledTarget) -> None:
    """An A2A target is reached at ``/a2a/{target}`` only: elsewhere its requests would
    pass unread (methods, the chain in the message, the card unchecked)."""
    if target.spec.a2a is not None:
        raise PermissionDenied(
            f"target {target.name!r} is an A2A agent: point the A2A client at /a2a/{target.name}",
            details={"reason": "a2a_route_only"},
        )


#: The hooks of each API's pipeline entry point.
ENVELOPE: Final = _Envelope()
ROUTE: Final = _Route()
DROP_IN: Final = _DropIn()
A2A: Final = _A2a()

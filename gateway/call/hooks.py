"""What an API adds to the stages every call shares (:mod:`gateway.call.pipeline`).

The pipeline runs the same stages for every API; where an API reads a kind of target its
own way (an MCP target's rules on an envelope's ``parameters``, on an MCP route's body,
or refused on a drop-in route), its entry point hands the pipeline a :class:`CallHooks`
(:mod:`gateway.call.mcp` defines one per API), so that no stage branches on the API.
"""

from __future__ import annotations

from typing import Any, Protocol

from gateway.call.record import CallContext
from gateway.call.relay import Relay
from gateway.envelope import ExternalCallRequest, ExternalCallResponse
from gateway.policy import CompiledTarget


class CallHooks(Protocol):
    """An API's part in the shared stages, pure (no I/O)."""

    def checked(
        self,
        request: ExternalCallRequest,
        target: CompiledTarget,
        ctx: CallContext,
        relay: Relay | None,
    ) -> tuple[ExternalCallRequest, Relay | None]:
        """After the egress decision allowed ``request`` to ``target``: the request to run
        and where its stream may go (None: the answer is read whole). Raises the
        GatewayError that refuses it (nothing is sent)."""

    def answered(self, ctx: CallContext, response: ExternalCallResponse) -> ExternalCallResponse:
        """The call's answer, as this API gives it back (read, filtered)."""

    def records(self, ctx: CallContext, record: dict[str, Any]) -> list[dict[str, Any]]:
        """The audit records of the call, from its one record."""

    def labels(self, ctx: CallContext, record: dict[str, Any]) -> tuple[str, str, str] | None:
        """``(method, tool, outcome)`` of the MCP metrics for one record, or None (not an
        MCP exchange)."""

"""What the sidecar knows of A2A's JSON-RPC (pure, no I/O): a request read, its method
checked against a target's ``a2a.methods``, the task and context ids it names, the call
chain written into its message's ``metadata``, and a task stream's events judged
(design.md, "Agents calling agents"; the A2A specification, sections 7 and 9, and the
a2a-sdk's ``JsonRpcDispatcher``).

A task stream (``message/stream``, ``tasks/resubscribe``; 1.0: ``SendStreamingMessage``,
``SubscribeToTask``) is complete at its final event: 0.3's status update with
``final: true``, or (both versions) a message, a task or status in a terminal or
interrupted state (``completed``, ``failed``, ``canceled``, ``rejected``,
``input-required``, ``auth-required``; 1.0 spells them ``TASK_STATE_COMPLETED``...), or
a JSON-RPC error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

from gateway.policy.a2a import A2aSpec
from gateway.providers.mcp import EGRESS_ERROR, INVALID_REQUEST, PARSE_ERROR, glob_match

__all__ = ["EGRESS_ERROR", "INVALID_REQUEST", "PARSE_ERROR", "A2aExchange", "A2aProtocolError"]

#: The methods whose answer is a task stream.
STREAM_METHODS: Final = frozenset(
    {"message/stream", "tasks/resubscribe", "SendStreamingMessage", "SubscribeToTask"}
)
#: The methods that send a message (whose ``metadata`` carries the chain).
MESSAGE_METHODS: Final = frozenset(
    {"message/send", "message/stream", "SendMessage", "SendStreamingMessage"}
)
#: Task states after which a stream ends (A2A 0.3 ``TaskState``; 1.0 ``TASK_STATE_*``).
FINAL_STATES: Final = frozenset(
    {"completed", "failed", "canceled", "rejected", "input-required", "auth-required"}
)
#: Where the chain goes in a message's ``metadata`` (the header names: the inbound route
#: reads them as it reads headers).
CHAIN_METADATA_KEYS: Final = (
    "x-egress-call-chain",
    "x-egress-deadline",
    "x-egress-call-chain-sig",
)
_ID_LIMIT: Final = 256
#: 1.0's event wrappers, as 0.3's ``kind``.
_KINDS: Final = {"statusUpdate": "status-update", "artifactUpdate": "artifact-update"}


class A2aProtocolError(Exception):
    """A body that is not one A2A JSON-RPC request (``code``: the JSON-RPC error)."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _state(value: Any) -> str | None:
    """A task state, in 0.3's spelling (``TASK_STATE_INPUT_REQUIRED`` -> ``input-required``)."""
    if not isinstance(value, str):
        return None
    if value.startswith("TASK_STATE_"):
        return value[len("TASK_STATE_") :].lower().replace("_", "-")
    return value


def _short(value: Any) -> str | None:
    return value[:_ID_LIMIT] if isinstance(value, str) and value else None


@dataclass(slots=True)
class A2aExchange:
    """One JSON-RPC request to an A2A agent and what its answer said: ``method``, ``id``,
    the ``task_id`` and ``context_id`` it concerns (from the request, else the answer),
    ``final`` (a stream's final event came), ``error_code`` (a JSON-RPC error answered)."""

    method: str
    id: Any
    params: dict[str, Any]
    task_id: str | None = None
    context_id: str | None = None
    final: bool = False
    error_code: int | None = None
    events: int = 0
    body: dict[str, Any] = field(default_factory=dict)

    @property
    def streams(self) -> bool:
        return self.method in STREAM_METHODS

    def read(self, value: Any) -> None:
        """Read one JSON-RPC answer (a whole body, or one stream event's data)."""
        if not isinstance(value, dict):
            return
        self.events += 1
        error = value.get("error")
        if isinstance(error, dict):
            code = error.get("code")
            self.error_code = code if isinstance(code, int) else INVALID_REQUEST
            self.final = True
            return
        result = value.get("result")
        if isinstance(result, dict):
            self._result(result)

    def _result(self, result: dict[str, Any]) -> None:
        # 1.0 wraps each event: {"task": ...}, {"message": ...}, {"statusUpdate": ...}...
        for key in ("task", "message", "statusUpdate", "artifactUpdate"):
            inner: Any = result.get(key)
            if isinstance(inner, dict):
                result = {**inner, "kind": _KINDS.get(key, key)}
                break
        kind: Any = result.get("kind")
        task_id = result.get("id") if kind == "task" else result.get("taskId")
        self.task_id = self.task_id or _short(task_id)
        self.context_id = self.context_id or _short(result.get("contextId"))
        status = result.get("status")
        state = _state(status.get("state")) if isinstance(status, dict) else None
        if (
            kind == "message"
            or result.get("final") is True
            or state in FINAL_STATES
            or (kind is None and "parts" in result and "role" in result)
        ):
            self.final = True


def parse_request(body: bytes) -> A2aExchange:
    """The one JSON-RPC 2.0 request of ``body`` (A2A has no batches). Raises
    :class:`A2aProtocolError`."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        raise A2aProtocolError(PARSE_ERROR, "parse_error", "the body is not JSON") from None
    if isinstance(value, list):
        raise A2aProtocolError(INVALID_REQUEST, "batch", "A2A takes one request per body")
    if not isinstance(value, dict) or value.get("jsonrpc") != "2.0":
        raise A2aProtocolError(INVALID_REQUEST, "not_jsonrpc", "not a JSON-RPC 2.0 request")
    method, ident = value.get("method"), value.get("id")
    if not isinstance(method, str) or not method:
        raise A2aProtocolError(INVALID_REQUEST, "no_method", "the request names no method")
    if ident is None or isinstance(ident, bool) or not isinstance(ident, str | int):
        raise A2aProtocolError(
            INVALID_REQUEST, "no_id", "an A2A request needs an id (string or number)"
        )
    params = value.get("params")
    params = params if isinstance(params, dict) else {}
    exchange = A2aExchange(method[:128], ident, params, body=value)
    message = params.get("message")
    if isinstance(message, dict):
        exchange.task_id = _short(message.get("taskId"))
        exchange.context_id = _short(message.get("contextId"))
    else:
        exchange.task_id = _short(params.get("id")) or _short(params.get("taskId"))
    return exchange


def method_refusal(spec: A2aSpec, method: str) -> str | None:
    """Why ``method`` may not be sent to the agent (the rule), or None when it may."""
    rules = spec.methods
    denied = next((p for p in rules.deny if glob_match(p, method)), None)
    if denied is not None:
        return f"deny:{denied}"
    if not any(glob_match(p, method) for p in rules.allow):
        return "allow"
    return None


def said(exchange: A2aExchange) -> dict[str, Any]:
    """What a request says, as a person reads it (an approval) and as the repeated-call
    breaker counts it: its method and params, less what changes on every send (the
    JSON-RPC id, the message's id, the call chain in the message's ``metadata``)."""
    params = dict(exchange.params)
    message = params.get("message")
    if isinstance(message, dict):
        kept = {k: v for k, v in message.items() if k not in ("messageId", "metadata")}
        metadata = message.get("metadata")
        if isinstance(metadata, dict):
            metadata = {k: v for k, v in metadata.items() if k not in CHAIN_METADATA_KEYS}
        if metadata:
            kept["metadata"] = metadata
        params["message"] = kept
    return {"a2a_method": exchange.method, "params": params}


def with_chain(exchange: A2aExchange, headers: dict[str, str]) -> dict[str, Any] | None:
    """The request with the chain ``headers`` in its message's ``metadata`` (what the
    agent's own ``metadata`` said of the chain replaced), or None when it sends no message."""
    message = exchange.params.get("message")
    if exchange.method not in MESSAGE_METHODS or not isinstance(message, dict):
        return None
    metadata = message.get("metadata")
    kept = {
        k: v
        for k, v in (metadata.items() if isinstance(metadata, dict) else ())
        if k not in CHAIN_METADATA_KEYS
    }
    message = {**message, "metadata": {**kept, **headers}}
    return {**exchange.body, "params": {**exchange.params, "message": message}}


def chain_in_body(value: Any) -> dict[str, str] | None:
    """The chain a request carries in its message's ``metadata`` (lower-case names, as
    :func:`gateway.agents.chain.from_headers` reads them), or None."""
    params = value.get("params") if isinstance(value, dict) else None
    message = params.get("message") if isinstance(params, dict) else None
    metadata = message.get("metadata") if isinstance(message, dict) else None
    if not isinstance(metadata, dict):
        return None
    found = {k: v for k in CHAIN_METADATA_KEYS if isinstance(v := metadata.get(k), str)}
    return found or None

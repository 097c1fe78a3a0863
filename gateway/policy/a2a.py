"""The ``a2a:`` section of a target: an A2A agent's methods, card and task bounds (README,
"Agents calling agents"; design.md, "Agents calling agents: the call chain and A2A
targets").

A target with ``a2a:`` is an A2A agent spoken to with JSON-RPC over HTTP (protocol 0.3
and 1.0). Its ``base_url`` is the agent's base URL: the Agent Card is at
``/.well-known/agent-card.json`` under it (the older ``/.well-known/agent.json`` too) and
JSON-RPC requests go to ``rpc_path``, so it has no ``endpoints`` list::

    a2a:
      agent_id: executor-02          # the called agent's id: the call chain's target agent
      methods:
        allow: ["message/send", "message/stream", "tasks/*", "SendMessage", "GetTask"]
        deny: ["tasks/pushNotificationConfig/*"]
      rpc_path: /                    # where the agent's JSON-RPC endpoint is
      card: {verify: true, public_key: "-----BEGIN PUBLIC KEY-----...", algorithms: [ES256]}
      task_ttl_s: 3600               # a task's life, apart from one request's deadline

The rules' evaluation is pure and lives in :mod:`gateway.providers.a2a`.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import Field, StringConstraints, field_validator

from gateway.policy.stores import StrictModel

#: Every JSON-RPC method of A2A: protocol 0.3's names and 1.0's (the a2a-sdk's
#: ``JsonRpcDispatcher.METHOD_TO_MODEL``).
METHODS_V03: Final = (
    "message/send",
    "message/stream",
    "tasks/get",
    "tasks/list",
    "tasks/cancel",
    "tasks/resubscribe",
    "tasks/pushNotificationConfig/set",
    "tasks/pushNotificationConfig/get",
    "tasks/pushNotificationConfig/list",
    "tasks/pushNotificationConfig/delete",
    "agent/getAuthenticatedExtendedCard",
)
METHODS_V10: Final = (
    "SendMessage",
    "SendStreamingMessage",
    "GetTask",
    "ListTasks",
    "CancelTask",
    "SubscribeToTask",
    "CreateTaskPushNotificationConfig",
    "GetTaskPushNotificationConfig",
    "ListTaskPushNotificationConfigs",
    "DeleteTaskPushNotificationConfig",
    "GetExtendedAgentCard",
)
#: The card's well-known paths (A2A 0.3 and 1.0: agent-card.json; before 0.3: agent.json).
CARD_PATHS: Final = ("/.well-known/agent-card.json", "/.well-known/agent.json")
DEFAULT_TASK_TTL_S: Final = 3600.0
MAX_TASK_TTL_S: Final = 7 * 86400.0
DEFAULT_CARD_TTL_S: Final = 300.0
MAX_CARD_TTL_S: Final = 86400.0
DEFAULT_INBOUND_TIMEOUT_S: Final = 300.0
MAX_INBOUND_TIMEOUT_S: Final = 3600.0
MethodGlob = Annotated[str, StringConstraints(min_length=1, max_length=128)]
Algorithm = Literal["ES256", "ES384", "ES512", "RS256", "RS384", "RS512", "PS256", "EdDSA"]


class MethodRules(StrictModel):
    """Which JSON-RPC methods may be sent: a name must match ``allow`` and no ``deny``
    (``*`` matches any run of characters)."""

    allow: list[MethodGlob] = Field(default_factory=lambda: ["*"])  # methods that may be sent
    deny: list[MethodGlob] = Field(default_factory=list)  # methods refused; deny wins


def _default_algorithms() -> list[Algorithm]:
    return ["ES256", "RS256", "EdDSA"]


class CardSpec(StrictModel):
    """The Agent Card's check: with ``verify``, a card without a valid JWS signature
    (A2A ``AgentCardSignature``, over the card's RFC 8785 form) by the signer's public
    key is refused. The key is ``public_key`` (PEM or a JWK, in the policy: it is public)
    or ``public_key_ref`` (a secret reference to a JWK on one line, as secret values
    hold no newline). ``ttl_s``: how long a checked card is trusted before it is fetched
    again."""

    verify: bool = False  # refuse a card without a valid signature by the signer's key
    public_key: str | None = Field(
        None, min_length=1, max_length=16384, description="the signer's public key, PEM or JWK"
    )
    public_key_ref: str | None = None  # or a secret reference to it (a JWK on one line)
    algorithms: list[Algorithm] = Field(
        default_factory=_default_algorithms,
        description="JWS algorithms accepted (asymmetric only: the card is public)",
    )
    ttl_s: float = Field(DEFAULT_CARD_TTL_S, gt=0, le=MAX_CARD_TTL_S)  # a checked card, trusted


class A2aSpec(StrictModel):
    agent_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$",
        description="the called agent's id: the call chain's target agent",
    )
    methods: MethodRules = Field(default_factory=MethodRules)  # JSON-RPC methods allowed
    rpc_path: str = Field("/", pattern=r"^/[A-Za-z0-9_.~\-/]*$")  # the JSON-RPC endpoint
    card: CardSpec = Field(default_factory=CardSpec)  # the Agent Card's check
    task_ttl_s: float = Field(DEFAULT_TASK_TTL_S, gt=0, le=MAX_TASK_TTL_S)  # a task's life, s

    @field_validator("card")
    @classmethod
    def _key(cls, v: CardSpec) -> CardSpec:
        if v.verify and (v.public_key is None) == (v.public_key_ref is None):
            raise ValueError(
                "card.verify needs the signer's public key: card.public_key or "
                "card.public_key_ref (one of them)"
            )
        return v


class InboundSpec(StrictModel):
    """``inbound:``: the local agent's own A2A server, reached by calls to this agent
    through ``/a2a/in/{path}`` (its base URL, loopback as a rule)."""

    agent_url: str  # the agent's own A2A server (base URL)
    timeout_s: float = Field(
        DEFAULT_INBOUND_TIMEOUT_S,
        gt=0,
        le=MAX_INBOUND_TIMEOUT_S,
        description="a call to the agent's deadline without x-egress-timeout, seconds",
    )


def check_a2a_target(spec: Any) -> Any:
    """A ``TargetSpec`` validator (after): an A2A target has no ``endpoints`` (its card's
    paths and ``rpc_path`` are its endpoints), no ``mcp`` and no ``idempotency``
    (JSON-RPC ids pair its requests and answers)."""
    if spec.a2a is None:
        return spec
    if spec.endpoints is not None or spec.mcp is not None:
        raise ValueError("an A2A target has no 'endpoints' or 'mcp': its card names its paths")
    if spec.idempotency is not None:
        raise ValueError("'idempotency' does not apply to an A2A target")
    return spec

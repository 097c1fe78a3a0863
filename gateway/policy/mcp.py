"""The ``mcp:`` section of a target: an MCP server's tool and argument rules (README, "MCP
targets"; design.md, "MCP targets").

A target with ``mcp:`` is an MCP server spoken to over streamable HTTP (MCP 2025-11-25,
"Transports"; 2026-07-28 too). Its ``base_url`` is the MCP endpoint itself
(``https://mcp.example.com/mcp``), so it has no ``endpoints`` list: the one endpoint is
that path, for POST (JSON-RPC messages), GET (the server's event stream) and DELETE (end
of a session)::

    mcp:
      tools:
        allow: ["search_*", "get_issue"]     # default ["*"]; '*' matches any run of characters
        deny: ["delete_*"]                   # default []; deny wins over allow
      arguments:                             # per tool name (or glob): per argument
        create_issue:
          repo: {pattern: "acme/[a-z-]+"}    # the whole string must match
          title: {max_length: 200, required: true}
          priority: {enum: [low, normal, high]}
      tools_rate_limit_group: mcp-tools      # tools/call counted here; the rest in rate_limit_group

The evaluation of these rules is pure and lives in :mod:`gateway.providers.mcp`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

from pydantic import Field, StringConstraints, field_validator

from gateway.envelope import HttpMethod
from gateway.policy import defaults as d
from gateway.policy.stores import StrictModel

#: The methods of the one endpoint of an MCP target (streamable HTTP: POST, GET, DELETE).
MCP_METHODS: Final[frozenset[HttpMethod]] = frozenset({"POST", "GET", "DELETE"})
#: A tool name or glob (MCP 2025-11-25 "Tools": names of 1-128 characters).
ToolGlob = Annotated[str, StringConstraints(min_length=1, max_length=128)]
Scalar = str | int | float | bool | None
ArgumentType = Literal["string", "number", "integer", "boolean", "object", "array", "null"]


class ArgumentRule(StrictModel):
    """Constraints on one argument of a tool call; every key given must hold.

    ``pattern``: a Python regular expression the whole string must match (``re.fullmatch``);
    ``enum``: the allowed values (JSON scalars, compared by type and value); ``max_length``
    / ``min_length``: the string's length in characters; ``minimum`` / ``maximum``: bounds
    of a number (inclusive); ``type``: the JSON type; ``required``: the argument must be
    present (otherwise an absent argument passes every other rule)."""

    pattern: str | None = None
    enum: list[Scalar] | None = Field(None, min_length=1)
    max_length: int | None = Field(None, ge=0, le=d.MAX_ARGUMENT_LENGTH)
    min_length: int | None = Field(None, ge=0, le=d.MAX_ARGUMENT_LENGTH)
    minimum: float | None = Field(None, ge=-d.MAX_ARGUMENT_NUMBER, le=d.MAX_ARGUMENT_NUMBER)
    maximum: float | None = Field(None, ge=-d.MAX_ARGUMENT_NUMBER, le=d.MAX_ARGUMENT_NUMBER)
    type: ArgumentType | None = None
    required: bool = False

    @field_validator("pattern")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return v


class ToolRules(StrictModel):
    """Which tools may be called and listed: a name must match ``allow`` and no ``deny``."""

    allow: list[ToolGlob] = Field(default_factory=lambda: ["*"])
    deny: list[ToolGlob] = Field(default_factory=list)


class McpSpec(StrictModel):
    tools: ToolRules = Field(default_factory=ToolRules)
    arguments: dict[ToolGlob, dict[str, ArgumentRule]] = Field(default_factory=dict)
    #: The rate-limit group of ``tools/call`` requests (none: the target's group, as for
    #: the protocol's other messages).
    tools_rate_limit_group: str | None = None


def check_target(spec: Any) -> Any:
    """A ``TargetSpec`` validator (after): a target without ``mcp`` needs ``endpoints``;
    an MCP target has none (its ``base_url`` is the endpoint) and no ``idempotency``
    (JSON-RPC ids, not HTTP keys, pair its requests and answers)."""
    if spec.database is not None:
        return spec  # gateway.policy.database.check_target
    if spec.mcp is None and spec.a2a is None and not spec.endpoints:
        raise ValueError("a target needs 'endpoints' (or 'mcp' for an MCP server)")
    if spec.mcp is not None and spec.endpoints is not None:
        raise ValueError(
            "an MCP target has no 'endpoints': its base_url is the MCP endpoint itself"
        )
    if spec.mcp is not None and spec.idempotency is not None:
        raise ValueError("'idempotency' does not apply to an MCP target")
    return spec

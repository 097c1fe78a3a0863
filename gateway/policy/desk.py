"""The operator's desk in the policy: ``operators:``, ``approvals:``, ``dead_letters:``
and, on a target, ``approval:`` and ``dead_letter:`` (design.md, "Approvals, dead
letters and the operator console"; docs/features/approvals.md).

```yaml
operators:                         # who may use the ops routes, the CLI and the console
  alice: {token_ref: env://ALICE_OPERATOR_TOKEN}   # (the stop switch's controls.
                                   # operator_token_ref counts too, as operator "operator")
approvals: {scope: cluster}        # local (default) or cluster (shared through redis:)
dead_letters: {max_count: 1000, max_bytes: 16777216}
targets:
  payments:
    approval:
      tools: ["refund_*"]                                  # MCP tools/call names (globs)
      endpoints: [{path: "/v1/payouts*", methods: [POST]}] # or endpoints (globs) and methods
      approvers: [alice]                                   # empty: any operator
      ttl_s: 900
    dead_letter: true
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

from pydantic import Field, StringConstraints, field_validator

from gateway.envelope import HttpMethod
from gateway.policy import defaults as d
from gateway.policy.refs import check_ref
from gateway.policy.stores import StrictModel

Glob = Annotated[str, StringConstraints(min_length=1, max_length=256)]
OperatorName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")]


class OperatorSpec(StrictModel):
    """One operator: the secret reference of the bearer token that identifies them."""

    token_ref: str

    @field_validator("token_ref")
    @classmethod
    def _ref(cls, v: str) -> str:
        check_ref(v)
        return v


class ApprovalEndpoint(StrictModel):
    """Endpoints (``path``: a glob over the envelope's endpoint) called with ``methods``."""

    path: Glob
    methods: list[HttpMethod] = Field(min_length=1)


class ApprovalSpec(StrictModel):
    """A target's ``approval:``: the MCP tools (name globs) and endpoints whose calls wait
    for a person's yes; ``approvers`` (operator names; empty: any operator); ``ttl_s``
    (seconds a request waits for a decision, and an approval for its call);
    ``retry_after_s`` (the ``suggested_retry_after`` of APPROVAL_PENDING, seconds)."""

    tools: list[Glob] = Field(default_factory=list)
    endpoints: list[ApprovalEndpoint] = Field(default_factory=list)
    approvers: list[OperatorName] = Field(default_factory=list)
    ttl_s: float = Field(d.DEFAULT_APPROVAL_TTL_S, gt=0, le=d.MAX_APPROVAL_TTL_S)
    retry_after_s: float = Field(d.DEFAULT_APPROVAL_RETRY_AFTER_S, gt=0, le=d.MAX_APPROVAL_TTL_S)


class ApprovalsSpec(StrictModel):
    """``approvals:``: where approval requests live (``local``: this process;
    ``cluster``: Redis, shared by every sidecar on the same Redis and key prefix)."""

    scope: Literal["local", "cluster"] = "local"


class DeadLettersSpec(StrictModel):
    """``dead_letters:``: how many dead letters this sidecar keeps (``max_count``) and how
    many bytes of stored requests (``max_bytes``); past either the oldest is dropped."""

    max_count: int = Field(d.DEFAULT_DEAD_LETTERS_MAX_COUNT, ge=1, le=d.MAX_DEAD_LETTERS_MAX_COUNT)
    max_bytes: int = Field(
        d.DEFAULT_DEAD_LETTERS_MAX_BYTES, ge=1024, le=d.MAX_DEAD_LETTERS_MAX_BYTES
    )


#: The operator a ``controls.operator_token_ref`` token (the stop switch's) stands for.
SHARED_OPERATOR: Final = "operator"


def all_operators(
    operators: Mapping[str, OperatorSpec], shared_token_ref: str | None
) -> dict[str, OperatorSpec]:
    """Every operator: ``operators:``, and with the stop switch's
    ``controls.operator_token_ref``, :data:`SHARED_OPERATOR` holding that token (unless
    ``operators`` names one so)."""
    found = dict(operators)
    if shared_token_ref is not None:
        found.setdefault(SHARED_OPERATOR, OperatorSpec(token_ref=shared_token_ref))
    return found


def problems(
    operators: Mapping[str, OperatorSpec],
    approvals: ApprovalsSpec,
    targets: Mapping[str, Any],
    has_redis: bool,
) -> list[tuple[tuple[str, ...], str]]:
    """Cross-references of the desk's keys (``targets``: the policy's TargetSpecs, read
    for their ``approval``): ``(key path, message)`` for each problem."""
    found: list[tuple[tuple[str, ...], str]] = []
    if approvals.scope == "cluster" and not has_redis:
        found.append((("approvals", "scope"), "'cluster' needs a redis section"))
    for name, target in targets.items():
        spec: ApprovalSpec | None = target.approval
        if spec is None:
            continue
        if not spec.tools and not spec.endpoints:
            message = "names no tools and no endpoints: nothing would be held"
            found.append((("targets", name, "approval"), message))
        if not operators:
            message = "needs an operators section (nobody could approve)"
            found.append((("targets", name, "approval"), message))
        for who in spec.approvers:
            if who not in operators:
                known = ", ".join(sorted(operators)) or "none"
                message = f"no operator {who!r} (known: {known})"
                found.append((("targets", name, "approval", "approvers"), message))
    return found

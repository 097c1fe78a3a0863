"""The policy root: the whole file's model (:class:`Policy`), one key per section, and the
checks across its sections.

Each section's model is defined with its own rules elsewhere (:mod:`gateway.policy.models`
for the server, egress, targets, rate-limit groups and telemetry; a module of its own for
each other section: ``stores``, ``budgets``, ``chain``, ``agents``, ``controls``,
``desk``...). What only the whole file can check, a key that names another section's
entry (a target's rate-limit group, a ``vault://`` reference without ``secrets.vault``, a
``cluster`` scope without ``redis``...), is checked here, all problems at once, each
with its key path (the loader names their lines).
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from gateway.policy import desk
from gateway.policy.a2a import InboundSpec
from gateway.policy.agents import Agents, agent_problems
from gateway.policy.budgets import BudgetSpec, ModelName, PriceSpec, budget_problems
from gateway.policy.chain import ChainSpec, chain_problems, propagation_problems
from gateway.policy.controls import ControlsSpec, controls_problems
from gateway.policy.database import database_problems
from gateway.policy.failover import fallback_problems
from gateway.policy.modelrules import model_problems
from gateway.policy.models import (
    EgressSpec,
    EnvelopeSpec,
    Name,
    RateLimitGroupSpec,
    ServerSpec,
    TargetSpec,
    TelemetrySpec,
)
from gateway.policy.stores import AuditSpec, RedisSpec, SecretsSpec
from gateway.policy.stores import StrictModel as _Strict
from gateway.urls import URL


class Policy(_Strict):
    """The whole policy file, as written."""

    version: Literal[1]
    agent_id: Name
    server: ServerSpec = Field(default_factory=ServerSpec)
    envelope: EnvelopeSpec = Field(default_factory=EnvelopeSpec)
    egress: EgressSpec = Field(default_factory=EgressSpec)
    targets: dict[Name, TargetSpec] = Field(default_factory=dict)  # empty: deny everything
    rate_limit_groups: dict[Name, RateLimitGroupSpec] = Field(default_factory=dict)
    secrets: SecretsSpec = Field(default_factory=SecretsSpec)
    redis: RedisSpec | None = None
    audit: AuditSpec = Field(default_factory=AuditSpec)
    telemetry: TelemetrySpec = Field(default_factory=TelemetrySpec)
    budgets: dict[Name, BudgetSpec] = Field(default_factory=dict)  # gateway.policy.budgets
    prices: dict[ModelName, PriceSpec] = Field(default_factory=dict)
    chain: ChainSpec = Field(default_factory=ChainSpec)  # gateway.policy.chain
    #: The local agent's own A2A server, behind ``/a2a/in/{path}`` (gateway.policy.a2a).
    inbound: InboundSpec | None = None  # the agent's own A2A server, behind /a2a/in
    agents: Agents = Field(default_factory=dict)  # gateway.policy.agents; empty: agent_id
    controls: ControlsSpec = Field(default_factory=ControlsSpec)  # gateway.policy.controls
    operators: dict[Name, desk.OperatorSpec] = Field(default_factory=dict)  # gateway.policy.desk
    approvals: desk.ApprovalsSpec = Field(default_factory=desk.ApprovalsSpec)
    dead_letters: desk.DeadLettersSpec = Field(default_factory=desk.DeadLettersSpec)

    @model_validator(mode="after")
    def _cross_references(self) -> Policy:
        """Keys that refer to other sections. Raises one ``cross_reference`` error whose
        ``ctx["problems"]`` is a tuple of ``(key path tuple, message)``, so the loader can
        name each key and its line."""
        problems: list[tuple[tuple[str | int, ...], str]] = []
        no_redis = "'cluster' needs a redis section"
        for name, target in self.targets.items():
            problems += self._target_problems(name, target)
        for name, group_spec in self.rate_limit_groups.items():
            if group_spec.scope == "cluster" and self.redis is None:
                problems.append((("rate_limit_groups", name, "scope"), no_redis))
        groups, has_redis = set(self.rate_limit_groups), self.redis is not None
        usage = {name: spec.usage for name, spec in self.targets.items()}
        problems += budget_problems(self.budgets, usage, groups, has_redis)
        has_vault = self.secrets.vault is not None
        problems += [*chain_problems(self.chain, has_vault), *propagation_problems(self.targets)]
        problems += agent_problems(self.agents, self.targets, self.budgets, has_vault, groups)
        problems += controls_problems(self.controls, has_redis, has_vault)
        problems += fallback_problems(self.targets, self.agents)
        problems += model_problems(self.targets, self.agents)
        operators = desk.all_operators(self.operators, self.controls.operator_token_ref)
        problems += desk.problems(operators, self.approvals, self.targets, has_redis)
        if problems:
            raise PydanticCustomError(
                "cross_reference",
                "{summary}",
                {
                    "summary": "\n".join(
                        f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in problems
                    ),
                    "problems": tuple(problems),
                },
            )
        return self

    def _target_problems(
        self, name: str, target: TargetSpec
    ) -> list[tuple[tuple[str | int, ...], str]]:
        """One target's keys that refer to other sections: its rate-limit groups, its
        secret references' store, its database, its address against the egress policy,
        a cluster idempotency store without redis. Each is ``(key path, message)``."""
        problems: list[tuple[tuple[str | int, ...], str]] = []

        def problem(*loc: str, message: str) -> None:
            problems.append((loc, message))

        tools_group = target.mcp.tools_rate_limit_group if target.mcp else None
        for key, group in (("rate_limit_group", target.rate_limit_group),
                           ("mcp.tools_rate_limit_group", tools_group)):  # fmt: skip
            if group is not None and group not in self.rate_limit_groups:
                known = ", ".join(sorted(self.rate_limit_groups)) or "none"
                message = f"no rate-limit group {group!r} (known: {known})"
                problem("targets", name, *key.split("."), message=message)
        for ref in sorted(target.credential.permitted_refs() if target.credential else ()):
            if ref.startswith("vault://") and self.secrets.vault is None:
                problem(
                    "targets", name, "credential", message=f"{ref!r} needs a secrets.vault section"
                )
        db = target.database
        if db is not None:
            problems += database_problems(name, db, self.secrets.vault is not None)
        host = (db.host() if db else URL(target.base_url or "").host) or ""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            address = None
        if address is not None and not self.egress.allows(address):
            message = (
                f"{host} is not allowed by the egress policy (not a public address, or in "
                "egress.deny_cidrs); list it in egress.allow_cidrs to allow it"
            )
            problem("targets", name, "database" if db else "base_url", message=message)
        idempotency = target.idempotency
        if idempotency and idempotency.scope == "cluster" and self.redis is None:
            problem(
                "targets", name, "idempotency", "scope", message="'cluster' needs a redis section"
            )
        return problems

"""What a component of :mod:`gateway.server.components` is, and what a reload makes of
the list of them.

:class:`Component` is one part the policy drives: it builds its part onto :class:`Parts`
at start (handing every resource it opens to the runtime's ``AsyncExitStack``) and
takes in a new policy on reload; its :class:`Keys` say which policy keys it reads. From
those, :func:`hot_keys` (what a reload applies at once) and :func:`restart_needed`
(which changed sections need a restart) are computed over a list of components, so a
part cannot be left out of either.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, ClassVar, Protocol

from gateway import audit, telemetry
from gateway.agents.controls import Controls
from gateway.agents.identity import Agents
from gateway.breaker import CircuitBreakers
from gateway.budgets import Budgets
from gateway.call.pipeline import Pipeline
from gateway.database.registry import Databases
from gateway.idempotency.scopes import IdempotencyStores
from gateway.metrics import Metrics
from gateway.policy import PolicySet
from gateway.ratelimit import RateLimitGroups
from gateway.secrets import SecretResolvers
from gateway.upstream import Resolver, Upstream

if TYPE_CHECKING:
    # Imported at build only with a ``redis:`` section: redis-py is 6.7 MiB of RSS.
    from gateway.ratelimit.cluster import ClusterLimits
    from gateway.stores.redis import RedisClient


@dataclass(frozen=True, slots=True)
class Keys:
    """The policy keys a component reads.

    ``hot``: keys or ``section.key`` paths it takes in on reload (:meth:`Component.apply`).
    ``restart``: top-level sections it reads at start only; a reload that changes one
    (outside the ``hot`` paths of any component) reports it in ``restart_needed_for``.
    ``start_only``: sections read at start only that a reload neither applies nor
    reports (``telemetry``'s tracing settings, as docs/operations.md says; ``audit``).
    """

    hot: tuple[str, ...] = ()
    restart: tuple[str, ...] = ()
    start_only: tuple[str, ...] = ()


class Parts:
    """What the components built, for the components after them and for the runtime.

    ``metrics``, ``dns_resolver`` and ``log_stream`` are given; the others are set by the
    component that builds them (reading one before its builder ran is a programming
    error: AttributeError).
    """

    audit: audit.AuditLog
    upstream: Upstream
    resolvers: SecretResolvers
    redis: RedisClient | None
    cluster_limits: ClusterLimits | None
    idempotency: IdempotencyStores
    tracer: telemetry.Telemetry
    groups: RateLimitGroups
    breakers: CircuitBreakers
    budgets: Budgets
    controls: Controls
    databases: Databases
    pipeline: Pipeline
    agents: Agents

    def __init__(
        self, metrics: Metrics, *, dns_resolver: Resolver | None, log_stream: IO[str] | None
    ) -> None:
        self.metrics = metrics
        self.dns_resolver = dns_resolver
        self.log_stream = log_stream


class Component(Protocol):
    """One part the policy drives. Built once per start; :meth:`apply` runs on the event
    loop, synchronously, so that no call sees half a reload."""

    keys: ClassVar[Keys]

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        """Build the part from ``policy`` onto ``parts``; push each resource's close onto
        ``stack`` as soon as it is open. Raises what the part raises (ValueError for an
        unusable section)."""

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        """Take in a new policy (its ``hot`` keys); calls in flight keep what they hold."""


def hot_keys(components: Iterable[type[Component]]) -> frozenset[str]:
    """Every key or ``section.key`` path some component takes in on reload."""
    return frozenset(key for c in components for key in c.keys.hot)


def restart_needed(
    old: PolicySet, new: PolicySet, components: Iterable[type[Component]]
) -> list[str]:
    """The sections some component reads at start only (``Keys.restart``) that differ
    between ``old`` and ``new`` outside the paths a component takes in on reload
    (``server.drain_s`` is, ``server.port`` is not); in list order, each once."""
    components = list(components)
    hot = hot_keys(components)
    changed = []
    for section in dict.fromkeys(key for c in components for key in c.keys.restart):
        applied = {key.partition(".")[2] for key in hot if key.startswith(section + ".")}
        before, after = getattr(old.policy, section), getattr(new.policy, section)
        if _without(before, applied) != _without(after, applied):
            changed.append(section)
    return changed


def _without(section: Any, keys: set[str]) -> Any:
    """A policy section with ``keys`` left out (a section that is None stays None)."""
    dump = getattr(section, "model_dump", None)
    return dump(exclude=keys) if keys and dump is not None else section

"""Tool caps: a budget's ``max_calls`` (docs/features/stopping.md): at most that many
calls per window to the MCP tools or endpoints its ``applies_to.tool`` glob names (with
its ``target`` and ``agent``, when given), counted before the call, locally or across
sidecars (``scope: cluster``), with the budgets' windows (daily, monthly, rolling).

The count rides on the budgets' own ledger (:class:`gateway.budgets.Budgets`): a cap is a
budget of ``max_calls`` units and each call books one unit at admission, never given
back (a call that went out counts, whatever it cost). Admission is atomic (one process
step locally, one Lua script in Redis), so sidecars sharing a cap never let more than
``max_calls`` calls through in a window. A call past the cap is refused with
BUDGET_EXCEEDED (``details.budget``, ``details.tool``, ``details.max_calls``,
``suggested_retry_after`` until the window frees a call); ``mode: shadow`` records it
(``budget:NAME`` in the audit record's shadow list) and lets the call go. A cap is not
matched on ``applies_to.rate_limit_group``: the call's group is decided after it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Final

from gateway.budgets import Budgets
from gateway.errors import BudgetExceeded
from gateway.policy.budgets import BudgetSpec

if TYPE_CHECKING:
    from gateway.budgets.cluster import ClusterBudgets

#: Suffix of a cap's ledger name (its Redis key), apart from the budget's USD ledger.
_SUFFIX: Final = ".calls"


class CallCaps:
    """The ``max_calls`` of a policy's budgets; ``cluster`` books ``scope: cluster`` ones
    in Redis."""

    def __init__(
        self, specs: Mapping[str, BudgetSpec], *, cluster: ClusterBudgets | None = None
    ) -> None:
        self._ledger = Budgets({}, cluster=cluster)
        self.update(specs)

    def update(self, specs: Mapping[str, BudgetSpec]) -> None:
        """Take in a reloaded policy's budgets; a cap keeps its count under its name."""
        self._specs = {name: spec for name, spec in specs.items() if spec.max_calls is not None}
        self._ledger.update(
            {
                name + _SUFFIX: spec.model_copy(update={"limit_usd": float(spec.max_calls or 0)})
                for name, spec in self._specs.items()
            }
        )

    def __bool__(self) -> bool:
        return bool(self._specs)

    async def check(self, target: str, agent: str, tools: Sequence[str]) -> list[str]:
        """Book one call against every cap that applies. Raises BUDGET_EXCEEDED (an
        enforced cap is full), CapacityExceeded (a fail-closed cluster cap without
        Redis). Returns the shadow refusals (``budget:NAME``)."""
        if not self._specs or not tools:
            return []
        applying = self._ledger.applying(target, None, agent, tools)
        if not applying:
            return []
        try:
            booking = await self._ledger.reserve(applying, 1.0)
        except BudgetExceeded as exc:
            raise _refusal(exc, self._specs, tools) from None
        return [f"budget:{name.removesuffix(_SUFFIX)}" for name in booking.shadow_denied]


def _refusal(
    exc: BudgetExceeded, specs: Mapping[str, BudgetSpec], tools: Sequence[str]
) -> BudgetExceeded:
    name = str(exc.details.get("budget", "")).removesuffix(_SUFFIX)
    spec = specs[name]
    pattern = spec.applies_to.tool
    tool = next((t for t in tools if pattern is None or fnmatchcase(t, pattern)), tools[0])
    wait = exc.retry_after_s
    when = f"; the window frees a call in {wait:.0f} s" if wait is not None else ""
    return BudgetExceeded(
        f"tool cap {name!r} allows {spec.max_calls} calls of {pattern or 'any tool'} per "
        f"{spec.window} window, and they are spent ({tool}){when}",
        details={
            "reason": "tool_cap_reached",
            "budget": name,
            "tool": tool,
            "max_calls": spec.max_calls,
            "window": spec.window,
            "scope": spec.scope,
        },
        retry_after_s=wait,
    )

"""A call's cost and budgets, between the pipeline's stages: reserve before the first
attempt, settle after the answer (:mod:`gateway.budgets`, :mod:`gateway.cost`).

Before sending (:func:`reserve`): the call's price is looked up (cheap: cached per model);
when budgets apply, its upper cost is reserved against all of them at once, or the call
is refused with BUDGET_EXCEEDED, before any upstream contact. A call whose cost cannot be
bounded (a model call of unknown price, no output cap; a billed endpoint the sidecar
cannot price, such as image generation) is refused under an enforced budget with
``on_unknown_price: refuse`` (the default: fail closed), PERMISSION_DENIED with
``details.reason`` "budget_price_unknown"; with ``allow`` it goes out reserving only its
prompt's cost (and its audit record says the cost is unknown if it stays so). A call
that costs nothing countable (a target with ``usage: none``; a GET of an LLM target's
endpoint that is not a model call) is outside every budget (:func:`_outside_budgets`).

Resending after an attempt the upstream may have acted on (its answer lost or cut
mid-way: :func:`rebook`) reserves the call again, all or nothing as before: the provider
may have charged for that attempt, so its reservation is kept whatever the last attempt
costs. A resend the budgets cannot cover is not sent (BUDGET_EXCEEDED, saying the earlier
attempt may have been processed).

After (:func:`settle`): the real cost from the usage replaces the reservation; a call
that failed is released when nothing can have reached the upstream
(:attr:`gateway.call.attempts.AttemptLog.sent` false) or nothing billed can have
(:attr:`gateway.call.attempts.AttemptLog.billed` false: every answer an error status,
which providers do not bill), and otherwise keeps its reservation (the upstream may
have acted; its cost is unknown). Each step returns what the call's record learns
(:func:`settle`: ``cost_usd``, null when unknown, and ``cost_reason``) or keeps it on
the :class:`Spend` (its warnings and shadow denials, taken by :meth:`Spend.take_notes`);
the pipeline writes it into the call's context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from gateway.budgets import Applied, Booking, Budgets
from gateway.cost import CallPrice, Pricing
from gateway.envelope import ExternalCallRequest
from gateway.errors import BudgetExceeded, PermissionDenied
from gateway.policy import CompiledTarget
from gateway.providers import TokenUsage

__all__ = ["Spend", "price", "rebook", "reserve", "settle", "settle_failed"]

#: Why a call has no price when it calls no model (:mod:`gateway.cost`): a target without
#: a usage dialect (Slack, an MCP server), an endpoint that is not a model call (``GET
#: /v1/models/...``). Budgets count model spend, so they neither book nor refuse these.
_SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(slots=True)
class Spend:
    """One call's price, the budgets that apply, and its booking (None: none booked)."""

    price: CallPrice
    #: The budgets that apply (then booked) and the amount (USD), for a resend's.
    applying: list[Applied] = field(default_factory=list)
    booking: Booking | None = None
    amount_usd: float = 0.0
    #: The reservations of attempts that may have been billed, kept (cost unknown).
    resent: list[Booking] = field(default_factory=list)
    #: The budgets the call was booked in (names), for the record.
    budgets: list[str] = field(default_factory=list)
    #: Refused by a budget before sending (BUDGET_EXCEEDED, or its cost unbounded).
    refused: bool = False
    #: For the record, not taken yet (:meth:`take_notes`): warnings, and the shadow-mode
    #: budgets that would have refused the call (``budget:name``).
    warnings: list[str] = field(default_factory=list)
    shadow_denied: list[str] = field(default_factory=list)

    def take_notes(self) -> tuple[list[str], list[str]]:
        """The warnings and shadow denials since the last take (then forgotten)."""
        notes = self.warnings, self.shadow_denied
        self.warnings, self.shadow_denied = [], []
        return notes


def price(
    budgets: Budgets,
    pricing: Pricing,
    request: ExternalCallRequest,
    target: CompiledTarget,
    *,
    group: str | None,
    agent_id: str,
    tools: Sequence[str],
) -> Spend:
    """The call's price (cheap: cached per model) and the budgets that apply to it (of
    its target, rate-limit ``group``, agent and ``tools``: the call's names,
    :func:`gateway.agents.repeats.call_names`). Raises nothing."""
    applying = budgets.applying(target.name, group, agent_id, tools) if budgets else []
    priced = pricing.price(
        target.spec.usage, request.endpoint, request.parameters, measure=bool(applying)
    )
    return Spend(priced, applying)


async def reserve(budgets: Budgets, spend: Spend, request: ExternalCallRequest) -> None:
    """Reserve the call (priced by :func:`price`) against the budgets that apply, all or
    nothing. Raises BudgetExceeded, PermissionDenied (cost cannot be bounded), both with
    ``spend.refused`` set, or CapacityExceeded (a fail-closed cluster budget without
    Redis)."""
    price, applying = spend.price, spend.applying
    if not applying or _outside_budgets(price, request):
        spend.applying = []
        return
    amount = None
    for budget in applying:
        upper, reason = price.upper_usd(budget.spec.max_output_tokens)
        if upper is None:
            if budget.spec.on_unknown_price == "allow" or not budget.enforce:
                upper = price.known_usd()
                spend.warnings.append(
                    f"budget {budget.name!r}: the call's cost cannot be bounded before "
                    f"sending ({reason}); reserved {upper:.6f} USD (on_unknown_price: "
                    f"{budget.spec.on_unknown_price}, mode: {budget.spec.mode})"
                )
            else:
                spend.refused = True
                raise PermissionDenied(
                    f"budget {budget.name!r} applies to this call, and its cost cannot be "
                    f"bounded before sending ({reason.replace('_', ' ') if reason else ''}): "
                    "set max_tokens (or the budget's max_output_tokens), or give the model "
                    "a price in the policy's prices",
                    details={
                        "reason": "budget_price_unknown",
                        "budget": budget.name,
                        "price_unknown": reason,
                        "model": price.model,
                    },
                )
        amount = upper if amount is None else max(amount, upper)
    try:
        booking = await budgets.reserve(applying, amount or 0.0)
    except BudgetExceeded:
        spend.refused = True
        raise
    spend.booking, spend.amount_usd = booking, amount or 0.0
    spend.budgets = [b.name for b in applying]
    spend.warnings.extend(booking.warnings)
    spend.shadow_denied.extend(f"budget:{name}" for name in booking.shadow_denied)


async def rebook(budgets: Budgets, spend: Spend) -> None:
    """Before resending a call whose earlier attempt the upstream may have acted on: book
    the call's reservation again (that attempt's is kept: it may have been billed). Raises
    BudgetExceeded (nothing more is sent) or CapacityExceeded, as :func:`reserve`."""
    if spend.booking is None:
        return
    try:
        booking = await budgets.reserve(spend.applying, spend.amount_usd)
    except BudgetExceeded as exc:
        raise BudgetExceeded(
            "the call was not resent: its earlier attempt may have been processed by the "
            f"upstream (its answer was lost or cut), and resending it would overspend: "
            f"{exc.message}",
            details={**exc.details, "resend": True},
            retry_after_s=exc.retry_after_s,
        ) from None
    spend.resent.append(booking)
    spend.warnings.extend(booking.warnings)
    spend.shadow_denied.extend(f"budget:{name}" for name in booking.shadow_denied)


def _outside_budgets(price: CallPrice, request: ExternalCallRequest) -> bool:
    """Whether a call costs nothing a USD budget counts: a target with ``usage: none``
    (a plain API, an MCP server: no tokens, no price; the policy refuses a budget whose
    ``applies_to.target`` is such a target), or a safe method (GET, HEAD, OPTIONS: RFC
    9110 section 9.2.1, nothing is done, so nothing billed) of an LLM target's endpoint
    that is not a model call (``GET /v1/models/...``). Any other unpriced call of an LLM
    target (``POST /v1/images/generations``, audio, batches) is billed by the provider
    in ways the sidecar cannot bound, so it stays under the budgets (fail closed)."""
    if price.reason == "no_dialect":
        return True
    return price.reason == "not_a_model_call" and request.method in _SAFE_METHODS


def settle(
    budgets: Budgets, spend: Spend, usage: TokenUsage | None
) -> tuple[float | None, str | None]:
    """After an answer: its real cost from ``usage`` into the budgets. Returns the
    record's ``(cost_usd, cost_reason)`` (None: unknown, and why)."""
    usd, reason = spend.price.cost(usage)
    if spend.booking is not None:
        budgets.settle(spend.booking, usd)  # None (unknown): the reservation is kept
    return usd, reason


def settle_failed(budgets: Budgets, spend: Spend, *, sent: bool, billed: bool) -> str:
    """After a failure: release the reservation if nothing can have reached the upstream
    (``sent`` false: ``cost_reason`` "not_sent") or nothing it received can have been
    billed (``billed`` false: every attempt it answered, it answered with an error
    status, which the providers do not bill; "not_billed"), else keep it (the upstream
    may have processed the call; "usage_unknown"). A released call costs nothing.
    Returns the record's ``cost_reason``."""
    unsent = "not_billed" if sent else "not_sent"
    reason = spend.price.reason or ("usage_unknown" if billed else unsent)
    if spend.booking is not None:
        budgets.settle(spend.booking, None if billed else 0.0)
    return reason

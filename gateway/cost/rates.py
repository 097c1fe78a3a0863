"""A model's price and the cost of a call from its token usage (pure: no I/O).

Units: rates are USD per million tokens (the unit providers publish); costs are USD.
Which tokens a usage count includes is the provider's (:class:`gateway.providers.Dialect`):

* OpenAI and Gemini count cached tokens inside the input (``cached`` is a part of
  ``input``, billed at the cached rate); Anthropic counts them outside it
  (``cached_outside_input``), and its ``cached`` is cache reads and writes together, so
  they are billed at the higher of the cache-read and cache-write rates (an upper bound:
  the split is not kept).
* OpenAI and Anthropic count reasoning tokens inside the output; Gemini's
  ``thoughtsTokenCount`` is outside ``candidatesTokenCount`` (``reasoning_outside_output``)
  and billed as output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from gateway.providers import TokenUsage

__all__ = ["POLICY", "Rates", "cost_usd", "upper_cost_usd"]

#: ``Rates.source`` of a price from the policy's ``prices:`` table.
POLICY: Final = "policy"
_PER_MTOK: Final = 1_000_000


@dataclass(frozen=True, slots=True)
class Rates:
    """USD per million tokens of one model, and where the price came from
    (``policy`` or ``genai-prices``) and the model it was found as."""

    input_usd_per_mtok: float
    output_usd_per_mtok: float
    cached_usd_per_mtok: float
    cache_write_usd_per_mtok: float | None
    source: str
    model: str

    @property
    def highest_input_usd_per_mtok(self) -> float:
        """The most one input token can cost (a cache write can cost more than input)."""
        return max(self.input_usd_per_mtok, self.cache_write_usd_per_mtok or 0.0)


def cost_usd(
    rates: Rates,
    usage: TokenUsage,
    *,
    cached_outside_input: bool = False,
    reasoning_outside_output: bool = False,
) -> float | None:
    """The cost of ``usage`` at ``rates`` in USD; None when the usage lacks the input or
    the output count (a cost from half the usage would be a made-up number)."""
    if usage.input is None or usage.output is None:
        return None
    cached = usage.cached or 0
    output = usage.output + (usage.reasoning or 0 if reasoning_outside_output else 0)
    if cached_outside_input:
        cached_rate = max(rates.cached_usd_per_mtok, rates.cache_write_usd_per_mtok or 0.0)
        uncached = usage.input
    else:
        cached_rate = rates.cached_usd_per_mtok
        uncached = max(usage.input - cached, 0)
    total = (
        uncached * rates.input_usd_per_mtok
        + cached * cached_rate
        + output * rates.output_usd_per_mtok
    )
    return total / _PER_MTOK


def upper_cost_usd(rates: Rates, input_tokens: int, output_tokens: int) -> float:
    """The most a call of at most ``input_tokens`` in and ``output_tokens`` out can cost."""
    return (
        input_tokens * rates.highest_input_usd_per_mtok + output_tokens * rates.output_usd_per_mtok
    ) / _PER_MTOK

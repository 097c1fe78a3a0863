"""A model's price and the cost of a call from its token usage (pure: no I/O).

Units: rates are USD per million tokens (the unit providers publish); costs are USD.
Which tokens a usage count includes is the provider's (:class:`gateway.providers.Dialect`):

* OpenAI and Gemini count cached tokens inside the input (``cached`` is a part of
  ``input``, billed at the cached rate); Anthropic counts them outside it
  (``cached_outside_input``), and its ``cached`` is cache reads and writes together:
  the writes (``cache_write``) are billed at the cache-write rate (the input rate when
  the price has none), the reads at the cached rate; when the split is unknown, all at
  the higher of the two (an upper bound).
* OpenAI and Anthropic count reasoning tokens inside the output; Gemini's
  ``thoughtsTokenCount`` is outside ``candidatesTokenCount`` (``reasoning_outside_output``)
  and billed as output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from gateway.providers import TokenUsage

__all__ = ["POLICY", "Rates", "Tier", "cost_usd", "upper_cost_usd"]

#: ``Rates.source`` of a price from the policy's ``prices:`` table.
POLICY: Final = "policy"
_PER_MTOK: Final = 1_000_000


@dataclass(frozen=True, slots=True)
class Tier:
    """Rates that apply to every token of a call whose input (cached included) is more
    than ``start`` tokens (the "cliff" tiers providers use, e.g. past 200k tokens)."""

    start: int
    input_usd_per_mtok: float
    output_usd_per_mtok: float
    cached_usd_per_mtok: float
    cache_write_usd_per_mtok: float | None


@dataclass(frozen=True, slots=True)
class Rates:
    """USD per million tokens of one model, and where the price came from
    (``policy`` or ``genai-prices``) and the model it was found as; ``tiers`` (ascending
    ``start``) replace the base rates for larger calls."""

    input_usd_per_mtok: float
    output_usd_per_mtok: float
    cached_usd_per_mtok: float
    cache_write_usd_per_mtok: float | None
    source: str
    model: str
    tiers: tuple[Tier, ...] = ()

    def at(self, input_tokens: int) -> Rates | Tier:
        """The rates for a call of ``input_tokens`` input tokens (cached included)."""
        for tier in reversed(self.tiers):
            if input_tokens > tier.start:
                return tier
        return self

    @property
    def highest(self) -> Rates | Tier:
        """The rates of the largest calls (the last tier, or the base)."""
        return self.tiers[-1] if self.tiers else self

    @property
    def highest_input_usd_per_mtok(self) -> float:
        """The most one input token can cost (a cache write can cost more than input)."""
        top = self.highest
        return max(top.input_usd_per_mtok, top.cache_write_usd_per_mtok or 0.0)


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
    rates_ = rates.at(usage.input + cached if cached_outside_input else usage.input)
    return _cost(rates_, usage, cached, output, cached_outside_input=cached_outside_input)


def _cost(
    rates: Rates | Tier, usage: TokenUsage, cached: int, output: int, *, cached_outside_input: bool
) -> float:
    assert usage.input is not None
    write_rate = rates.cache_write_usd_per_mtok
    if write_rate is None:
        write_rate = rates.input_usd_per_mtok
    if not cached_outside_input:
        uncached, written = max(usage.input - cached, 0), 0
    elif usage.cache_write is not None:
        uncached, written = usage.input, min(usage.cache_write, cached)
    else:  # reads and writes, split unknown: every one at the dearer rate
        uncached, written = usage.input, cached
        write_rate = max(write_rate, rates.cached_usd_per_mtok)
    total = (
        uncached * rates.input_usd_per_mtok
        + (cached - written) * rates.cached_usd_per_mtok
        + written * write_rate
        + output * rates.output_usd_per_mtok
    )
    return total / _PER_MTOK


def upper_cost_usd(rates: Rates, input_tokens: int, output_tokens: int) -> float:
    """The most a call of at most ``input_tokens`` in and ``output_tokens`` out can cost."""
    return (
        input_tokens * rates.highest_input_usd_per_mtok
        + output_tokens * rates.highest.output_usd_per_mtok
    ) / _PER_MTOK

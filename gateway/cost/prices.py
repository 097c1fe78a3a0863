"""Model prices from ``genai-prices`` (pydantic/genai-prices): the only module that imports it.

The library bundles its price data (``genai_prices.data``, a snapshot taken at its
release); it fetches newer data only through ``UpdatePrices``, which this module never
starts, so the sidecar prices offline and the same way on every start of one release
(an upgrade of the library brings new prices). The data is imported on the first lookup,
not at start-up (it is ~0.7 MB of Python), and each (provider, model, UTC day) is looked
up once and kept (:func:`library_rates` is cached), so a call pays a dict lookup.

A model's price in the library can be tiered (a higher rate past a prompt size, e.g.
Gemini past 200k tokens) or change at a date: :func:`library_rates` takes the highest
tier of each rate (the cost is then an upper bound for such models, never an
under-estimate) and the prices in force on the UTC day of the call.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Final

from gateway.audit import get_logger
from gateway.cost.rates import Rates

__all__ = ["LIBRARY", "library_rates", "library_version"]

#: ``Rates.source`` of a price from the library.
LIBRARY: Final = "genai-prices"
_CACHE_SIZE: Final = 4096
_log = get_logger("gateway.cost")


def library_version() -> str:
    """The installed genai-prices version (its data is that release's snapshot)."""
    from importlib.metadata import version

    return version("genai-prices")


def library_rates(provider: str, model: str, now: datetime | None = None) -> Rates | None:
    """USD per million tokens of ``model`` at genai-prices provider ``provider``
    (``openai``, ``anthropic``, ``google``), in force on ``now``'s UTC day (default:
    today); None when the library does not know the model or prices it in units other
    than tokens only. Never raises for an unknown model."""
    day = (now or datetime.now(UTC)).date().isoformat()
    return _cached(provider, model, day)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _cached(provider: str, model: str, day: str) -> Rates | None:
    try:
        from genai_prices import data_snapshot
    except ImportError:  # an image built without it: every price is unknown, said once
        _missing()
        return None
    snapshot = data_snapshot.get_snapshot()
    try:
        _, info = snapshot.find_provider_model(model, None, provider, None)
    except (LookupError, ValueError):
        return None
    price = info.get_prices(datetime.fromisoformat(day).replace(tzinfo=UTC))
    input_rate = _highest(getattr(price, "input_mtok", None))
    output_rate = _highest(getattr(price, "output_mtok", None))
    if input_rate is None or output_rate is None:
        return None  # priced per request, image or second: not from token usage alone
    cached = _highest(getattr(price, "cache_read_mtok", None))
    write = _highest(getattr(price, "cache_write_mtok", None))
    return Rates(
        input_usd_per_mtok=input_rate,
        output_usd_per_mtok=output_rate,
        cached_usd_per_mtok=cached if cached is not None else input_rate,
        cache_write_usd_per_mtok=write,
        source=LIBRARY,
        model=str(info.id),
    )


@functools.cache
def _missing() -> None:
    _log.warning(
        "prices_unavailable",
        reason="genai-prices is not installed: costs are unknown (cost_reason no_price) "
        "except for models in the policy's prices",
    )


def _highest(value: Any) -> float | None:
    """A rate (a Decimal, or tiered prices: their highest rate) as a float; None if none."""
    if value is None:
        return None
    if isinstance(value, Decimal | int | float):
        return float(value)
    base = getattr(value, "base", None)
    tiers = getattr(value, "tiers", None) or []
    rates = [float(r) for r in (base, *(getattr(t, "price", None) for t in tiers)) if r is not None]
    return max(rates) if rates else None

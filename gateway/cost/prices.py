"""Model prices from ``genai-prices`` (pydantic/genai-prices): the only modules that read
it are this one and :mod:`gateway.cost.table`.

The library bundles its price data (``genai_prices.data``, a snapshot taken at its
release); it fetches newer data only through ``UpdatePrices``, which is never started,
so the sidecar prices offline and the same way on every start of one release (an
upgrade of the library brings new prices). The sidecar does not import the library: it
reads the token rates of its providers' models from a small table taken from the
library's data in another process (:mod:`gateway.cost.table`; ~5 MiB less resident
memory), loaded at start-up for a policy that prices calls (:func:`preload`), else at
the first lookup. Each (provider, model, UTC day) is looked up once and kept
(:func:`library_rates` is cached), so a call pays a dict lookup. Without a table (its
extraction failed, said in a warning), or for a provider outside it, the library itself
answers, in the sidecar's process.

A model's price in the library can be tiered (a higher rate for every token of a call
whose input is past a size, e.g. 200k tokens) or change at a date: :func:`library_rates`
keeps the tiers (:class:`gateway.cost.rates.Tier`: the cost of a call is at its tier,
an estimate at the highest) and the prices in force on the UTC day of the call.
"""

from __future__ import annotations

import functools
import subprocess
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Final

from gateway.audit import get_logger
from gateway.cost.rates import Rates, Tier
from gateway.cost.table import Table, library_key
from gateway.cost.table import load as load_table

__all__ = ["LIBRARY", "known_models", "library_rates", "library_version", "preload"]

#: ``Rates.source`` of a price from the library.
LIBRARY: Final = "genai-prices"
_CACHE_SIZE: Final = 4096
_log = get_logger("gateway.cost")


def library_version() -> str:
    """The installed genai-prices version (its data is that release's snapshot)."""
    from importlib.metadata import version

    return version("genai-prices")


def preload() -> None:
    """Load the price table now (:mod:`gateway.cost.table`: a file read, or ~0.5 s in a
    child process the first time on a host), once per process.

    The sidecar calls it in a worker thread at start-up, so that the first priced call
    does not hold the event loop while other calls wait. Without the library installed
    it does nothing (prices are then unknown, said at the first call).
    """
    key = library_key()
    if key is not None:
        _load(key)


def library_rates(provider: str, model: str, now: datetime | None = None) -> Rates | None:
    """USD per million tokens of ``model`` at genai-prices provider ``provider``
    (``openai``, ``anthropic``, ``google``), in force on ``now``'s UTC day (default:
    today); None when the library does not know the model or prices it in units other
    than tokens only. Never raises for an unknown model."""
    day = (now or datetime.now(UTC)).date().isoformat()
    return _cached(provider, model, day)


def known_models(provider: str | None) -> frozenset[str]:
    """The model ids genai-prices prices at ``provider`` (its id: ``openai``,
    ``anthropic``, ``google``; None: every provider's); empty without the library."""
    try:
        from genai_prices import data_snapshot
    except ImportError:
        return frozenset()
    providers = data_snapshot.get_snapshot().providers
    return frozenset(str(m.id) for p in providers if provider in (None, p.id) for m in p.models)


# Pure for the process (the library's data never changes while it runs): each
# (provider, model, day) is looked up once; LRU.
@functools.lru_cache(maxsize=_CACHE_SIZE)
def _cached(provider: str, model: str, day: str) -> Rates | None:
    key = library_key()
    if key is None:  # an image built without it: every price is unknown, said once
        _missing()
        return None
    table = _load(key)
    if table is None or not table.knows(provider):
        return _from_library(provider, model, day)
    found = table.rates(provider, model, day)
    return None if found is None else _as_rates(*found)


@functools.cache  # per library (its key): read once per process
def _load(key: str) -> Table | None:
    """The price table, or None (then the library itself answers, in this process)."""
    try:
        return load_table(key)
    except (OSError, RuntimeError, ValueError, KeyError, subprocess.SubprocessError) as exc:
        _log.warning(
            "prices_table_unavailable",
            reason="genai-prices' data could not be read in a child process: the library "
            "is loaded in the sidecar instead (more memory, same prices)",
            error=str(exc)[:500],
        )
        return None


def _from_library(provider: str, model: str, day: str) -> Rates | None:
    """The lookup by genai-prices itself (a provider outside the table, or no table)."""
    try:
        from genai_prices import data_snapshot
    except ImportError:
        _missing()
        return None
    snapshot = data_snapshot.get_snapshot()
    try:
        _, info = snapshot.find_provider_model(model, None, provider, None)
    except (LookupError, ValueError):
        return None
    price = info.get_prices(datetime.fromisoformat(day).replace(tzinfo=UTC))
    return _as_rates(str(info.id), token_rates(price))


def token_rates(price: Any) -> list[Any] | None:
    """A genai-prices ``ModelPrice`` as ``[base, [[start, tier], ...]]`` (each rates
    ``[input, output, cached, cache_write]``, USD per million tokens), or None when it is
    priced per request, image or second: not from token usage alone."""
    keys = [getattr(price, k, None) for k in _KEYS]
    starts = sorted({int(t.start) for v in keys for t in (getattr(v, "tiers", None) or [])})
    base = _level(keys, None)
    tiers = [(start, _level(keys, start)) for start in starts]
    if base is None or any(level is None for _, level in tiers):
        return None
    return [list(base), [[start, list(level)] for start, level in tiers if level is not None]]


def _as_rates(model_id: str, rates: list[Any] | None) -> Rates | None:
    if rates is None:
        return None
    (inp, out, cached, write), tiers = rates
    return Rates(
        inp,
        out,
        cached,
        write,
        source=LIBRARY,
        model=model_id,
        tiers=tuple(Tier(start, *level) for start, level in tiers),
    )


@functools.cache  # the warning is said once per process
def _missing() -> None:
    _log.warning(
        "prices_unavailable",
        reason="genai-prices is not installed: costs are unknown (cost_reason no_price) "
        "except for models in the policy's prices",
    )


#: genai-prices' price keys, in the order of :class:`Rates`' rates.
_KEYS: Final = ("input_mtok", "output_mtok", "cache_read_mtok", "cache_write_mtok")


def _level(keys: list[Any], start: int | None) -> tuple[float, float, float, float | None] | None:
    """The four rates of calls past ``start`` input tokens (None: the base rates), as
    genai-prices applies its tiers (every token at the tier's rate)."""
    inp, out, cached, write = (_rate(value, start) for value in keys)
    if inp is None or out is None:
        return None
    return inp, out, cached if cached is not None else inp, write


def _rate(value: Any, start: int | None) -> float | None:
    """A price (a Decimal, or TieredPrices: the tier in force past ``start``) as a float."""
    if value is None:
        return None
    if isinstance(value, Decimal | int | float):
        return float(value)
    rate = getattr(value, "base", None)
    for tier in getattr(value, "tiers", None) or []:
        if start is not None and start >= tier.start:
            rate = tier.price
    return float(rate) if rate is not None else None

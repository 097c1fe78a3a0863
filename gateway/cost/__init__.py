"""The cost of calls: prices (the policy's ``prices:`` table, then genai-prices), a call's
upper estimate before sending and its real cost from the usage after.

A price is known only when the target has a usage dialect (``usage: openai | anthropic
| gemini``), the endpoint is a model call of that dialect, the request names a model, and
that model has a price (policy first, then the library). Otherwise the cost is unknown,
with a ``reason`` (never a made-up number):

=================  ==========================================================
reason             why
=================  ==========================================================
no_dialect         the target's ``usage`` is ``none``
not_a_model_call   the endpoint is not one the dialect knows as a model call
no_model           the request names no model
no_price           neither the policy nor genai-prices has a price for it
no_output_cap      (estimate only) no ``max_tokens``-like cap and no budget default
hidden_context     (estimate only) input kept by the provider (``previous_response_id``)
usage_unknown      (cost only) the answer reported no usage
usage_incomplete   (cost only) the usage lacks its input or output count
=================  ==========================================================

The upper estimate (what a budget reserves) counts one input token per UTF-8 byte of
the prompt keys (:func:`gateway.providers.prompt_bytes`): a text token covers at least
one byte, so for text this is never below the real count (images, audio, files and
server-side state such as ``previous_response_id`` are not in the bytes: their tokens
are not bounded by it). Output is the request's cap (times ``n`` / ``candidateCount``),
else the budget's ``max_output_tokens`` (0 for embeddings). A request that brings in
input kept on the provider's side (the Responses API's ``previous_response_id`` or
``conversation``) cannot be bounded before sending.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from gateway.cost.prices import known_models, library_rates, preload
from gateway.cost.rates import POLICY, Rates, cost_usd, upper_cost_usd
from gateway.policy.budgets import PriceSpec
from gateway.providers import DIALECTS, TokenUsage, genai_call, prompt_bytes

__all__ = [
    "CallPrice",
    "Pricing",
    "Rates",
    "cost_usd",
    "known_models",
    "preload",
    "priced_models",
    "upper_cost_usd",
]

_MAX_KNOWN: Final = 1024
_MAX_KNOWN_ENDPOINT: Final = 256
_DAY_S: Final = 86_400


@dataclass(frozen=True, slots=True)
class CallPrice:
    """What is known of one call's price before sending: the dialect, the model, its
    rates (None: unknown, ``reason`` says why), the prompt bytes, and the output cap
    the request sets times its choices (0: none)."""

    dialect: str
    model: str | None
    rates: Rates | None
    reason: str | None
    prompt_bytes: int = 0
    output_tokens: int = 0
    no_output: bool = False  # embeddings: nothing is generated
    hidden_context: bool = False  # input kept on the provider's side (previous_response_id)

    def upper_usd(self, default_output_tokens: int | None) -> tuple[float | None, str | None]:
        """The most the call can cost (USD), or (None, reason)."""
        if self.rates is None:
            return None, self.reason
        if self.hidden_context:
            return None, "hidden_context"
        output = 0 if self.no_output else self.output_tokens or default_output_tokens
        if output is None or (not output and not self.no_output):
            return None, "no_output_cap"
        return upper_cost_usd(self.rates, self.prompt_bytes, output), None

    def known_usd(self) -> float:
        """What can be priced without an output cap: the prompt's upper cost (0 if no rates)."""
        return upper_cost_usd(self.rates, self.prompt_bytes, 0) if self.rates else 0.0

    def cost(self, usage: TokenUsage | None) -> tuple[float | None, str | None]:
        """The real cost (USD) of ``usage``, or (None, reason)."""
        if self.rates is None:
            return None, self.reason
        if usage is None:
            return None, "usage_unknown"
        dialect = DIALECTS[self.dialect]
        usd = cost_usd(
            self.rates,
            usage,
            cached_outside_input=dialect.cached_outside_input,
            reasoning_outside_output=dialect.reasoning_outside_output,
        )
        return (usd, None) if usd is not None else (None, "usage_incomplete")


class Pricing:
    """Prices of one policy: its ``prices:`` table (exact model names) wins over the
    library (genai-prices, by the dialect's provider). Replace it with the policy."""

    def __init__(self, prices: Mapping[str, PriceSpec]) -> None:
        #: (dialect, endpoint, model) -> the unmeasured CallPrice: agents call a few
        #: endpoints with a few models; bounded, and cleared at each UTC midnight (the
        #: library's prices can change at a date).
        self._known: dict[tuple[str, str, str | None], CallPrice] = {}
        self._known_until = 0.0
        self._policy = {
            model: Rates(
                input_usd_per_mtok=spec.input_usd_per_mtok,
                output_usd_per_mtok=spec.output_usd_per_mtok,
                cached_usd_per_mtok=(
                    spec.cached_usd_per_mtok
                    if spec.cached_usd_per_mtok is not None
                    else spec.input_usd_per_mtok
                ),
                cache_write_usd_per_mtok=spec.cache_write_usd_per_mtok,
                source=POLICY,
                model=model,
            )
            for model, spec in prices.items()
        }

    def rates(self, dialect: str, model: str) -> Rates | None:
        """The price of ``model`` for a target of ``dialect``, or None."""
        found = self._policy.get(model)
        if found is not None:
            return found
        provider = DIALECTS[dialect].price_provider if dialect in DIALECTS else ""
        return library_rates(provider, model) if provider else None

    def price(
        self, dialect: str, endpoint: str, parameters: Mapping[str, Any], *, measure: bool
    ) -> CallPrice:
        """What is known of a call's price before sending (see :class:`CallPrice`); the
        prompt is measured (its bytes serialised) only with ``measure`` (for budgets)."""
        model = parameters.get("model")
        key = (dialect, endpoint, model if isinstance(model, str) else None)
        known = self._known.get(key)
        now = time.time()
        if known is None or now >= self._known_until:
            known = self._price(dialect, endpoint, parameters)
            if now >= self._known_until or len(self._known) >= _MAX_KNOWN:
                self._known.clear()
                self._known_until = (now // _DAY_S + 1) * _DAY_S
            if len(endpoint) <= _MAX_KNOWN_ENDPOINT and len(key[2] or "") <= _MAX_KNOWN_ENDPOINT:
                self._known[key] = known
        if not measure or known.rates is None:
            return known
        spec = DIALECTS[dialect]
        return CallPrice(
            dialect,
            known.model,
            known.rates,
            None,
            prompt_bytes(parameters),
            spec.output_cap(parameters) * spec.choices(parameters),
            known.no_output,
            any(k in parameters for k in spec.hidden_context_keys),
        )

    def _price(self, dialect: str, endpoint: str, parameters: Mapping[str, Any]) -> CallPrice:
        if dialect not in DIALECTS:
            return CallPrice(dialect, None, None, "no_dialect")
        call = genai_call(dialect, endpoint, parameters)
        if call is None:
            return CallPrice(dialect, None, None, "not_a_model_call")
        if call.request_model is None:
            return CallPrice(dialect, None, None, "no_model")
        rates = self.rates(dialect, call.request_model)
        if rates is None:
            return CallPrice(dialect, call.request_model, None, "no_price")
        return CallPrice(
            dialect, call.request_model, rates, None, no_output=call.operation == "embeddings"
        )


def priced_models(prices: Mapping[str, PriceSpec], usage: str) -> frozenset[str]:
    """The model names with a price for a target of dialect ``usage`` (``"*"``: any):
    the policy's ``prices`` and genai-prices' models at the dialect's provider."""
    dialect = DIALECTS.get(usage)
    provider = None if dialect is None else dialect.price_provider or None
    return frozenset(prices) | known_models(provider)

"""Benchmark: what pricing and budgets add to one call (issue 20), and what the price
library costs to load.

    .venv/bin/python bench/cost.py [--calls N]

Prints, per call: the price lookup of a call with no budget (what every LLM call pays for
``cost_usd``), the reservation and settlement of a call under one local budget, and the
cost from usage; then the import time and RSS growth of genai-prices' bundled data (it
is loaded on the first call whose model is not in the policy's ``prices:``). Not part of
the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time

from gateway.budgets import Budgets
from gateway.cost import Pricing
from gateway.policy.budgets import BudgetSpec, PriceSpec
from gateway.providers import TokenUsage

PARAMS = {
    "model": "gpt-4o-mini",
    "max_tokens": 256,
    "messages": [{"role": "user", "content": "Summarise the attached report. " * 20}],
}


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def main(calls: int) -> None:
    before = _rss_mib()
    started = time.perf_counter()
    library = Pricing({})
    library.price("openai", "/v1/chat/completions", PARAMS, measure=False)  # loads the data
    print(
        f"genai-prices first lookup: {(time.perf_counter() - started) * 1000:.0f} ms, "
        f"RSS +{_rss_mib() - before:.1f} MiB"
    )
    pricing = Pricing({"gpt-4o-mini": PriceSpec(input_usd_per_mtok=0.15, output_usd_per_mtok=0.6)})
    usage = TokenUsage(150, 40, 0, 190)
    for name, p in (("library", library), ("policy", pricing)):
        started = time.perf_counter()
        for _ in range(calls):
            price = p.price("openai", "/v1/chat/completions", PARAMS, measure=False)
            price.cost(usage)
        per = (time.perf_counter() - started) / calls * 1e6
        print(f"price + cost, no budget ({name} price): {per:.2f} us/call")
    budgets = Budgets({"b": BudgetSpec(limit_usd=1e6, window="daily")})
    applied = budgets.applying("openai", None, "agent")
    started = time.perf_counter()
    for _ in range(calls):
        price = pricing.price("openai", "/v1/chat/completions", PARAMS, measure=True)
        upper, _ = price.upper_usd(None)
        booking = await budgets.reserve(applied, upper or 0.0)
        budgets.settle(booking, price.cost(usage)[0])
    per = (time.perf_counter() - started) / calls * 1e6
    print(f"price + reserve + settle, one local budget: {per:.2f} us/call")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=50_000)
    asyncio.run(main(parser.parse_args().calls))

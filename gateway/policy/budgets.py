"""The policy's cost sections: ``budgets`` (spend limits in USD) and ``prices`` (per-model
prices that win over the bundled price library), and the ``mode`` of a rule.

```yaml
prices:                       # USD per million tokens; wins over genai-prices
  my-finetune: {input_usd_per_mtok: 3.0, output_usd_per_mtok: 12.0, cached_usd_per_mtok: 1.5}
budgets:
  llm-daily:
    limit_usd: 50
    window: daily               # daily | monthly (UTC calendar) | rolling (with per_hours)
    applies_to: {target: openai} # target, rate_limit_group, agent, tool (all given must match)
    scope: cluster              # local | cluster (Redis)
    mode: enforce               # or shadow: evaluated and recorded, never refuses
  search-calls:                 # a tool cap: calls, not dollars
    max_calls: 200
    window: daily
    applies_to: {target: tools, tool: "search_*"}   # an MCP tool name or an endpoint path glob
```

Semantics (docs/features/budgets.md): a budget applies to a call when every key of its
``applies_to`` matches (an empty ``applies_to`` matches every call). Before sending, the
call's upper cost estimate is reserved against every budget that applies; a call an
enforced budget cannot cover is refused with BUDGET_EXCEEDED. A budget with
``max_calls`` (a tool cap, docs/features/stopping.md) also counts the calls it applies
to, one per call at admission (:mod:`gateway.agents.caps`); it may have no
``limit_usd``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, StringConstraints, model_validator

from gateway.policy import defaults as d
from gateway.policy.stores import StrictModel

#: ``enforce`` (the default) applies a rule; ``shadow`` evaluates it, records a "would
#: deny" (audit ``decision: shadow_denied``, metric ``shadow_denials_total``) and lets
#: the call proceed.
Mode = Literal["enforce", "shadow"]
_Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")]
#: A model name as the request names it (``gpt-4o-mini``, ``claude-sonnet-4-5``).
ModelName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+\-]{0,127}$")]
_USD_PER_MTOK = Field(ge=0, le=d.MAX_USD_PER_MTOK)


class PriceSpec(StrictModel):
    """A model's price, USD per million tokens. ``cached_usd_per_mtok``: cached input
    (cache reads); ``cache_write_usd_per_mtok``: input written to the cache (Anthropic);
    both default to the input price (never cheaper than stated)."""

    input_usd_per_mtok: float = _USD_PER_MTOK
    output_usd_per_mtok: float = _USD_PER_MTOK
    cached_usd_per_mtok: float | None = Field(None, ge=0, le=d.MAX_USD_PER_MTOK)
    cache_write_usd_per_mtok: float | None = Field(None, ge=0, le=d.MAX_USD_PER_MTOK)


#: An MCP tool name or an endpoint path (starts with ``/``), ``*`` matching any run of
#: characters.
#: A path's trailing slashes are dropped, as the calls' endpoints are named
#: (:func:`gateway.policy.egress.endpoint_name`), so that it matches every spelling.
ToolGlob = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z0-9_./*\-:@]{1,256}$"),
    AfterValidator(lambda glob: glob.rstrip("/") or "/" if glob.startswith("/") else glob),
]


class AppliesTo(StrictModel):
    """Which calls a budget counts: each key given must match (none given: every call).
    ``agent`` is the agent who called, as the sidecar established it (its UID, its token,
    else the policy's ``agent_id``: :mod:`gateway.agents.identity`), never a claim;
    ``tool`` a glob over the MCP tool a ``tools/call`` names, or the endpoint path of any
    other call."""

    target: _Name | None = None
    rate_limit_group: _Name | None = None
    agent: _Name | None = None
    tool: ToolGlob | None = None


class BudgetSpec(StrictModel):
    """A spend limit over a window. ``daily`` and ``monthly`` are UTC calendar days and
    months (reset at 00:00 UTC, on the 1st); ``rolling`` is the last ``per_hours`` hours,
    kept in 60 buckets of ``per_hours`` minutes each.

    ``max_output_tokens``: the output the estimate assumes for a request that sets no
    output cap (``max_tokens``...); without it such a request's cost cannot be bounded
    before sending. ``on_unknown_price``: ``refuse`` (default, fail closed) refuses a
    call whose cost cannot be bounded before sending (no price for its model, no output
    cap); ``allow`` sends it and reserves only what can be priced.
    ``on_redis_error`` (cluster scope): ``fail_closed`` (default: money is at stake)
    refuses with CAPACITY_EXCEEDED (retryable, ``details.reason`` "redis_unavailable");
    ``fail_open`` counts on this sidecar alone until Redis answers (N sidecars may then
    spend N times the limit).
    """

    limit_usd: float | None = Field(None, gt=0, le=d.MAX_BUDGET_USD)
    max_calls: int | None = Field(None, ge=1, le=d.MAX_BUDGET_CALLS)
    window: Literal["daily", "monthly", "rolling"]
    per_hours: float | None = Field(None, ge=d.MIN_BUDGET_PER_HOURS, le=d.MAX_BUDGET_PER_HOURS)
    applies_to: AppliesTo = Field(default_factory=AppliesTo)
    scope: Literal["local", "cluster"] = "local"
    mode: Mode = "enforce"
    max_output_tokens: int | None = Field(None, gt=0, le=d.MAX_TOKENS_PER_MINUTE)
    on_unknown_price: Literal["refuse", "allow"] = "refuse"
    on_redis_error: Literal["fail_open", "fail_closed"] = "fail_closed"

    @model_validator(mode="after")
    def _rolling(self) -> BudgetSpec:
        if (self.window == "rolling") != (self.per_hours is not None):
            raise ValueError("'per_hours' is required with window: rolling, and only there")
        if self.limit_usd is None and self.max_calls is None:
            raise ValueError("set 'limit_usd' (USD per window) or 'max_calls' (calls per window)")
        return self


def budget_problems(
    budgets: dict[str, BudgetSpec],
    targets: Mapping[str, str],
    groups: set[str],
    has_redis: bool,
) -> list[tuple[tuple[str, ...], str]]:
    """Cross-references of ``budgets`` to other sections: (key path, message) pairs.
    ``targets`` maps each target's name to its ``usage`` dialect (``none``: no tokens,
    so no price: a budget naming such a target could never count anything)."""
    problems: list[tuple[tuple[str, ...], str]] = []
    for name, spec in budgets.items():
        where = spec.applies_to
        if where.target is not None and where.target not in targets:
            known = ", ".join(sorted(targets)) or "none"
            problems.append(
                (
                    ("budgets", name, "applies_to", "target"),
                    f"no target {where.target!r} (known: {known})",
                )
            )
        elif where.target is not None and targets[where.target] == "none" and spec.limit_usd:
            problems.append(
                (
                    ("budgets", name, "applies_to", "target"),
                    f"target {where.target!r} has usage: none: its calls report no tokens, "
                    "so they have no price for a USD budget to count",
                )
            )
        if where.rate_limit_group is not None and where.rate_limit_group not in groups:
            known = ", ".join(sorted(groups)) or "none"
            problems.append(
                (
                    ("budgets", name, "applies_to", "rate_limit_group"),
                    f"no rate-limit group {where.rate_limit_group!r} (known: {known})",
                )
            )
        if spec.scope == "cluster" and not has_redis:
            problems.append((("budgets", name, "scope"), "'cluster' needs a redis section"))
    return problems

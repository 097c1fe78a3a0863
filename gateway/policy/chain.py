"""The policy's ``chain:`` section: how the sidecar checks and extends the call chain of
agents calling agents (:mod:`gateway.agents.chain`; design.md, "Agents calling agents").

```yaml
chain:                                    # all optional
  max_depth: 8                            # agents in a chain, this one included
  ttl_s: 900                              # a chain started here lives this long
  max_clock_skew_s: 5                     # a received deadline past now + ttl_s + this is refused
  signing_key_ref: vault://fleet/chain-key        # the fleet's shared HMAC key: sign and verify
  previous_signing_key_ref: vault://fleet/chain-key-old   # still accepted while rotating
  require_signed_inbound: false           # true: a chain without a valid signature is refused
```

Without ``signing_key_ref`` chains are unsigned and taken as given (one trust domain).

A target's ``call_chain:`` (:class:`CallChainSpec`) says whether the chain's headers go
out to it: ``propagate: false`` keeps the fleet's agent ids and topology from a provider
outside the fleet (OpenAI, Slack...). The chain is decided for every call all the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator, model_validator

from gateway.policy import defaults as d
from gateway.policy.refs import check_ref
from gateway.policy.stores import StrictModel


class ChainSpec(StrictModel):
    """``chain:``: ``max_depth`` (agents, this one included), ``ttl_s`` (seconds a chain
    started here lives), ``max_clock_skew_s`` (seconds a received deadline may lie past
    ``now + ttl_s``), the secret references of the fleet's signing keys (current, and the
    previous one during a rotation), and ``require_signed_inbound``."""

    max_depth: int = Field(d.DEFAULT_CHAIN_MAX_DEPTH, ge=1, le=d.MAX_CHAIN_MAX_DEPTH)
    ttl_s: float = Field(d.DEFAULT_CHAIN_TTL_S, gt=0, le=d.MAX_CHAIN_TTL_S)
    max_clock_skew_s: float = Field(d.DEFAULT_CHAIN_CLOCK_SKEW_S, ge=0, le=d.MAX_CHAIN_CLOCK_SKEW_S)
    signing_key_ref: str | None = None
    previous_signing_key_ref: str | None = None
    require_signed_inbound: bool = False

    @field_validator("signing_key_ref", "previous_signing_key_ref")
    @classmethod
    def _ref(cls, value: str | None) -> str | None:
        if value is not None:
            check_ref(value)
        return value

    @model_validator(mode="after")
    def _keys(self) -> ChainSpec:
        if self.previous_signing_key_ref is not None and self.signing_key_ref is None:
            raise ValueError(
                "previous_signing_key_ref needs signing_key_ref: the previous key is only "
                "accepted beside the current one, during a rotation"
            )
        if self.require_signed_inbound and self.signing_key_ref is None:
            raise ValueError(
                "require_signed_inbound needs signing_key_ref: a chain's signature can only "
                "be checked with the fleet's key"
            )
        return self

    def key_refs(self) -> tuple[str, ...]:
        """The signing keys' secret references, current first (empty: chains unsigned)."""
        refs = (self.signing_key_ref, self.previous_signing_key_ref)
        return tuple(ref for ref in refs if ref is not None)


class CallChainSpec(StrictModel):
    """A target's ``call_chain:``: whether its calls carry the chain's headers
    (``x-egress-call-chain``, ``x-egress-deadline``, ``x-egress-call-chain-sig``).
    Off, the chain is still decided (a loop, depth or deadline is refused before any
    I/O) and audited, and no chain header reaches the target, not even one the agent set.
    """

    propagate: bool = Field(
        True,
        description="send the chain's headers (`x-egress-call-chain`, `x-egress-deadline`, "
        "the signature) to this target; `false` for a provider outside the fleet (the chain "
        "is still checked and audited); never `false` on an A2A target",
    )


def propagation_problems(targets: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    """``call_chain.propagate: false`` on an A2A target (``targets`` by name, each a
    ``TargetSpec``): refused, since the called agent's sidecar could then not see the
    chain, and a loop back to this agent would go unnoticed. Each is ``(key path,
    message)``."""
    return [
        (
            ("targets", name, "call_chain", "propagate"),
            "an A2A target always gets the call chain (its sidecar detects loops with "
            "it): remove 'propagate: false'",
        )
        for name, target in targets.items()
        if target.a2a is not None and not target.call_chain.propagate
    ]


def propagation_warnings(targets: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    """Warnings for ``validate``: a target of a provider dialect (``usage`` other than
    ``none``) that does not say whether the chain goes out to it. It does (the default),
    which tells the provider this fleet's agent ids; writing ``propagate`` silences it."""
    return [
        (
            ("targets", name, "call_chain"),
            f"this {spec.usage} provider gets the call chain's headers (your agent ids) by "
            "default: set call_chain: {propagate: false}, or propagate: true if it is an "
            "agent of your fleet",
        )
        for name, spec in targets.items()
        if spec.usage != "none" and "propagate" not in spec.call_chain.model_fields_set
    ]


def chain_problems(chain: ChainSpec, has_vault: bool) -> list[tuple[tuple[str, ...], str]]:
    """Problems of ``chain`` that need the rest of the policy: a ``vault://`` key without a
    ``secrets.vault`` section. Each is ``(key path, message)``."""
    problems: list[tuple[tuple[str, ...], str]] = []
    for key in ("signing_key_ref", "previous_signing_key_ref"):
        ref = getattr(chain, key)
        if ref is not None and ref.startswith("vault://") and not has_vault:
            problems.append((("chain", key), f"{ref!r} needs a secrets.vault section"))
    return problems

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
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from gateway.policy import defaults as d
from gateway.policy.refs import InvalidSecretRef, parse_ref
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
            try:
                parse_ref(value)
            except InvalidSecretRef as exc:
                raise ValueError(str(exc)) from None
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


def chain_problems(chain: ChainSpec, has_vault: bool) -> list[tuple[tuple[str, ...], str]]:
    """Problems of ``chain`` that need the rest of the policy: a ``vault://`` key without a
    ``secrets.vault`` section. Each is ``(key path, message)``."""
    problems: list[tuple[tuple[str, ...], str]] = []
    for key in ("signing_key_ref", "previous_signing_key_ref"):
        ref = getattr(chain, key)
        if ref is not None and ref.startswith("vault://") and not has_vault:
            problems.append((("chain", key), f"{ref!r} needs a secrets.vault section"))
    return problems

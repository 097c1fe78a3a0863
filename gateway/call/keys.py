"""Key pools (design.md, "Failover and key pools"; README, "Failover"): a target's
``credential.refs`` are keys of one account or several, used in order; a key that got a
429 or a quota refusal cools down for the wait the upstream asked for (else
:data:`COOL_DOWN_S`) and the next key serves the call at once. Only when every key is
cooling is the call's error the upstream's (CAPACITY_EXCEEDED, or QUOTA_EXHAUSTED when
every key is spent). Keys are named by their secret references, never by their values.

:func:`pick` is the decision (pure); :class:`KeyPools` keeps when each key may serve
again (per target, in this sidecar's memory).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

#: Seconds a key cools down after a 429 or quota refusal that did not say how long.
COOL_DOWN_S: Final = 60.0


def pick(refs: Sequence[str], cooling_until: Mapping[str, float], now: float) -> str | None:
    """The first of ``refs`` not cooling at ``now`` (``time.monotonic()`` seconds), or
    None when every one is (pure)."""
    for ref in refs:
        if cooling_until.get(ref, 0.0) <= now:
            return ref
    return None


class KeyPools:
    """When each pooled key may serve again, by target and secret reference."""

    def __init__(self) -> None:
        self._cooling: dict[str, dict[str, float]] = {}
        self._spent: dict[str, set[str]] = {}  # keys resting after a quota refusal

    def pick(self, target: str, refs: Sequence[str], now: float) -> str | None:
        """The key of ``target``'s pool ``refs`` to use now (:func:`pick`)."""
        return pick(refs, self._cooling.get(target, {}), now)

    def cool(
        self, target: str, ref: str, seconds: float | None, now: float, *, spent: bool = False
    ) -> None:
        """``ref`` of ``target`` rests for ``seconds`` (None: :data:`COOL_DOWN_S`);
        ``spent``: after a quota refusal (else a rate limit)."""
        wait = COOL_DOWN_S if seconds is None else seconds
        self._cooling.setdefault(target, {})[ref] = now + wait
        spent_keys = self._spent.setdefault(target, set())
        if spent:
            spent_keys.add(ref)
        else:
            spent_keys.discard(ref)

    def spent(self, target: str, refs: Sequence[str]) -> bool:
        """True when every one of ``refs`` rests after a quota refusal."""
        spent_keys = self._spent.get(target, set())
        return bool(refs) and all(ref in spent_keys for ref in refs)

    def until(self, target: str, refs: Sequence[str]) -> float | None:
        """The monotonic time the first of ``refs`` serves again (None: no key rests)."""
        times = [self._cooling.get(target, {}).get(ref, 0.0) for ref in refs]
        return min(times) if times else None

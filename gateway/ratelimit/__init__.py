"""Rate-limit groups: ``local`` (a token bucket per process, aiolimiter), ``cluster``
(shared through Redis; imported only with a ``redis:`` section) and ``headers`` (what an
upstream's answer says about its limits)."""

from gateway.ratelimit.headers import provider_hold_s, retry_after_s
from gateway.ratelimit.local import (
    MAX_PROVIDER_HOLD_S,
    AdmitHook,
    GroupFactory,
    RateLimitGroup,
    RateLimitGroups,
)

__all__ = [
    "MAX_PROVIDER_HOLD_S",
    "AdmitHook",
    "GroupFactory",
    "RateLimitGroup",
    "RateLimitGroups",
    "provider_hold_s",
    "retry_after_s",
]

"""Retry decisions (pure): what may be retried, how long to wait, what ``Retry-After`` says.

* Only what the target's ``retry.retry_on`` lists is retried (by default 429, 500, 502,
  503, 504, 529, ``timeout`` and ``connect``); other 4xx answers are permanent. Unless
  the upstream said otherwise in the answer (:func:`gateway.providers.error_hint`): a
  quota or credit error is never retried, ``x-should-retry: false`` stops retries and
  ``x-should-retry: true`` allows one for any status, as the OpenAI and Anthropic SDKs
  do; ``max_retries`` and the deadline still bound them.
* A connection that was never established is always safe to retry. A timeout or a lost
  connection after the request was sent is retried only for idempotent methods
  (RFC 9110 section 9.2.2: GET, HEAD, PUT, DELETE, OPTIONS) or a request carrying an
  idempotency key; otherwise the outcome is unknown and the caller must be told.
* Waits are exponential backoff with full jitter (``uniform(0, min(cap, base * 2**n))``,
  AWS Architecture Blog, "Exponential Backoff And Jitter"), unless the upstream said how
  long to wait: ``retry-after-ms`` (milliseconds, OpenAI and Anthropic) or ``Retry-After``
  (delay-seconds or an HTTP-date, RFC 9110 section 10.2.3).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from typing import Final

from gateway.envelope import IDEMPOTENT_METHODS
from gateway.providers.base import ErrorHint
from gateway.ratelimit.headers import retry_after_s
from gateway.upstream import TransportKind

#: An answer's Retry-After beyond this is treated as this (a day): it bounds arithmetic.
MAX_RETRY_AFTER_S: Final = 86400.0


def parse_retry_after(headers: Mapping[str, str], now_epoch_s: float) -> float | None:
    """Seconds the upstream asked us to wait (``retry-after-ms``, else ``Retry-After``),
    capped at :data:`MAX_RETRY_AFTER_S`; None when absent or unreadable (then backoff
    applies). The parsing rules live in :func:`gateway.ratelimit.headers.retry_after_s`."""
    seconds = retry_after_s(headers, now_epoch_s)
    return None if seconds is None else min(seconds, MAX_RETRY_AFTER_S)


def backoff_s(retry_number: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Full-jitter wait before retry ``retry_number`` (0 for the first retry), seconds."""
    ceiling = min(cap_s, base_s * (2 ** min(retry_number, 32)))
    return rng.uniform(0.0, ceiling)


def status_retryable(
    status: int, retry_on: Collection[int | str], hint: ErrorHint | None = None
) -> bool:
    """True if an answer with ``status`` may be retried: by the upstream's own word in
    ``hint`` when it has a verdict (``retry`` yes; ``quota`` and ``no_retry`` no), else by
    whether ``retry_on`` lists ``status``."""
    if hint is not None and hint.verdict is not None:
        return hint.verdict == "retry"
    return status in retry_on


def transport_retryable(
    kind: TransportKind,
    *,
    sent: bool,
    method: str,
    has_idempotency_key: bool,
    retry_on: Collection[int | str],
) -> tuple[bool, bool]:
    """Whether a transport failure may be retried, and whether its outcome is unknown.

    Returns ``(retryable, outcome_unknown)``. ``sent`` is True once the request headers
    reached the wire: from then on the upstream may have acted on the request.
    """
    listed = ("connect" if kind in ("connect", "reset") else "timeout") in retry_on
    if not sent:
        return listed, False
    safe_to_resend = method in IDEMPOTENT_METHODS or has_idempotency_key
    if not safe_to_resend:
        return False, True
    return listed, False

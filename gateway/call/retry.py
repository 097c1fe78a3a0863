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
  idempotency key; otherwise the outcome is unknown and the caller must be told. One
  exception (:func:`unanswered_resendable`): a connection reset before the answer's
  head, on a provider dialect's inference endpoint, where a duplicate costs tokens and
  nothing else, as every provider SDK resends it (``retry.resend_unanswered``).
* Waits are exponential backoff with full jitter (``uniform(0, min(cap, base * 2**n))``,
  AWS Architecture Blog, "Exponential Backoff And Jitter"), unless the upstream said how
  long to wait: ``retry-after-ms`` (milliseconds, OpenAI and Anthropic) or ``Retry-After``
  (delay-seconds or an HTTP-date, RFC 9110 section 10.2.3). A 429 that said nothing
  waits at least :data:`RATE_LIMITED_FLOOR_S` (within the cap).
* After the target's attempts failed (:func:`next_option`): the next of its
  ``fallbacks``, for a failure :func:`failover_reason` names, while nothing reached the
  agent and time is left.
* What next after an attempt (:func:`next_step`): its :class:`Outcome` and the call's
  :class:`RetryBudget` (retries and time) give one :class:`Step`: retry after a wait,
  or stop. A 2xx stream that ended before its terminal marker is judged by what reached
  the agent, never by how its end was framed: a connection close, a broken chunked body
  or a missing marker are one outcome, retried when nothing was relayed and resending
  is safe (:meth:`Outcome.stream_end`).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple

from gateway.envelope import IDEMPOTENT_METHODS
from gateway.providers import resendable
from gateway.providers.base import ErrorHint
from gateway.ratelimit.headers import retry_after_s
from gateway.upstream import TransportKind

if TYPE_CHECKING:
    from gateway.errors import GatewayError

#: An answer's Retry-After beyond this is treated as this (a day): it bounds arithmetic.
MAX_RETRY_AFTER_S: Final = 86400.0
#: The least wait before retrying a 429 that said nothing of when (seconds; never more
#: than the target's ``backoff_max_s``): full jitter alone can resend it at once.
RATE_LIMITED_FLOOR_S: Final = 1.0


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


def unanswered_resendable(
    setting: bool | None, provider: str, endpoint: str, parameters: Mapping[str, Any]
) -> bool:
    """Whether a request lost before its answer may be sent again (to its target or a
    fallback) without an idempotency key: not when the target's
    ``retry.resend_unanswered`` is ``false`` (``setting``), else when a duplicate costs
    tokens and nothing else (:func:`gateway.providers.resendable`: an inference
    endpoint of the target's ``usage`` dialect ``provider``)."""
    return setting is not False and resendable(provider, endpoint, parameters)


def transport_retryable(
    kind: TransportKind,
    *,
    sent: bool,
    method: str,
    has_idempotency_key: bool,
    retry_on: Collection[int | str],
    answered: bool = False,
    resend_unanswered: bool = False,
) -> tuple[bool, bool]:
    """Whether a transport failure may be retried, and whether its outcome is unknown.

    Returns ``(retryable, outcome_unknown)``. ``sent`` is True once the request headers
    reached the wire: from then on the upstream may have acted on the request.
    ``answered``: the answer's head had arrived. ``resend_unanswered``
    (:func:`unanswered_resendable`): a reset before the answer's head may be sent again
    without a key (a timeout may not: a silent upstream sent it again would likely stay
    silent for another whole attempt; a fallback is the remedy).
    """
    listed = ("connect" if kind in ("connect", "reset") else "timeout") in retry_on
    if not sent:
        return listed, False
    safe_to_resend = (
        method in IDEMPOTENT_METHODS
        or has_idempotency_key
        or (resend_unanswered and kind == "reset" and not answered)
    )
    if not safe_to_resend:
        return False, True
    return listed, False


class Outcome(NamedTuple):
    """One attempt's outcome, as :func:`next_step` reads it.

    ``error`` None is a success (the answer is the call's), unless ``refreshed``: a
    cached credential was refused (401) and resolved again, so the request goes again at
    once, not counted as a retry. ``retryable``: the error may be met by sending again
    (its class, the method, the key, what the upstream said). ``retry_after_s``: the
    wait the upstream asked for (seconds; None: backoff). ``resend``: the upstream may
    have acted on the attempt, so a resend books it first (a budget's reservation)."""

    error: GatewayError | None = None
    retryable: bool = False
    retry_after_s: float | None = None
    resend: bool = False
    refreshed: bool = False

    @classmethod
    def stream_end(cls, error: GatewayError, *, relayed: bool, safe_to_resend: bool) -> Outcome:
        """A 2xx stream judged a failure at its end (STREAM_INTERRUPTED whether the
        connection closed, a chunked body broke or the marker never came; an error
        event's code). Retryable when nothing of it reached the agent (``relayed``
        False: an assembled stream, or a relay not yet opened) and the request is
        ``safe_to_resend`` (an idempotent method or an idempotency key)."""
        retryable = error.retryable and safe_to_resend and not relayed
        return cls(error, retryable, resend=True)


#: The outcome of an attempt that ended the call well.
DONE: Final = Outcome()


class RetryBudget(NamedTuple):
    """What a call may spend on retries: ``retries`` (the envelope's ``max_retries``
    within the target's), its ``deadline`` (``time.monotonic()`` seconds) and the
    target's backoff (base and cap, seconds)."""

    retries: int
    deadline: float
    backoff_base_s: float
    backoff_max_s: float


Action = Literal["retry", "stop"]
#: Why :func:`next_step` decided as it did.
Reason = Literal["done", "refreshed", "not_retryable", "no_retries_left", "deadline", "backoff"]


class Step(NamedTuple):
    """What to do after an attempt: ``retry`` after sleeping ``wait_s`` (None: at once,
    without yielding), booking the last attempt first when ``resend``, counting it as a
    retry when ``counted``; or ``stop`` with the outcome's answer or error. A ``stop``
    for ``deadline`` carries in ``wait_s`` the wait that would have passed it (the
    caller's suggested ``retry_after_s``)."""

    action: Action
    reason: Reason
    wait_s: float | None = None
    resend: bool = False
    counted: bool = True


# The steps that carry nothing of their own, made once (the first is every good call's).
_DONE: Final = Step("stop", "done")
_REFRESHED: Final = Step("retry", "refreshed", counted=False)
_NOT_RETRYABLE: Final = Step("stop", "not_retryable")
_NO_RETRIES_LEFT: Final = Step("stop", "no_retries_left")


def next_step(
    outcome: Outcome, retry_number: int, budget: RetryBudget, now: float, rng: random.Random
) -> Step:
    """The step after an attempt (pure; ``rng`` draws the jitter, only when a retry is
    allowed). ``retry_number`` counts the retries already made (0 after the first
    attempt); ``now`` is ``time.monotonic()``. A wait that would reach the deadline
    stops the call instead of sleeping into it."""
    if outcome.refreshed:
        return _REFRESHED
    if outcome.error is None:
        return _DONE
    if not outcome.retryable:
        return _NOT_RETRYABLE
    if retry_number >= budget.retries:
        return _NO_RETRIES_LEFT
    wait = outcome.retry_after_s
    if wait is None:
        wait = backoff_s(retry_number, budget.backoff_base_s, budget.backoff_max_s, rng)
        if outcome.error.status_code == 429:
            # Full jitter may draw ~0: a rate limit retried at once is refused again.
            wait = max(wait, min(RATE_LIMITED_FLOOR_S, budget.backoff_max_s))
    if now + wait >= budget.deadline:
        return Step("stop", "deadline", wait_s=wait)
    return Step("retry", "backoff", wait_s=wait, resend=outcome.resend)


#: Why a call moved to its next fallback (the ``reason`` label of
#: ``egress_gateway_failovers_total`` and of each attempt in the audit record).
FailoverReason = Literal[
    "upstream_5xx",
    "rate_limited",
    "quota",
    "connect",
    "first_byte_timeout",
    "circuit_open",
    "stream_failed",
    "context_length_exceeded",
]

#: Phrases of the providers' context-window refusals (OpenAI's ``code``; Anthropic's
#: "prompt is too long"; Gemini's "exceeds the maximum number of tokens").
_CONTEXT_LENGTH: Final = (
    "context_length_exceeded",
    "prompt is too long",
    "maximum number of tokens",
)


def failover_reason(
    error: GatewayError,
    *,
    relayed: bool,
    fallback_on: Collection[str],
    resend_unanswered: bool = False,
) -> FailoverReason | None:
    """Why the call may move to its next fallback after its target's attempts ended in
    ``error``, or None when it may not (pure). Never once a byte reached the agent
    (``relayed``): a cut stream is the agent's STREAM_INTERRUPTED, never spliced. The
    retryable failures move on (a 5xx or 529, a 429 or a quota refusal, a connection
    never made or reset before the answer, no answer within the attempt's limit, an open
    breaker, a stream that ended before reaching the agent); a refusal of the request
    itself (400, 401/403, a content filter) does not, unless ``fallback_on`` lists its
    kind (``context_length_exceeded``). A passed deadline leaves no time to move.
    ``resend_unanswered`` (:func:`unanswered_resendable`): the call is one whose
    duplicate costs tokens and nothing else, so a request lost after it was sent
    (OUTCOME_UNKNOWN: a timeout, or an answer lost after it began) moves on too."""
    if relayed:
        return None
    code = error.code.value
    details = error.details
    if code == "CIRCUIT_OPEN":
        return "circuit_open"
    if code == "QUOTA_EXHAUSTED" and details.get("source") == "upstream":
        return "quota"
    if code == "CAPACITY_EXCEEDED" and details.get("source") == "upstream":
        return "rate_limited"
    if code == "DEPENDENCY_FAILED" and "upstream_status" in details:
        return "upstream_5xx"
    if code == "DEPENDENCY_FAILED" and details.get("reason") in ("connect", "reset"):
        return "connect"
    if code == "AGENT_TIMEOUT" and details.get("reason") == "attempt_timeout":
        return "first_byte_timeout"
    if code == "STREAM_INTERRUPTED":
        return "stream_failed"
    if code == "OUTCOME_UNKNOWN" and resend_unanswered:
        return "first_byte_timeout" if details.get("reason") == "timeout" else "connect"
    if (
        "context_length_exceeded" in fallback_on
        and code == "UPSTREAM_REJECTED"
        and _says_context_length(error.data)
    ):
        return "context_length_exceeded"
    return None


def _says_context_length(data: object) -> bool:
    """True when an error body (``{"error": {...}}``) names a context-window refusal."""
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return False
    said = " ".join(str(error.get(k, "")) for k in ("code", "type", "message")).lower()
    return any(phrase in said for phrase in _CONTEXT_LENGTH)


class Option(NamedTuple):
    """What to do after a target's attempts failed: ``fallback`` to option ``choice`` of
    the target's ``fallbacks`` for ``reason``, or ``stop`` (``reason`` None: not a
    failure to move on from; else no option or no time left)."""

    action: Literal["fallback", "stop"]
    choice: int = -1
    reason: FailoverReason | None = None


def next_option(
    error: GatewayError,
    tried: int,
    options: int,
    *,
    relayed: bool,
    fallback_on: Collection[str],
    now: float,
    deadline: float,
    resend_unanswered: bool = False,
) -> Option:
    """The call's next option after its ``tried``-th fallback failed (0: the primary)
    with ``error`` (pure): the next of ``options`` fallbacks while time is left before
    ``deadline`` (``time.monotonic()`` seconds), else stop. ``relayed``, ``fallback_on``
    and ``resend_unanswered`` as :func:`failover_reason` reads them."""
    reason = failover_reason(
        error, relayed=relayed, fallback_on=fallback_on, resend_unanswered=resend_unanswered
    )
    if reason is None or tried >= options or now >= deadline:
        return Option("stop", reason=reason)
    return Option("fallback", tried, reason)

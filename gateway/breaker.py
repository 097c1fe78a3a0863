"""Circuit breakers, one per target (pybreaker), with exactly one half-open probe.

States (M. Nygard, "Release It!", as pybreaker implements them)::

    closed --fail_max consecutive failed attempts--> open
    open --reset_timeout_s elapsed, next acquire--> half_open (that acquire is the probe)
    half_open --probe succeeds--> closed
    half_open --probe fails--> open (for reset_timeout_s again)
    half_open --probe released (cancelled, outcome unknown)--> half_open, next acquire probes

Guarantee (checkable by counting upstream hits): after ``fail_max`` consecutive failed
attempts no attempt reaches the target for ``reset_timeout_s``; after that at most one
attempt is in flight until one succeeds. Meanwhile :meth:`TargetBreaker.acquire` raises
:class:`CircuitOpen` at once (retryable) with ``retry_after_s`` = the time until the
next probe while open, or the probe's remaining attempt time (at least 0.1 s) while it
is in flight. A probe whose attempt time has passed without an outcome no longer holds
the slot.

What counts (:func:`is_failure`): an attempt answered 5xx (incl. 529) or ended by a
timeout, a failed connect or a lost connection. 4xx answers (incl. 429) are the
upstream working as designed and count as successes; a cancelled attempt counts as
nothing. The breaker counts attempts, not calls: each retry is an attempt.

pybreaker's ``call_async`` needs tornado and holds a threading lock across the await,
and abandoning its ``calling()`` generator counts as a failure; so permits drive
pybreaker's state machine with a synchronous ``call()`` per outcome, and the single
probe is this module's guard (no await happens between check and grant).

Policy keys: ``targets.<name>.circuit_breaker.fail_max``, ``.reset_timeout_s``
(``circuit_breaker: null`` = no breaker for that target).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Final, Literal, NoReturn

from gateway.audit import get_logger
from gateway.errors import CircuitOpen
from gateway.imports import without
from gateway.policy import BreakerSpec, TargetSpec

# pybreaker imports redis-py when it is installed, for a Redis state storage this module
# does not use (state is in CircuitMemoryStorage): 6.7 MiB of RSS in every sidecar. The
# cluster stores import redis-py themselves when the policy has a ``redis:`` section.
with without("redis"):
    from pybreaker import (
        STATE_CLOSED,
        STATE_HALF_OPEN,
        STATE_OPEN,
        CircuitBreaker,
        CircuitBreakerError,
        CircuitBreakerListener,
        CircuitBreakerState,
        CircuitMemoryStorage,
    )

__all__ = [
    "FAILURE_KINDS",
    "MIN_PROBE_RETRY_AFTER_S",
    "BreakerState",
    "CircuitBreakers",
    "Permit",
    "StateChangeHook",
    "TargetBreaker",
    "breaker_specs",
    "is_failure",
]

BreakerState = Literal["closed", "open", "half_open"]
#: (target, old_state, new_state); must not raise (exceptions are swallowed).
StateChangeHook = Callable[[str, BreakerState, BreakerState], None]

#: Exception kinds of an attempt that count as failures: the transport failures of
#: :class:`gateway.upstream.TransportError` (``timeout``: no answer within the attempt's
#: time; ``connect``: the connection was never established; ``reset``: lost after
#: sending, or an unreadable answer). Any other kind (``cancelled`` above all) is not.
FAILURE_KINDS: Final[frozenset[str]] = frozenset({"timeout", "connect", "reset"})
#: Floor of ``retry_after_s`` while the half-open probe is in flight (design.md).
MIN_PROBE_RETRY_AFTER_S: Final = 0.1

_NAMES: Final[dict[str, BreakerState]] = {
    STATE_CLOSED: "closed",
    STATE_OPEN: "open",
    STATE_HALF_OPEN: "half_open",
}


def is_failure(status: int | None, exc_kind: str | None) -> bool:
    """Whether an attempt's outcome counts against the target's health.

    ``status`` is the upstream's HTTP status (None if there was no answer); ``exc_kind``
    the kind of exception that ended the attempt (None if none). True for 5xx (RFC 9110
    section 15.6; 529 is Anthropic's "overloaded") and for :data:`FAILURE_KINDS`; false
    for 1xx-4xx (a 4xx, 429 included, is the upstream answering as designed) and for
    cancellation.
    """
    if exc_kind is not None:
        return exc_kind in FAILURE_KINDS
    return status is not None and 500 <= status <= 599


class _AttemptFailed(Exception):
    """Raised into pybreaker to make it count one failed attempt."""


def _succeed() -> None:
    return None


def _fail() -> NoReturn:
    raise _AttemptFailed


class Permit:
    """Leave to make one attempt; settle it exactly once (later calls are ignored).

    :meth:`success` / :meth:`failure` record the outcome; :meth:`release` records none
    (cancelled, or the outcome is unknown): it frees the probe slot without closing or
    opening the breaker. Calling :meth:`release` in a ``finally`` after settling is safe.
    Outcomes of permits granted before the breaker last changed state are ignored.
    """

    __slots__ = ("_breaker", "_generation", "_settled", "probe")

    def __init__(self, breaker: TargetBreaker, generation: int, *, probe: bool) -> None:
        self._breaker = breaker
        self._generation = generation
        self._settled = False
        self.probe = probe

    def success(self) -> None:
        self._settle(True)

    def failure(self) -> None:
        self._settle(False)

    def release(self) -> None:
        self._settle(None)

    def record(self, status: int | None, exc_kind: str | None) -> None:
        """Settle from an attempt's outcome: :func:`is_failure` decides failure; an
        exception kind outside :data:`FAILURE_KINDS` (e.g. ``cancelled``) releases."""
        if exc_kind is not None and exc_kind not in FAILURE_KINDS:
            self.release()
        elif is_failure(status, exc_kind):
            self.failure()
        else:
            self.success()

    def _settle(self, ok: bool | None) -> None:
        if not self._settled:
            self._settled = True
            self._breaker._settle(self, ok)

    def __repr__(self) -> str:
        kind = "probe" if self.probe else "permit"
        return f"<{kind} for {self._breaker.target!r}, settled={self._settled}>"


class _Listener(CircuitBreakerListener):
    def __init__(self, owner: TargetBreaker) -> None:
        self._owner = owner

    def state_change(
        self,
        cb: CircuitBreaker,
        old_state: CircuitBreakerState | None,
        new_state: CircuitBreakerState,
    ) -> None:
        old = _NAMES[old_state.name] if old_state is not None else "closed"
        self._owner._changed(old, _NAMES[new_state.name])


class TargetBreaker:
    """The circuit breaker of one target. Use from one event loop (or one thread)."""

    def __init__(
        self,
        target: str,
        spec: BreakerSpec,
        *,
        on_state_change: StateChangeHook | None = None,
        model: str | None = None,
    ) -> None:
        self.target = target
        #: The model this breaker is for (a provider-dialect target's per-model breaker).
        self.model = model
        self._whose = f"target {target!r}" + (f" for model {model!r}" if model else "")
        self.spec = spec
        self._storage = CircuitMemoryStorage(STATE_CLOSED)
        self._cb = CircuitBreaker(
            fail_max=spec.fail_max,
            reset_timeout=spec.reset_timeout_s,
            state_storage=self._storage,
            listeners=[_Listener(self)],
            name=target,
        )
        self._hook = on_state_change
        # Bumped at every state change and every probe granted; a permit from an older
        # generation no longer speaks for the breaker's current state.
        self._generation = 0
        self._probe_until: float | None = None  # monotonic time the probe's attempt ends

    @property
    def state(self) -> BreakerState:
        return _NAMES[self._cb.current_state]

    @property
    def failures(self) -> int:
        """Consecutive failed attempts counted so far."""
        return self._cb.fail_counter

    def seconds_until_probe(self) -> float:
        """While open: seconds until the next probe may go (0 when it may); else 0."""
        opened_at = self._storage.opened_at
        if self._cb.current_state != STATE_OPEN or opened_at is None:
            return 0.0
        reopen = opened_at.timestamp() + self._cb.reset_timeout
        return max(reopen - datetime.now(UTC).timestamp(), 0.0)

    def acquire(self, *, attempt_timeout_s: float) -> Permit:
        """Leave for one attempt of at most ``attempt_timeout_s`` seconds.

        Raises :class:`CircuitOpen` (``details`` ``{"target", "state"}``, state "open"
        or "half_open") when the breaker is open or its probe is in flight.
        """
        if self._cb.current_state == STATE_OPEN:
            wait = self.seconds_until_probe()
            if wait > 0:
                raise CircuitOpen(
                    f"the circuit breaker of {self._whose} is open after "
                    f"{self.spec.fail_max} failed attempts in a row; the next probe may "
                    f"go in {wait:.3f} s, retry then",
                    details=self._details("open"),
                    retry_after_s=wait,
                )
            self._cb.half_open()
        if self._cb.current_state == STATE_HALF_OPEN:
            now = time.monotonic()
            if self._probe_until is not None and now < self._probe_until:
                wait = max(self._probe_until - now, MIN_PROBE_RETRY_AFTER_S)
                raise CircuitOpen(
                    f"the circuit breaker of {self._whose} is half-open and its "
                    f"probe call is in flight; retry in {wait:.3f} s",
                    details=self._details("half_open"),
                    retry_after_s=wait,
                )
            self._generation += 1
            self._probe_until = now + max(attempt_timeout_s, 0.0)
            return Permit(self, self._generation, probe=True)
        return Permit(self, self._generation, probe=False)

    def _details(self, state: str) -> dict[str, str]:
        details = {"target": self.target, "state": state}
        if self.model is not None:
            details["model"] = self.model
        return details

    def update(self, spec: BreakerSpec) -> None:
        """Apply new limits, keeping the current state and counts."""
        self.spec = spec
        self._cb.fail_max = spec.fail_max
        self._cb.reset_timeout = spec.reset_timeout_s

    def _settle(self, permit: Permit, ok: bool | None) -> None:
        if permit._generation != self._generation:
            return
        state = self._cb.current_state
        if permit.probe:
            self._probe_until = None
            if ok is None or state != STATE_HALF_OPEN:
                return
        elif ok is None or state != STATE_CLOSED:
            return
        elif ok and self._cb.fail_counter == 0:
            return  # pybreaker's success when closed resets the failure count: already 0
        # pybreaker re-raises a counted failure (as CircuitBreakerError when it trips).
        with contextlib.suppress(_AttemptFailed, CircuitBreakerError):
            self._cb.call(_succeed if ok else _fail)

    def _changed(self, old: BreakerState, new: BreakerState) -> None:
        self._generation += 1
        if new != "half_open":
            self._probe_until = None
        if self._hook is not None and old != new:
            _run_hook(self._hook, self.target, old, new)


def breaker_specs(targets: Mapping[str, TargetSpec]) -> dict[str, BreakerSpec | None]:
    """The ``circuit_breaker`` of each target (None = no breaker)."""
    return {name: target.circuit_breaker for name, target in targets.items()}


#: Models of one target with a breaker of their own (agents name the models: bounded);
#: beyond these, a model shares the target's breaker.
MAX_MODEL_BREAKERS: Final = 32


class CircuitBreakers:
    """The breakers of a policy's targets, by target name (see :func:`breaker_specs`),
    and per model on a provider-dialect target (:meth:`get` with ``model``): one failing
    model must not refuse every model of its target."""

    def __init__(self, specs: Mapping[str, BreakerSpec | None]) -> None:
        self._hooks: list[StateChangeHook] = []
        self._breakers: dict[str, TargetBreaker] = {}
        self._models: dict[tuple[str, str], TargetBreaker] = {}
        self._model_counts: dict[str, int] = {}
        self.update(specs)

    def get(self, target: str, model: str | None = None) -> TargetBreaker | None:
        """The breaker of ``target``'s ``model`` (made on first use, with the target's
        limits; the target's own past :data:`MAX_MODEL_BREAKERS` models), or the target's
        breaker when ``model`` is None; None if the target has no breaker."""
        if model is None:
            return self._breakers.get(target)
        breaker = self._models.get((target, model))
        if breaker is not None:
            return breaker
        shared = self._breakers.get(target)
        count = self._model_counts.get(target, 0)
        if shared is None or count >= MAX_MODEL_BREAKERS:
            return shared
        breaker = TargetBreaker(target, shared.spec, on_state_change=self._dispatch, model=model)
        self._models[(target, model)] = breaker
        self._model_counts[target] = count + 1
        return breaker

    def on_state_change(self, callback: StateChangeHook) -> None:
        """Call ``callback(target, old_state, new_state)`` on every state change (for
        audit events and metrics). It runs synchronously and must not raise."""
        self._hooks.append(callback)

    def update(self, specs: Mapping[str, BreakerSpec | None]) -> None:
        """Hot reload: existing breakers keep their state and counts (with the new
        limits); targets without a breaker (None) or gone from ``specs`` are dropped."""
        breakers: dict[str, TargetBreaker] = {}
        for target, spec in specs.items():
            if spec is None:
                continue
            breaker = self._breakers.get(target)
            if breaker is None:
                breaker = TargetBreaker(target, spec, on_state_change=self._dispatch)
            elif breaker.spec != spec:
                breaker.update(spec)
            breakers[target] = breaker
        self._breakers = breakers
        models: dict[tuple[str, str], TargetBreaker] = {}
        for key, breaker in self._models.items():  # a model's breaker follows its target's
            shared = breakers.get(key[0])
            if shared is None:
                continue
            if breaker.spec != shared.spec:
                breaker.update(shared.spec)
            models[key] = breaker
        self._models = models
        self._model_counts = {}
        for target, _ in models:
            self._model_counts[target] = self._model_counts.get(target, 0) + 1

    def _dispatch(self, target: str, old: BreakerState, new: BreakerState) -> None:
        for hook in self._hooks:
            _run_hook(hook, target, old, new)


def _run_hook(hook: StateChangeHook, target: str, old: BreakerState, new: BreakerState) -> None:
    # pybreaker notifies listeners before it stores the new state, so an exception
    # escaping here would leave the breaker half-switched; and one failing hook must
    # not starve the others. Log it and carry on.
    try:
        hook(target, old, new)
    except Exception:  # noqa: BLE001 - logged below; see the comment above
        get_logger("breaker").exception(
            "breaker_hook_failed", target=target, old_state=old, new_state=new
        )

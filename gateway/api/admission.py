"""Admission by bytes: the memory that request bodies in flight may hold is bounded
(docs/performance.md; policy key ``server.max_inflight_request_bytes``).

Each request body is charged what it may cost the process while its call runs, before
the call parses it: :func:`held_bytes`, an upper bound measured for the body's shapes
(its bytes held a few times over: as read, as parsed text, as re-encoded for the
upstream; and one Python object per JSON value, which is what makes a dense array of
small values cost tens of times its bytes). A body is charged its Content-Length times
:data:`COPIES` before a byte of it is read, the bytes as they arrive when it is chunked
or coded, and its full charge once read; the charge is given back when its answer has
been written. When the budget cannot take a charge, the request is refused at once
(:func:`refusal`: CAPACITY_EXCEEDED, HTTP 429, retryable, ``suggested_retry_after``)
and nothing more of its body is read; a body whose charge alone is larger than the
whole budget can never be admitted, and is refused as too large (INVALID_PAYLOAD 413,
``details.reason: too_large_in_memory``).

:class:`ByteBudget` is the pure accounting; :class:`Charge` is one request's share of
it, an async context manager that gives its bytes back on exit, whatever happened.
"""

from __future__ import annotations

from types import TracebackType
from typing import Final

from gateway.errors import CapacityExceeded, InvalidPayload

#: How many times a body's bytes may be held at once while its call runs, measured on
#: the envelope, drop-in and MCP routes with one long string (docs/performance.md:
#: 3.3x on the envelope and drop-in routes, up to 4.7x on the MCP route, whose body also
#: goes through base64), with room for the allocator's slack: the bytes read, the parsed
#: text, the JSON re-encoded for the upstream and a transient copy (token estimate,
#: idempotency fingerprint).
COPIES: Final = 6
#: Bytes charged per JSON value beyond its text (each ``,``, ``[`` and ``{`` of the
#: body: an upper bound on the values it holds): a Python object and the list or dict
#: slot that points at it (an empty dict is 64 bytes, an int 28, a float 24, a short
#: string ~50, a slot 8 to ~100 in a dict), measured at 49-79 bytes per count (arrays
#: of empty objects, of integers, of short distinct strings).
VALUE_BYTES: Final = 96
#: The wait suggested to a refused agent, seconds: about the time an 8 MiB call in
#: flight takes to be read, forwarded and answered on loopback.
RETRY_AFTER_S: Final = 1.0


def held_bytes(body: bytes | bytearray) -> int:
    """The bytes ``body`` is charged: ``COPIES`` x its length + ``VALUE_BYTES`` x the
    JSON values it may hold (its ``,``, ``[`` and ``{``, counted in C, strings included:
    an upper bound for any body, JSON or not)."""
    values = body.count(b",") + body.count(b"[") + body.count(b"{")
    return COPIES * len(body) + VALUE_BYTES * values


class ByteBudget:
    """``limit_bytes`` to share among the requests in flight (pure: no I/O, no clock).

    ``held`` is what the charges of the requests in flight add up to; never above
    ``limit_bytes``. ``refused`` counts the charges that did not fit.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held = 0
        self.refused = 0

    def take(self, n: int) -> bool:
        """Add ``n`` bytes (>= 0) to what is held if they fit; False (nothing taken) if not."""
        if self.held + n > self.limit_bytes:
            self.refused += 1
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        """Give back ``n`` bytes taken earlier."""
        self.held = max(self.held - n, 0)

    def charge(self) -> Charge:
        """A new request's share, empty until it grows (:meth:`Charge.grow_to`)."""
        return Charge(self)


class Charge:
    """One request's bytes in a :class:`ByteBudget`: grown as its body is read, given back
    whole when the ``async with`` block ends (or by :meth:`release`; idempotent)."""

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.bytes = 0

    def grow_to(self, n: int) -> None:
        """Hold ``n`` bytes in all (nothing changes if ``n`` is not more than held now).

        Raises :class:`~gateway.errors.InvalidPayload` (413, ``too_large_in_memory``) if
        ``n`` is more than the whole budget, :class:`~gateway.errors.CapacityExceeded`
        (429, retryable) if it is not but the requests in flight leave too little; either
        way the bytes already held stay held until the charge is released."""
        more = n - self.bytes
        if more <= 0:
            return
        budget = self._budget
        if n > budget.limit_bytes:
            budget.refused += 1
            raise too_large_in_memory(n, budget.limit_bytes)
        if not budget.take(more):
            raise refusal(n, budget)
        self.bytes = n

    def release(self) -> None:
        self._budget.give(self.bytes)
        self.bytes = 0

    async def __aenter__(self) -> Charge:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def refusal(wanted: int, budget: ByteBudget) -> CapacityExceeded:
    """CAPACITY_EXCEEDED (429, retryable): the bodies in flight hold too much for this one."""
    return CapacityExceeded(
        f"the sidecar is holding {budget.held} bytes of request bodies in flight and this "
        f"request needs {wanted} more than its budget of {budget.limit_bytes} allows "
        "(server.max_inflight_request_bytes in the policy); retry shortly",
        details={
            "reason": "request_bytes_in_flight",
            "requested_bytes": wanted,
            "held_bytes": budget.held,
            "limit_bytes": budget.limit_bytes,
        },
        retry_after_s=RETRY_AFTER_S,
    )


def too_large_in_memory(wanted: int, limit: int) -> InvalidPayload:
    """INVALID_PAYLOAD 413: this body alone would hold more than the whole budget."""
    return InvalidPayload(
        f"this request body would hold about {wanted} bytes of memory while its call runs "
        f"(server.max_inflight_request_bytes allows {limit} for all calls in flight); "
        "send a smaller or less dense body (fewer JSON values)",
        details={"reason": "too_large_in_memory", "requested_bytes": wanted, "limit_bytes": limit},
        http_status=413,
    )

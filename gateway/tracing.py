"""W3C Trace Context (https://www.w3.org/TR/trace-context/) for outbound calls (pure).

The agent may send ``traceparent`` (and ``tracestate``) in the envelope's ``headers``;
a valid one is continued: same trace-id, a new parent-id for this outbound call. With
none (or an invalid one, which the spec says to discard), a traceparent is created from
the envelope's ``trace_id``: used as is when it already is 32 lower-case hex digits,
else the first 32 hex digits of its SHA-256, so one agent transaction is one trace.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Mapping
from typing import Final

TRACE_HEADERS: Final = frozenset({"traceparent", "tracestate"})
_TRACEPARENT: Final = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_HEX32: Final = re.compile(r"^[0-9a-f]{32}$")
_ZERO_TRACE: Final = "0" * 32
_ZERO_SPAN: Final = "0" * 16
#: Envelope trace ids whose trace-id was derived (an agent's transaction spans several
#: calls): at most this many kept, all dropped when full; longer ids are not kept.
_MAX_KNOWN: Final = 1024
_MAX_KNOWN_LENGTH: Final = 256
_known: dict[str, str] = {}


def trace_id_of(envelope_trace_id: str) -> str:
    """A W3C trace-id (32 hex digits, not all zero) for an envelope's ``trace_id``."""
    if (
        len(envelope_trace_id) == 32
        and envelope_trace_id != _ZERO_TRACE
        and _HEX32.match(envelope_trace_id)
    ):
        # Already one (the ids the sidecar generates, a traceparent's): itself, uncached;
        # a fresh id per call would only fill the cache (and clear it) with itself.
        return envelope_trace_id
    known = _known.get(envelope_trace_id)
    if known is not None:
        return known
    derived = hashlib.sha256(envelope_trace_id.encode()).hexdigest()[:32]
    if len(envelope_trace_id) <= _MAX_KNOWN_LENGTH:
        if len(_known) >= _MAX_KNOWN:
            _known.clear()
        _known[envelope_trace_id] = derived
    return derived


def outbound_headers(envelope_trace_id: str, agent_headers: Mapping[str, str]) -> dict[str, str]:
    """``traceparent`` (and the agent's ``tracestate`` when its traceparent was valid) for
    one outbound call, with a fresh parent-id."""
    # A parent-id needs to be unique, not secret (W3C Trace Context 3.2.2.4): the
    # Mersenne Twister is enough and skips a getrandom(2) call per request.
    span = f"{random.getrandbits(64) or 1:016x}"
    if not agent_headers:  # most envelopes carry no headers: nothing to continue
        return {"traceparent": f"00-{trace_id_of(envelope_trace_id)}-{span}-01"}
    given = {k.lower(): v for k, v in agent_headers.items() if k.lower() in TRACE_HEADERS}
    parent = given.get("traceparent", "").strip()
    match = _TRACEPARENT.match(parent)
    if match and match[1] != "ff" and match[2] != _ZERO_TRACE and match[3] != _ZERO_SPAN:
        headers = {"traceparent": f"00-{match[2]}-{span}-{match[4]}"}
        if "tracestate" in given:
            headers["tracestate"] = given["tracestate"]
        return headers
    return {"traceparent": f"00-{trace_id_of(envelope_trace_id)}-{span}-01"}

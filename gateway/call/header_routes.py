"""The drop-in route's header routing, call side (pure, no I/O): where each of an SDK's
own headers goes (:func:`split_headers`, called by :func:`gateway.call.proxy.proxy_intake`).

* to the envelope (its ``headers``): ``traceparent``/``tracestate``
  (:data:`gateway.tracing.TRACE_HEADERS`) and the target's ``forward_headers``;
* to the upstream as they came: ``Accept``, the headers the providers' SDKs need
  (:data:`gateway.providers.SDK_HEADERS`), and ``Idempotency-Key``
  (:data:`IDEMPOTENCY_HEADER`) when the policy gives the target no ``idempotency``;
* nowhere: hop-by-hop headers (:data:`HOP_BY_HOP`, and the names a ``Connection``
  header lists), the agent's own credentials
  (:data:`gateway.providers.CREDENTIAL_HEADERS`) and every other header.

A value forwarded as it came must be UTF-8 (:func:`is_utf8`), else the request is
refused. The routes of a target's ``forward_headers`` are computed once
(:func:`_header_routes`), and a request's header names are planned once per name set
(:data:`_SPLITS`, bounded by :data:`_MAX_SPLITS` and :data:`_MAX_PLANNED_CONNECTION`).
"""

from __future__ import annotations

import functools
from typing import Final

from gateway.errors import InvalidPayload
from gateway.policy import CompiledTarget
from gateway.providers import CREDENTIAL_HEADERS, SDK_HEADERS
from gateway.tracing import TRACE_HEADERS

#: Hop-by-hop headers (RFC 9110 section 7.6.1, and the pre-standard ``Keep-Alive`` and
#: ``Proxy-Connection``): they concern one connection and never pass, either way.
HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
#: Passed to the upstream as they came (beneath the policy's ``static_headers``).
_PASSED: Final = SDK_HEADERS | {"accept"}
#: The common idempotency header: the envelope's ``idempotency_key``, or passed through.
IDEMPOTENCY_HEADER: Final = "idempotency-key"


def split_headers(
    headers: dict[str, str], target: CompiledTarget | None
) -> tuple[dict[str, str], dict[str, str]]:
    """The agent's headers as (those the envelope carries: trace headers and the target's
    ``forward_headers``; those passed to the upstream as they are: the SDKs' own, and the
    SDK's idempotency key when the sidecar keeps none for the target). Hop-by-hop and
    credential headers go nowhere. Raises :class:`InvalidPayload` for a forwarded value
    that is not UTF-8."""
    forward = target.forward_headers if target is not None else frozenset()
    # No idempotency of the sidecar's for this target: the SDK's key (Stripe's SDK sends
    # one on every POST and its retries) is the upstream's to dedupe on.
    passes = target is None or target.spec.idempotency is None
    named = headers.get("connection")  # an HTTP client's keep-alive, or names to drop
    key = (tuple(headers), forward, passes, named)
    plan = _SPLITS.get(key)
    if plan is not None:
        agent_names, passed_names, checked_names = plan
        if not checked_names or "".join([headers[n] for n in checked_names]).isascii():
            # Comprehensions, not zip/map over ``headers.__getitem__``: each call of that
            # method-wrapper costs more than the comprehension's frame (callgrind). None
            # for no names (an SDK's request carries no header for the envelope, as a
            # rule): a comprehension's frame costs ~600 instructions even when empty.
            agent = {n: headers[n] for n in agent_names} if agent_names else {}
            return agent, {n: headers[n] for n in passed_names} if passed_names else {}
    routes = _header_routes(forward, passes)
    connection = frozenset(t.strip() for t in named.lower().split(",")) if named else frozenset()
    if len(_SPLITS) < _MAX_SPLITS and (named is None or len(named) <= _MAX_PLANNED_CONNECTION):
        _SPLITS[key] = _split_plan(key[0], routes, connection)
    agent_headers: dict[str, str] = {}
    passthrough: dict[str, str] = {}
    for name, value in headers.items():
        route = routes.get(name)
        if route is None or name in connection:  # goes nowhere
            continue
        to_agent, checked = route
        if checked and not value.isascii() and not is_utf8(value):
            raise _not_utf8(name)
        if to_agent:
            agent_headers[name] = value
        else:
            passthrough[name] = value
    return agent_headers, passthrough


#: (the request's header names in order, the target's ``forward_headers``, whether the
#: SDK's idempotency key passes, its ``Connection`` header's value or None) -> (the
#: names the envelope carries, those passed through, those whose value is checked to be
#: UTF-8): an SDK sends the same names (and httpx, under every Python SDK, ``Connection:
#: keep-alive``) on every request, so they are routed once, not per request. Bounded: at
#: most :data:`_MAX_SPLITS` plans, none for a ``Connection`` value longer than
#: :data:`_MAX_PLANNED_CONNECTION` characters (routed header by header).
_SPLITS: Final[
    dict[
        tuple[tuple[str, ...], frozenset[str], bool, str | None],
        tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]],
    ]
] = {}
_MAX_SPLITS: Final = 256
_MAX_PLANNED_CONNECTION: Final = 256


def _split_plan(
    names: tuple[str, ...], routes: dict[str, tuple[bool, bool]], dropped: frozenset[str]
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Where :func:`split_headers` sends each of ``names`` (an entry of :data:`_SPLITS`),
    those a ``Connection`` header names (``dropped``) going nowhere."""
    to_agent: list[str] = []
    passed: list[str] = []
    checked: list[str] = []
    for name in names:
        route = routes.get(name)
        if route is None or name in dropped:
            continue
        (to_agent if route[0] else passed).append(name)
        if route[1]:
            checked.append(name)
    return tuple(to_agent), tuple(passed), tuple(checked)


@functools.lru_cache(maxsize=64)  # a few per policy (its targets' forward_headers)
def _header_routes(
    forward: frozenset[str], idempotency_passes: bool
) -> dict[str, tuple[bool, bool]]:
    """Where :func:`split_headers` sends each header name (lower-case) that goes
    anywhere: ``(to the envelope's headers, else passed through; its value checked to be
    UTF-8)``. Hop-by-hop and credential headers are in none. A value is checked when it
    is forwarded as it came: a ``traceparent`` is not (forwarded only when valid, hex
    digits; else replaced)."""
    passed = _PASSED | ({IDEMPOTENCY_HEADER} if idempotency_passes else set())
    routes: dict[str, tuple[bool, bool]] = {}
    for name in TRACE_HEADERS | forward | passed:
        if name in HOP_BY_HOP or name in CREDENTIAL_HEADERS:
            continue
        checked = name == "tracestate" or name in forward or name in passed
        routes[name] = (name in TRACE_HEADERS or name in forward, checked)
    return routes


def _not_utf8(name: str) -> InvalidPayload:
    """The refusal of a header to forward whose value holds bytes that are not UTF-8
    (RFC 9110 section 5.5's obs-text; aiohttp reads them as surrogate escapes): the
    sidecar's HTTP client writes values as UTF-8, so it could only send it altered."""
    return InvalidPayload(
        f"header {name!r}: its value holds bytes that are not UTF-8, which the sidecar "
        "cannot forward unchanged",
        details={"reason": "invalid_header", "header": name[:64]},
    )


def is_utf8(value: str) -> bool:
    """False for a value holding a surrogate escape (aiohttp's decoding of a byte that was
    not UTF-8, RFC 9110 section 5.5's obs-text)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a surrogate escape: a byte that was not UTF-8
        return False
    return True

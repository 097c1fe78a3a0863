"""A drop-in request's header names are routed once and then planned
(gateway.call.header_routes ``_SPLITS``): the headers a planned request carries and passes
through are exactly those routed header by header, and a value that is not UTF-8 is
refused alike. A ``Connection`` header's value is part of the plan's key (the names it
lists go nowhere)."""

from __future__ import annotations

import pytest

from gateway.call import header_routes
from gateway.errors import InvalidPayload

NAMES = ["accept", "traceparent", "tracestate", "openai-beta", "idempotency-key", "x-other"]


def _headers(value: str) -> dict[str, str]:
    return {name: f"{name} {value}" for name in NAMES}


@pytest.mark.parametrize("value", ["plain", "caf\u00e9", ""])
def test_a_planned_request_splits_its_headers_as_header_by_header_routing_does(
    value: str,
) -> None:
    header_routes._SPLITS.clear()
    header_routes.split_headers(_headers("one"), None)  # routed, then planned
    assert header_routes._SPLITS
    second = _headers(value)
    planned = header_routes.split_headers(second, None)
    header_routes._SPLITS.clear()
    assert planned == header_routes.split_headers(second, None)


def test_a_value_not_utf8_is_refused_on_a_planned_request() -> None:
    header_routes._SPLITS.clear()
    header_routes.split_headers(_headers("one"), None)
    with pytest.raises(InvalidPayload, match="openai-beta"):
        header_routes.split_headers({**_headers("one"), "openai-beta": "bad \udce9"}, None)


@pytest.mark.parametrize("connection", ["openai-beta", "keep-alive", "Keep-Alive, OpenAI-Beta"])
def test_a_request_with_a_connection_header_is_planned_with_its_value(connection: str) -> None:
    header_routes._SPLITS.clear()
    headers = {**_headers("one"), "connection": connection}
    routed = header_routes.split_headers(headers, None)
    assert ("openai-beta" in routed[1]) is ("openai-beta" not in connection.lower())
    assert header_routes._SPLITS
    assert header_routes.split_headers(headers, None) == routed  # planned: the same
    # Another value of the header, the same names: routed by that value, not the plan.
    other = {
        **headers,
        "connection": "keep-alive" if "beta" in connection.lower() else "openai-beta",
    }
    header_routes._SPLITS.clear()
    want = header_routes.split_headers(other, None)
    header_routes._SPLITS.clear()
    header_routes.split_headers(headers, None)
    assert header_routes.split_headers(other, None) == want


def test_a_long_connection_value_is_routed_but_not_planned() -> None:
    header_routes._SPLITS.clear()
    listed = ", ".join(f"x-name-{i}" for i in range(40))  # 40 names: past the bound
    headers = {**_headers("one"), "connection": f"{listed}, openai-beta"}
    _, passed = header_routes.split_headers(headers, None)
    assert "openai-beta" not in passed  # what it names still goes nowhere
    assert header_routes._SPLITS == {}  # no plan keyed by an arbitrarily long value

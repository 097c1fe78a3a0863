"""A drop-in request's header names are routed once and then planned
(gateway.call.proxy ``_SPLITS``): the headers a planned request carries and passes
through are exactly those routed header by header, and a value that is not UTF-8 is
refused alike."""

from __future__ import annotations

import pytest

from gateway.call import proxy
from gateway.errors import InvalidPayload

NAMES = ["accept", "traceparent", "tracestate", "openai-beta", "idempotency-key", "x-other"]


def _headers(value: str) -> dict[str, str]:
    return {name: f"{name} {value}" for name in NAMES}


@pytest.mark.parametrize("value", ["plain", "caf\u00e9", ""])
def test_a_planned_request_splits_its_headers_as_header_by_header_routing_does(
    value: str,
) -> None:
    proxy._SPLITS.clear()
    proxy._split_headers(_headers("one"), None)  # routed, then planned
    assert proxy._SPLITS
    second = _headers(value)
    planned = proxy._split_headers(second, None)
    proxy._SPLITS.clear()
    assert planned == proxy._split_headers(second, None)


def test_a_value_not_utf8_is_refused_on_a_planned_request() -> None:
    proxy._SPLITS.clear()
    proxy._split_headers(_headers("one"), None)
    with pytest.raises(InvalidPayload, match="openai-beta"):
        proxy._split_headers({**_headers("one"), "openai-beta": "bad \udce9"}, None)


def test_a_request_with_a_connection_header_is_never_planned() -> None:
    proxy._SPLITS.clear()
    headers = {**_headers("one"), "connection": "openai-beta"}
    _, passed = proxy._split_headers(headers, None)
    assert "openai-beta" not in passed
    assert proxy._SPLITS == {}

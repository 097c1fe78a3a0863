"""An upstream's header names are routed once and then planned (gateway.api.answers
``_PLANS``): the headers passed back from a planned answer are exactly those routed
header by header, whatever the values."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.api import answers

SETS = [
    [("Content-Type", "application/json"), ("x-ratelimit-limit-requests", "100")],
    [("Content-Type", "text/plain"), ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2")],
    [("Transfer-Encoding", "chunked"), ("Content-Length", "5"), ("X-Egress-Trace-Id", "t")],
    [("Connection", "x-drop"), ("x-drop", "1"), ("x-keep", "2")],
    [("Content-Encoding", "gzip"), ("Content-Type", "application/json")],
    [("Content-Encoding", "x-gzip"), ("Content-Encoding", "br")],
]
VALUES = ["plain", "caf\u00e9", "bad \udce9 byte", "", "a\x01b", "a\tb", "a\x7f"]


@pytest.mark.parametrize("lines", SETS)
@pytest.mark.parametrize("value", VALUES)
def test_a_planned_answer_passes_back_what_header_by_header_routing_does(
    lines: list[tuple[str, str]], value: str
) -> None:
    answers._PLANS.clear()
    first = CIMultiDictProxy(CIMultiDict(lines))
    routed = answers.passback_headers(first)  # plans the names when it may
    assert routed == answers._routed(first, tuple(first.keys()))
    again = [(name, f"{v} {value}".strip()) for name, v in lines]
    second = CIMultiDictProxy(CIMultiDict(again))
    assert answers.passback_headers(second) == answers._routed(second, tuple(second.keys()))


def test_names_whose_route_depends_on_a_value_are_never_planned() -> None:
    answers._PLANS.clear()
    for lines in SETS[3:4]:  # Connection: the names it lists are left out
        answers.passback_headers(CIMultiDictProxy(CIMultiDict(lines)))
    assert answers._PLANS == {}

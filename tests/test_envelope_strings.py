"""Envelope strings that reach places with stricter rules.

Ids, ``idempotency_key``, ``api_key_ref``, ``protocol_version`` and metadata keys are
copied into headers, answers and log lines. A control character (CR/LF split a header,
ESC drives a terminal, NUL ends a C string) or a lone surrogate (no UTF-8 form) in any of
them is refused at intake with INVALID_PAYLOAD naming the field: never UNKNOWN, never a
plain-text 500, nothing forwarded, exactly one audit record.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import compile_policy, envelope, openai_target

_FIELDS = (
    "trace_id",
    "correlation_id",
    "target_system",
    "rate_limit_group",
    "agent_id",
    "idempotency_key",
    "api_key_ref",
    "protocol_version",
)
_CONTROLS = {
    "crlf": "a\r\nX-Injected: 1",
    "nul": "a\x00b",
    "esc": "a\x1b[31mred",
    "del": "a\x7f",
    "c1": "a\x85b",
}


async def _sidecar(upstream_factory: Any, sidecar_factory: Any) -> tuple[Any, Any]:
    up = await upstream_factory()
    target = openai_target(up.url, idempotency={"methods": ["POST"]})
    policy = compile_policy(
        {"fake-openai": target},
        rate_limit_groups={"g": {"requests_per_second": 100, "burst": 100}},
    )
    return up, await sidecar_factory(policy)


def _assert_refused(status: int, answer: dict[str, Any], field: str) -> None:
    assert status == 400, answer
    assert answer["success"] is False
    assert answer["error"]["code"] == "INVALID_PAYLOAD"
    assert answer["error"]["retryable"] is False
    assert field in answer["error"]["message"]


@pytest.mark.parametrize("kind", sorted(_CONTROLS))
@pytest.mark.parametrize("field", _FIELDS)
async def test_control_characters_are_refused_naming_the_field(
    field: str, kind: str, upstream_factory: Any, sidecar_factory: Any
) -> None:
    up, sc = await _sidecar(upstream_factory, sidecar_factory)
    status, answer = await sc.call(envelope(**{field: _CONTROLS[kind]}))
    _assert_refused(status, answer, field)
    [error] = answer["error"]["details"]["errors"]
    assert error["field"] == field
    assert "control characters" in error["problem"]
    assert up.hits == 0
    [record] = sc.audit_records()
    assert record["error_code"] == "INVALID_PAYLOAD"


@pytest.mark.parametrize("field", _FIELDS)
async def test_lone_surrogates_are_refused_naming_the_field(
    field: str, upstream_factory: Any, sidecar_factory: Any
) -> None:
    up, sc = await _sidecar(upstream_factory, sidecar_factory)
    body = json.dumps(envelope(**{field: "PLACEHOLDER"})).replace("PLACEHOLDER", "x\\udc00")
    status, answer = await sc.call(body.encode())
    _assert_refused(status, answer, field)
    assert answer["error"]["details"] == {"reason": "lone_surrogate", "field": field}
    assert up.hits == 0
    [record] = sc.audit_records()
    assert record["error_code"] == "INVALID_PAYLOAD"
    json.dumps(record, ensure_ascii=False).encode()  # the record itself is valid UTF-8


@pytest.mark.parametrize(
    "metadata",
    [{"a\r\nb": 1}, {"ok": {"deep\x1bkey": 1}}, {"ok": [{"k\x00": 1}]}],
    ids=["top", "nested", "in-list"],
)
async def test_metadata_keys_with_control_characters_are_refused(
    metadata: dict[str, Any], upstream_factory: Any, sidecar_factory: Any
) -> None:
    up, sc = await _sidecar(upstream_factory, sidecar_factory)
    status, answer = await sc.call(envelope(metadata=metadata))
    _assert_refused(status, answer, "metadata")
    [error] = answer["error"]["details"]["errors"]
    assert error["field"] == "metadata"
    assert "control characters" in error["problem"]
    assert up.hits == 0
    assert len(sc.audit_records()) == 1


async def test_metadata_values_and_parameters_keep_their_newlines(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    up, sc = await _sidecar(upstream_factory, sidecar_factory)
    parameters = {"messages": [{"role": "user", "content": "line one\nline two\t\x1b"}]}
    status, answer = await sc.call(
        envelope(metadata={"note": "first\nsecond"}, parameters=parameters)
    )
    assert status == 200, answer
    assert answer["success"] is True
    assert json.loads(up.seen[0].body)["messages"][0]["content"] == "line one\nline two\t\x1b"

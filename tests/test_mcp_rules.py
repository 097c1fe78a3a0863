"""MCP targets, the pure parts: JSON-RPC parsing, the Mcp-Method / Mcp-Name
rules, tool and argument rules, tools/list filtering, batch refusals, the policy keys."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from gateway.policy import PolicyError, parse_policy
from gateway.policy.compiled import PolicySet, mcp_endpoint
from gateway.policy.egress import upstream_url
from gateway.policy.mcp import ArgumentRule, McpSpec
from gateway.providers import mcp as rpc
from tests.conftest import policy_yaml

REPO = "mcp.arguments.create_issue.repo"
NOT_ECHO = "Mcp-Name is not the body's params.name 'echo'"
SPEC = McpSpec.model_validate(
    {
        "tools": {
            "allow": ["search_*", "get_issue", "create_issue", "echo"],
            "deny": ["search_secrets*"],
        },
        "arguments": {
            "create_issue": {
                "repo": {"pattern": "acme/[a-z-]+", "required": True},
                "title": {"max_length": 10},
                "priority": {"enum": ["low", "high", 3]},
            },
            "search_*": {"limit": {"type": "integer", "minimum": 1, "maximum": 50}},
        },
    }
)


def call(tool: Any, arguments: Any = None, ident: Any = 1) -> rpc.Message:
    params: dict[str, Any] = {"name": tool}
    if arguments is not None:
        params["arguments"] = arguments
    return rpc.Message("request", ident, "tools/call", params)


@pytest.mark.parametrize(
    ("tool", "arguments", "reason", "rule"),
    [
        ("get_issue", {}, None, None),
        ("search_code", {"limit": 5}, None, None),
        ("search_secrets_v2", {}, "tool_denied", "mcp.tools.deny"),  # deny wins over allow
        ("delete_repo", {}, "tool_not_allowed", "mcp.tools.allow"),
        ("GET_ISSUE", {}, "tool_not_allowed", "mcp.tools.allow"),  # names are case-sensitive
        (7, {}, "tool_not_allowed", "mcp.tools"),
        ("create_issue", {"repo": "acme/web"}, None, None),
        ("create_issue", {}, "argument_not_allowed", REPO),
        ("create_issue", {"repo": "evil/web"}, "argument_not_allowed", REPO),
        # fullmatch: a prefix that matches is not enough
        ("create_issue", {"repo": "acme/web; rm"}, "argument_not_allowed", REPO),
        ("create_issue", {"repo": ["acme/web"]}, "argument_not_allowed", REPO),
        (
            "create_issue",
            {"repo": "acme/a", "title": "x" * 11},
            "argument_not_allowed",
            "mcp.arguments.create_issue.title",
        ),
        (
            "create_issue",
            {"repo": "acme/a", "priority": "mid"},
            "argument_not_allowed",
            "mcp.arguments.create_issue.priority",
        ),
        ("create_issue", {"repo": "acme/a", "priority": 3.0}, None, None),  # 3 == 3.0 in JSON
        (
            "create_issue",
            {"repo": "acme/a", "priority": True},
            "argument_not_allowed",
            "mcp.arguments.create_issue.priority",
        ),
        ("search_code", {"limit": 51}, "argument_not_allowed", "mcp.arguments.search_*.limit"),
        ("search_code", {"limit": 0}, "argument_not_allowed", "mcp.arguments.search_*.limit"),
        ("search_code", {"limit": True}, "argument_not_allowed", "mcp.arguments.search_*.limit"),
        ("search_code", {"limit": "5"}, "argument_not_allowed", "mcp.arguments.search_*.limit"),
        ("search_code", [1, 2], "argument_not_allowed", "mcp.arguments"),
    ],
)
def test_tool_and_argument_rules(
    tool: Any, arguments: Any, reason: str | None, rule: str | None
) -> None:
    refusal = rpc.call_refusal(SPEC, call(tool, arguments))
    assert (refusal.reason if refusal else None) == reason
    assert (refusal.rule if refusal else None) == rule
    if refusal is not None:
        assert (rule is not None and rule.split(".")[-1] in refusal.message) or "mcp.tools" in rule


def test_refusal_messages_name_the_rule() -> None:
    denied = rpc.call_refusal(SPEC, call("search_secrets"))
    assert denied is not None
    assert denied.message == "tool 'search_secrets' is denied by mcp.tools.deny 'search_secrets*'"
    bad = rpc.call_refusal(SPEC, call("create_issue", {"repo": "evil/x"}))
    assert bad is not None
    assert bad.message == (
        "argument 'repo' of tool 'create_issue' does not match the pattern 'acme/[a-z-]+' "
        "(mcp.arguments.create_issue.repo)"
    )
    assert bad.argument == "repo"


def test_other_methods_are_not_judged() -> None:
    for method in ("tools/list", "initialize", "prompts/get", "resources/read", "x/custom"):
        assert (
            rpc.call_refusal(SPEC, rpc.Message("request", 1, method, {"name": "delete_repo"}))
            is None
        )


@pytest.mark.parametrize(
    ("rule", "value", "problem"),
    [
        ({"type": "string"}, "a", None),
        ({"type": "string"}, 1, "is not of type string"),
        ({"type": "integer"}, 2.0, None),
        ({"type": "integer"}, 2.5, "is not of type integer"),
        ({"type": "number"}, False, "is not of type number"),
        ({"type": "boolean"}, False, None),
        ({"type": "null"}, None, None),
        ({"min_length": 2}, "a", "is shorter than 2 characters"),
        ({"max_length": 2}, "abc", "is longer than 2 characters"),
        ({"max_length": 2}, "é🚀", None),  # characters, not bytes
        ({"pattern": "[0-9]+"}, "12a", "does not match the pattern '[0-9]+'"),
        ({"enum": [None, "a"]}, None, None),
        ({"enum": [1]}, "1", "is not one of [1]"),
        ({"maximum": 1.5}, 1.6, "is above the maximum 1.5"),
        ({"required": True}, ..., "is required"),
        ({"pattern": "x"}, ..., None),  # absent and not required: passes
    ],
)
def test_argument_problem(rule: dict[str, Any], value: Any, problem: str | None) -> None:
    given = rpc._ABSENT if value is ... else value
    assert rpc.argument_problem(ArgumentRule.model_validate(rule), given) == problem


def test_glob_is_star_only() -> None:
    assert rpc.glob_match("a*c", "abbc")
    assert rpc.glob_match("a*c", "ac")
    assert not rpc.glob_match("a?c", "abc")  # '?' is literal
    assert rpc.glob_match("a.c", "a.c")
    assert not rpc.glob_match("a.c", "abc")
    assert rpc.glob_match("*", "")
    assert rpc.glob_match("x*", "x\ny")


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"{", "not_json"),
        (b"[]", "invalid_jsonrpc"),
        (b'{"jsonrpc": "1.0", "id": 1, "method": "x"}', "invalid_jsonrpc"),
        (b'{"jsonrpc": "2.0", "id": true, "method": "x"}', "invalid_jsonrpc"),
        (b'{"jsonrpc": "2.0", "id": 1, "method": 5}', "invalid_jsonrpc"),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "x", "params": 3}', "invalid_jsonrpc"),
        (b'{"jsonrpc": "2.0", "id": 1}', "invalid_jsonrpc"),
        (b'[{"jsonrpc": "2.0", "id": 1, "method": "x"}, 5]', "invalid_jsonrpc"),
        (
            ("[" + ",".join(['{"jsonrpc":"2.0","method":"n"}'] * 101) + "]").encode(),
            "invalid_jsonrpc",
        ),
    ],
)
def test_not_jsonrpc(body: bytes, problem: str) -> None:
    with pytest.raises(rpc.McpProtocolError) as caught:
        rpc.parse_messages(body)
    assert caught.value.reason == problem
    assert caught.value.code == (rpc.PARSE_ERROR if problem == "not_json" else rpc.INVALID_REQUEST)


def test_message_kinds_and_batches() -> None:
    messages, batch = rpc.parse_messages(
        b'[{"jsonrpc":"2.0","id":"a","method":"tools/call","params":{"name":"t"}},'
        b'{"jsonrpc":"2.0","method":"notifications/initialized"},'
        b'{"jsonrpc":"2.0","id":7,"result":{}}]'
    )
    assert batch
    assert [(m.kind, m.id, m.method, m.tool) for m in messages] == [
        ("request", "a", "tools/call", "t"),
        ("notification", None, "notifications/initialized", None),
        ("response", 7, None, None),
    ]
    assert (
        rpc.parse_messages(b'{"jsonrpc":"2.0","id":null,"method":"ping"}')[0][0].kind == "request"
    )


def b64(text: str) -> str:
    return "=?base64?" + base64.b64encode(text.encode()).decode() + "?="


@pytest.mark.parametrize(
    ("headers", "problem"),
    [
        ({}, None),  # a 2025-11-25 client sends neither
        ({"mcp-protocol-version": "2025-11-25"}, None),
        (
            {"mcp-protocol-version": "2026-07-28"},
            "Mcp-Method is missing (MCP-Protocol-Version 2026-07-28 requires it)",
        ),
        ({"mcp-method": "tools/call", "mcp-name": "echo"}, None),
        ({"mcp-method": "tools/call", "mcp-name": b64("echo")}, None),
        (
            {"mcp-method": "tools/list"},
            "Mcp-Method 'tools/list' is not the body's method 'tools/call'",
        ),
        ({"mcp-method": "tools/call", "mcp-name": "delete_repo"}, NOT_ECHO),
        ({"mcp-method": "tools/call"}, "Mcp-Name is missing for tools/call (params.name is given)"),
        ({"mcp-name": "get_issue"}, NOT_ECHO),
        ({"mcp-method": "tools/call", "mcp-name": "=?base64?ZWNobw?="}, NOT_ECHO),
    ],
)
def test_headers_must_match_the_body(headers: dict[str, str], problem: str | None) -> None:
    assert rpc.header_problem([call("echo")], headers) == problem


def test_headers_match_every_message_of_a_batch() -> None:
    batch = [call("echo", ident=1), call("get_issue", ident=2)]
    headers = {"mcp-method": "tools/call", "mcp-name": "echo"}
    assert (
        rpc.header_problem(batch, headers) == "Mcp-Name is not the body's params.name 'get_issue'"
    )
    response_only = [rpc.Message("response", 3, None, None)]
    assert rpc.header_problem(response_only, {"mcp-method": "tools/call"}) is None


def test_decode_header_value() -> None:
    assert rpc.decode_header_value(b64("naïve 🚀")) == "naïve 🚀"
    assert rpc.decode_header_value("=?base64?!!?=") is None
    assert rpc.decode_header_value("plain") == "plain"


def test_tools_list_is_filtered_and_outcomes_kept() -> None:
    messages = [rpc.Message("request", 1, "tools/list", {}), call("echo", ident=2)]
    exchange = rpc.McpExchange(SPEC, messages, batch=True)
    listing = {
        "jsonrpc": "2.0",
        "id": 1,
        "result": {"tools": [{"name": "echo"}, {"name": "delete_repo"}, {"name": "search_secrets"}],
                   "nextCursor": "c2"},
    }  # fmt: skip
    result = {"jsonrpc": "2.0", "id": 2, "result": {"content": [], "isError": True}}
    progress = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}}
    assert exchange.read(progress) == (progress, False)
    value, changed = exchange.read([listing, result])
    assert changed
    assert value[0]["result"] == {"tools": [{"name": "echo"}], "nextCursor": "c2"}
    assert value[1] is result
    assert exchange.outcomes == {1: (None, None), 2: (True, None)}  # isError: tools only
    assert exchange.removed_tools == 2
    error = {"jsonrpc": "2.0", "id": 9, "error": {"code": -32601, "message": "nope"}}
    assert rpc.outcome(error) == (None, -32601)


def test_a_refused_batch_answers_every_request() -> None:
    messages = [
        call("echo", ident=1),
        rpc.Message("notification", None, "notifications/cancelled", {}),
        call("delete_repo", ident=2),
    ]
    refusal = rpc.call_refusal(SPEC, messages[2])
    assert refusal is not None
    data = {"egress_code": "PERMISSION_DENIED"}
    answer = rpc.refusal_answer(messages, True, rpc.EGRESS_ERROR, "refused", data, {2: refusal})
    assert [a["id"] for a in answer] == [1, 2]  # none for the notification (JSON-RPC 2.0 §6)
    assert answer[0]["error"]["data"]["reason"] == "batch_refused"
    assert answer[1]["error"] == {
        "code": rpc.EGRESS_ERROR,
        "message": refusal.message,
        "data": {
            "egress_code": "PERMISSION_DENIED",
            "reason": "tool_not_allowed",
            "rule": "mcp.tools.allow",
        },
    }
    single = rpc.refusal_answer([call("x", ident="q")], False, rpc.EGRESS_ERROR, "m", data)
    assert single == {
        "jsonrpc": "2.0",
        "id": "q",
        "error": {"code": rpc.EGRESS_ERROR, "message": "m", "data": data},
    }
    only_notes = [rpc.Message("notification", None, "x", None)]
    assert rpc.refusal_answer(only_notes, False, rpc.EGRESS_ERROR, "m", data) is None


def mcp_policy(mcp: dict[str, Any], **target: Any) -> str:
    return policy_yaml(
        {"tools": {"base_url": "https://mcp.example.com/v1/mcp", "mcp": mcp, **target}}
    )


def test_an_mcp_target_is_its_base_url() -> None:
    policy = PolicySet.compile(parse_policy(mcp_policy({}), "p.yaml"))
    target = policy.targets["tools"]
    assert mcp_endpoint(target) == "/v1/mcp"
    assert str(upstream_url(target, "/v1/mcp")) == "https://mcp.example.com/v1/mcp"
    assert target.allows("/v1/mcp", "POST")
    assert target.allows("/v1/mcp", "DELETE")
    assert target.allows("/v1/mcp", "PUT") is False
    assert target.allows("/other", "POST") is None
    assert target.spec.mcp is not None
    assert target.spec.mcp.tools.allow == ["*"]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            mcp_policy({"arguments": {"t": {"a": {"pattern": "(x"}}}}),
            "targets.tools.mcp.arguments.t.a.pattern: not a regular expression: missing ), "
            "unterminated subpattern at position 0",
        ),
        (
            mcp_policy({"tools": {"allow": ["a"], "denny": []}}),
            "targets.tools.mcp.tools.denny: unknown key",
        ),
        (
            mcp_policy({"arguments": {"t": {"a": {"max_length": -1}}}}),
            "targets.tools.mcp.arguments.t.a.max_length: Input should be greater than or equal",
        ),
        (
            mcp_policy({"tools_rate_limit_group": "nope"}),
            "targets.tools.mcp.tools_rate_limit_group: no rate-limit group 'nope' (known: none)",
        ),
        (
            mcp_policy({}, endpoints=[{"path": "/x", "methods": ["GET"]}]),
            "targets.tools: an MCP target has no 'endpoints'",
        ),
        (mcp_policy({}, idempotency={}), "targets.tools: 'idempotency' does not apply"),
        (
            policy_yaml({"plain": {"base_url": "https://x.example.com"}}),
            "targets.plain: a target needs 'endpoints' (or 'mcp' for an MCP server)",
        ),
    ],
)
def test_policy_problems_name_the_key(text: str, problem: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, "p.yaml")
    assert any(problem in line for line in str(caught.value).splitlines()), str(caught.value)

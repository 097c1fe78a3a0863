"""An MCP request means one thing to the sidecar and to the server, or it is refused.

Bodies that two JSON parsers read differently (a repeated key, a key in other case, a
long s that Go folds to 's'), tool and method names in other case, odd shapes of a
``tools/call`` and headers that do not match the body run nothing on the server. The
real SDK's server (:mod:`tests.mcp_server`) is the upstream where its behaviour matters;
a recording loopback upstream where a server's answer must be exact.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.providers import mcp as rpc
from tests.conftest import Sidecar, compile_policy
from tests.mcp_server import McpTestServer

Factory = Callable[..., Awaitable[Any]]


HEADERS = {"Content-Type": "application/json", "Accept": rpc.ACCEPT}


def policy_for(url: str) -> Any:
    return compile_policy(
        {
            "tools": {
                "base_url": url,
                "mcp": {
                    "tools": {"allow": ["echo", "create_issue", "delete_*"], "deny": ["delete_*"]},
                    "arguments": {"create_issue": {"repo": {"pattern": "acme/[a-z-]+"}}},
                },
            }
        }
    )


async def post_raw(sidecar: Sidecar, body: bytes, **headers: str) -> tuple[int, Any]:
    async with sidecar.session.post(
        sidecar.url + "/mcp/tools", data=body, headers={**HEADERS, **headers}
    ) as resp:
        return resp.status, json.loads(await resp.read())


# Each body names one thing to the sidecar's parser (the last of a repeated key; keys are
# case-sensitive) and another to parsers that keep the first of a repeated key or match
# keys regardless of case (Go's encoding/json, which MCP servers in Go use, does both the
# latter and Unicode folding: a long s, U+017F, is 's').
DIFFERENTIALS = {
    "a repeated name": b'{"jsonrpc":"2.0","id":1,"method":"tools/call",'
    b'"params":{"name":"delete_repo","name":"echo","arguments":{"text":"x"}}}',
    "a repeated name after a BOM": b'\xef\xbb\xbf{"jsonrpc":"2.0","id":1,"method":"tools/call",'
    b'"params":{"name":"delete_repo","name":"echo","arguments":{"text":"x"}}}',
    "a repeated method": b'{"jsonrpc":"2.0","id":2,"method":"tools/call","method":"ping",'
    b'"params":{"name":"delete_repo","arguments":{"repo":"acme/web"}}}',
    "a method in upper case": b'{"jsonrpc":"2.0","id":3,"method":"ping","METHOD":"tools/call",'
    b'"params":{"name":"delete_repo","arguments":{"repo":"acme/web"}}}',
    "a name in other case": b'{"jsonrpc":"2.0","id":4,"method":"tools/call",'
    b'"params":{"name":"echo","Name":"delete_repo","arguments":{"repo":"acme/web"}}}',
    "params spelt with a long s": b'{"jsonrpc":"2.0","id":5,"method":"tools/call",'
    b'"params":{"name":"echo","arguments":{"text":"x"}},'
    b'"param\xc5\xbf":{"name":"delete_repo","arguments":{"repo":"acme/web"}}}',
    "an argument in other case": b'{"jsonrpc":"2.0","id":6,"method":"tools/call",'
    b'"params":{"name":"create_issue","arguments":{"repo":"acme/web","REPO":"evil/x",'
    b'"title":"t"}}}',
}


@pytest.mark.parametrize("body", DIFFERENTIALS.values(), ids=DIFFERENTIALS.keys())
async def test_a_body_two_parsers_read_differently_is_refused(
    sidecar_factory: Factory, json_server: McpTestServer, body: bytes
) -> None:
    sidecar: Sidecar = await sidecar_factory(policy_for(json_server.url))
    before = len(json_server.requests)
    status, answer = await post_raw(sidecar, body)
    assert status == 400
    assert answer["error"]["code"] == rpc.INVALID_REQUEST
    assert answer["error"]["data"]["egress_code"] == "INVALID_PAYLOAD"
    assert answer["error"]["data"]["reason"] == "ambiguous_key"
    assert len(json_server.requests) == before  # nothing forwarded
    record = sidecar.audit_records()[-1]
    assert (record["api"], record["error_code"]) == ("mcp", "INVALID_PAYLOAD")


async def test_tool_names_in_other_case_reach_no_tool(
    sidecar_factory: Factory, json_server: McpTestServer
) -> None:
    """What held: the rules compare names exactly, and so does the SDK's server: a name
    in other case or with a look-alike letter passes the deny rule but calls nothing."""
    sidecar: Sidecar = await sidecar_factory(
        compile_policy(
            {"tools": {"base_url": json_server.url, "mcp": {"tools": {"deny": ["delete_*"]}}}}
        )
    )
    effects = len(json_server.side_effects)
    for n, name in enumerate(["Delete_repo", "DELETE_REPO", "d\u0435lete_repo"]):  # Cyrillic e
        call = {
            "jsonrpc": "2.0",
            "id": n,
            "method": "tools/call",
            "params": {"name": name, "arguments": {"repo": "acme/web"}},
        }
        status, answer = await post_raw(sidecar, json.dumps(call).encode())
        assert status == 200
        assert answer["result"]["isError"] is True  # "Unknown tool"
    assert len(json_server.side_effects) == effects


SHAPES = {
    "a notification": {"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "delete_repo"}},
    "params as a list": {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": ["echo"]},
    "no name": {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"arguments": {}}},
    "a name not a string": {
        "jsonrpc": "2.0",
        "id": 3,
        "method": "tools/call",
        "params": {"name": ["delete_repo"]},
    },
    "arguments as a list": {
        "jsonrpc": "2.0",
        "id": 4,
        "method": "tools/call",
        "params": {"name": "create_issue", "arguments": ["evil/x", "t"]},
    },
}


@pytest.mark.parametrize("message", SHAPES.values(), ids=SHAPES.keys())
async def test_odd_shapes_of_a_tool_call_are_refused(
    sidecar_factory: Factory, json_server: McpTestServer, message: dict[str, Any]
) -> None:
    """What held: a tools/call that names no tool plainly is refused, never forwarded."""
    sidecar: Sidecar = await sidecar_factory(policy_for(json_server.url))
    before = len(json_server.requests)
    status, answer = await post_raw(sidecar, json.dumps(message).encode())
    assert len(json_server.requests) == before
    if "id" in message:
        assert status == 200
        assert answer["error"]["data"]["egress_code"] == "PERMISSION_DENIED"
    else:  # a notification gets no answer of its own: the error has id null
        assert answer["id"] is None
        assert answer["error"]["data"]["egress_code"] == "PERMISSION_DENIED"
    assert sidecar.audit_records()[-1]["decision"] == "denied"


async def test_a_method_in_other_case_and_mismatched_headers_run_nothing(
    sidecar_factory: Factory, json_server: McpTestServer
) -> None:
    """What held: ``TOOLS/CALL`` is not tools/call to the sidecar nor to the server (method
    names are case-sensitive: JSON-RPC 2.0 section 4); ``Mcp-Name`` naming an allowed tool
    over a body calling a denied one, verbatim or base64, is refused (-32020)."""
    sidecar: Sidecar = await sidecar_factory(policy_for(json_server.url))
    effects = len(json_server.side_effects)
    upper = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "TOOLS/CALL",
        "params": {"name": "delete_repo", "arguments": {"repo": "acme/web"}},
    }
    status, answer = await post_raw(sidecar, json.dumps(upper).encode())
    assert (status, answer["error"]["code"]) == (200, -32601)  # the server: method not found
    denied = {**upper, "method": "tools/call"}
    for name in ("echo", "=?base64?ZWNobw==?=", "=?BASE64?ZGVsZXRlX3JlcG8=?="):
        status, answer = await post_raw(
            sidecar, json.dumps(denied).encode(), **{"Mcp-Method": "tools/call", "Mcp-Name": name}
        )
        assert (status, answer["error"]["code"]) == (400, rpc.HEADER_MISMATCH), name
    assert len(json_server.side_effects) == effects

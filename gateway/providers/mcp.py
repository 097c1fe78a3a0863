"""MCP over streamable HTTP, as the sidecar reads it (pure, no I/O): JSON-RPC 2.0 message
shapes, the MCP methods and headers it checks, and the evaluation of a target's ``mcp:``
rules (:mod:`gateway.policy.mcp`).

Sources: JSON-RPC 2.0 (https://www.jsonrpc.org/specification: request, notification,
response, error object, batch, section 6); MCP 2025-11-25 "Transports" (streamable HTTP:
one POST per JSON-RPC message, answered ``application/json`` or ``text/event-stream``;
``Mcp-Session-Id``, ``MCP-Protocol-Version``; GET opens the server's stream, DELETE ends
a session) and MCP 2026-07-28 (``Mcp-Method`` / ``Mcp-Name`` headers that must equal the
body's method and the ``name`` / ``uri`` of ``tools/call``, ``prompts/get``,
``resources/read``; header values may be ``=?base64?...?=`` wrapped; a mismatch is
``-32020``), as the ``mcp`` Python SDK implements them (``mcp.shared.inbound``).

Batches: JSON-RPC batching was removed from MCP in 2025-06-18, but a batch is still
parsed, never passed unchecked: every request in it is checked, and if any is refused
the whole batch is refused (nothing is forwarded) and answered as JSON-RPC 2.0 answers a
batch, one error object per request (none for notifications; :func:`refusal_answer`).
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from gateway.policy.mcp import ArgumentRule, McpSpec

#: Request headers of the MCP transport that go upstream unchanged (the agent's
#: ``Authorization`` never does: the target's credential is injected instead).
MCP_SESSION_ID: Final = "mcp-session-id"
MCP_PROTOCOL_VERSION: Final = "mcp-protocol-version"
MCP_METHOD: Final = "mcp-method"
MCP_NAME: Final = "mcp-name"
MCP_PARAM_PREFIX: Final = "mcp-param-"  # 2026-07-28: arguments mirrored into headers
PASSED_HEADERS: Final = frozenset(
    {"accept", "last-event-id", MCP_SESSION_ID, MCP_PROTOCOL_VERSION, MCP_METHOD, MCP_NAME}
)
#: What an MCP client accepts on POST (the server answers 406 without both).
ACCEPT: Final = "application/json, text/event-stream"
#: The methods whose target is named in ``Mcp-Name``, and the params key naming it.
NAME_BEARING: Final[Mapping[str, str]] = {
    "tools/call": "name",
    "prompts/get": "name",
    "resources/read": "uri",
}
TOOLS_CALL: Final = "tools/call"
TOOLS_LIST: Final = "tools/list"

# JSON-RPC 2.0 error codes (section 5.1), and MCP 2026-07-28's header mismatch.
PARSE_ERROR: Final = -32700
INVALID_REQUEST: Final = -32600
HEADER_MISMATCH: Final = -32020
#: The sidecar's own refusals and failures. JSON-RPC leaves -32000..-32099 to
#: implementations; the ``mcp`` SDK uses -32000 and -32001 itself (connection closed,
#: request timeout: a client may retry on those) and MCP -32020..-32022 and -32042, so
#: the sidecar takes one code outside both. ``data.egress_code`` is the ErrorCode.
EGRESS_ERROR: Final = -32050

#: Messages in one batch at most: each request gets its audit record, so a body of
#: thousands of tiny requests is refused rather than written out line by line.
MAX_BATCH: Final = 100

Kind = Literal["request", "notification", "response"]


class McpProtocolError(ValueError):
    """The body is not JSON-RPC the sidecar can check: ``code`` is the JSON-RPC error
    code to answer with (PARSE_ERROR, INVALID_REQUEST, HEADER_MISMATCH), ``reason`` the
    ``details.reason`` of the sidecar's error."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class Message:
    """One JSON-RPC message: a request (``id`` and ``method``), a notification
    (``method``, no ``id``) or a response (``id`` and ``result`` or ``error``: the
    client answering a server's request)."""

    kind: Kind
    id: Any
    method: str | None
    params: Any

    @property
    def tool(self) -> str | None:
        """The tool a ``tools/call`` names (None for anything else)."""
        if self.method != TOOLS_CALL or not isinstance(self.params, dict):
            return None
        name = self.params.get("name")
        return name if isinstance(name, str) else None


def parse_messages(body: bytes | Any) -> tuple[list[Message], bool]:
    """The messages of a POST body (bytes, or JSON already decoded) and whether it was a
    batch. Raises :class:`McpProtocolError` for what JSON-RPC 2.0 calls a parse error or
    an invalid request (an empty batch included)."""
    if isinstance(body, bytes | bytearray):
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            raise McpProtocolError(PARSE_ERROR, "not_json", "the body is not JSON") from None
    else:
        value = body
    if isinstance(value, list):
        if not value:
            raise _invalid("an empty batch")
        if len(value) > MAX_BATCH:
            raise _invalid(f"a batch of more than {MAX_BATCH} messages")
        return [_message(item) for item in value], True
    return [_message(value)], False


def _message(value: Any) -> Message:
    if not isinstance(value, dict) or value.get("jsonrpc") != "2.0":
        raise _invalid('a JSON-RPC message is an object with "jsonrpc": "2.0"')
    method = value.get("method")
    has_id = "id" in value
    ident = value.get("id")
    if has_id and (isinstance(ident, bool) or not isinstance(ident, str | int | None)):
        raise _invalid("an id is a string or a number")
    if method is None:
        if has_id and ("result" in value or "error" in value):
            return Message("response", ident, None, None)
        raise _invalid("a message is a request, a notification or a response")
    if not isinstance(method, str):
        raise _invalid("a method is a string")
    params = value.get("params")
    if params is not None and not isinstance(params, dict | list):
        raise _invalid("params are an object or an array")
    return Message("request" if has_id else "notification", ident, method, params)


def _invalid(message: str) -> McpProtocolError:
    return McpProtocolError(INVALID_REQUEST, "invalid_jsonrpc", message)


_B64: Final = re.compile(r"=\?base64\?(?P<payload>.*)\?=")
#: The first revision whose requests carry Mcp-Method / Mcp-Name (revisions are dates).
FIRST_HEADER_VERSION: Final = "2026-07-28"
_DATE: Final = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


def decode_header_value(value: str | None) -> str | None:
    """A header value as MCP 2026-07-28 writes it: verbatim, or ``=?base64?...?=`` (UTF-8,
    canonical base64). A malformed wrapper is None, so it never matches a body value."""
    if value is None:
        return None
    m = _B64.fullmatch(value)
    if m is None:
        return value
    try:
        raw = base64.b64decode(m["payload"], validate=True)
        if base64.b64encode(raw).decode("ascii") != m["payload"]:
            return None
        return raw.decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None


def header_problem(messages: list[Message], headers: Mapping[str, str]) -> str | None:
    """Why ``Mcp-Method`` / ``Mcp-Name`` (lower-case names in ``headers``) do not describe
    the body, or None. Absent headers are no problem for 2025-11-25 clients (they send
    none), but a request of 2026-07-28 or later must carry ``Mcp-Method`` (streamable
    HTTP, "Standard Headers"); present ones must equal every request and notification
    of the body, since an intermediary or server authorising on headers would otherwise
    see another call than the one executed ("Server Validation": 400, -32020)."""
    method_header = headers.get(MCP_METHOD)
    name_header = headers.get(MCP_NAME)
    if method_header is None and name_header is None:
        version = headers.get(MCP_PROTOCOL_VERSION, "").strip()
        modern = _DATE.fullmatch(version) is not None and version >= FIRST_HEADER_VERSION
        if modern and any(m.kind == "request" for m in messages):  # "all requests"
            return f"Mcp-Method is missing (MCP-Protocol-Version {version} requires it)"
        return None
    for message in (m for m in messages if m.method is not None):  # responses name nothing
        if method_header is not None and method_header.strip() != message.method:
            shown = method_header.strip()[:64]
            return f"Mcp-Method {shown!r} is not the body's method {message.method!r}"
        key = NAME_BEARING.get(message.method or "")
        if key is None:
            continue
        body_name = message.params.get(key) if isinstance(message.params, dict) else None
        if name_header is None:
            if method_header is not None:  # a 2026-07-28 client names what it calls
                return f"Mcp-Name is missing for {message.method} (params.{key} is given)"
            continue
        if decode_header_value(name_header.strip()) != body_name:
            return f"Mcp-Name is not the body's params.{key} {str(body_name)[:64]!r}"
    return None


# -- tool and argument rules -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a ``tools/call`` is refused: ``reason`` (``tool_denied``, ``tool_not_allowed``,
    ``argument_not_allowed``), a message naming the rule, and the rule's key path."""

    reason: str
    message: str
    rule: str
    argument: str | None = None


# Pure (a pattern is the same regex under any policy), so a reload cannot make it stale;
# compiled once per pattern, not per call; bounded (LRU) as a policy names few patterns.
@functools.lru_cache(maxsize=1024)
def _glob(pattern: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")), re.DOTALL)


def glob_match(pattern: str, name: str) -> bool:
    """``*`` matches any run of characters (none included); everything else is literal."""
    return _glob(pattern).fullmatch(name) is not None


def tool_refusal(spec: McpSpec, tool: str) -> Refusal | None:
    """None when ``tool`` may be called and listed: it matches ``mcp.tools.allow`` and no
    ``mcp.tools.deny`` (deny wins)."""
    for pattern in spec.tools.deny:
        if glob_match(pattern, tool):
            return Refusal(
                "tool_denied", f"tool {tool[:128]!r} is denied by mcp.tools.deny {pattern!r}",
                "mcp.tools.deny",
            )  # fmt: skip
    if not any(glob_match(pattern, tool) for pattern in spec.tools.allow):
        return Refusal(
            "tool_not_allowed",
            f"tool {tool[:128]!r} is not in mcp.tools.allow ({', '.join(spec.tools.allow)})",
            "mcp.tools.allow",
        )
    return None


def call_refusal(spec: McpSpec, message: Message) -> Refusal | None:
    """The refusal of a ``tools/call`` request by the tool and argument rules, or None
    (also for every other method: only tool calls are judged)."""
    if message.method != TOOLS_CALL:
        return None
    tool = message.tool
    if tool is None:
        return Refusal("tool_not_allowed", "tools/call without a string params.name", "mcp.tools")
    refused = tool_refusal(spec, tool)
    if refused is not None:
        return refused
    arguments = message.params.get("arguments") if isinstance(message.params, dict) else None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return Refusal(
            "argument_not_allowed",
            f"the arguments of tool {tool[:128]!r} are not an object",
            "mcp.arguments",
        )
    for key, rules in spec.arguments.items():
        if not glob_match(key, tool):
            continue
        for param, rule in rules.items():
            problem = argument_problem(rule, arguments.get(param, _ABSENT))
            if problem is not None:
                path = f"mcp.arguments.{key}.{param}"
                return Refusal(
                    "argument_not_allowed",
                    f"argument {param!r} of tool {tool[:128]!r} {problem} ({path})",
                    path,
                    param,
                )
    return None


_ABSENT: Final = object()
_TYPES: Final[Mapping[str, tuple[type, ...]]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def argument_problem(rule: ArgumentRule, value: Any) -> str | None:
    """What is wrong with one argument's ``value`` under ``rule`` (``_ABSENT`` when the
    call does not give it), as the end of a sentence; None when it passes."""
    if value is _ABSENT:
        return "is required" if rule.required else None
    if rule.type is not None:
        is_type = isinstance(value, _TYPES[rule.type]) and (
            rule.type in ("boolean", "object", "array", "null", "string")
            or not isinstance(value, bool)
        )
        if rule.type == "integer" and isinstance(value, float) and value.is_integer():
            is_type = True
        if not is_type:
            return f"is not of type {rule.type}"
    if rule.enum is not None and not any(_same(value, allowed) for allowed in rule.enum):
        return f"is not one of {rule.enum!r}"[:300]
    if rule.pattern is not None or rule.max_length is not None or rule.min_length is not None:
        if not isinstance(value, str):
            return "is not a string"
        if rule.max_length is not None and len(value) > rule.max_length:
            return f"is longer than {rule.max_length} characters"
        if rule.min_length is not None and len(value) < rule.min_length:
            return f"is shorter than {rule.min_length} characters"
        if rule.pattern is not None and re.fullmatch(rule.pattern, value) is None:
            return f"does not match the pattern {rule.pattern!r}"
    if rule.minimum is not None or rule.maximum is not None:
        if not _is_number(value):
            return "is not a number"
        if rule.minimum is not None and value < rule.minimum:
            return f"is below the minimum {rule.minimum:g}"
        if rule.maximum is not None and value > rule.maximum:
            return f"is above the maximum {rule.maximum:g}"
    return None


def _same(value: Any, allowed: Any) -> bool:
    """JSON equality: numbers by value (``1`` is ``1.0``), never ``true`` for ``1``."""
    if _is_number(value) and _is_number(allowed):
        return bool(value == allowed)
    return type(value) is type(allowed) and value == allowed


# -- answers ------------------------------------------------------------------------------


def filter_tools(spec: McpSpec, message: Any) -> tuple[Any, int]:
    """A ``tools/list`` response (``{"jsonrpc", "id", "result": {"tools": [...]}}``) with
    only the tools the rules allow, and how many were removed; anything else unchanged."""
    result = message.get("result") if isinstance(message, dict) else None
    tools = result.get("tools") if isinstance(result, dict) else None
    if not isinstance(tools, list):
        return message, 0
    kept = [
        t for t in tools
        if isinstance(t, dict) and isinstance(t.get("name"), str)
        and tool_refusal(spec, t["name"]) is None
    ]  # fmt: skip
    if len(kept) == len(tools):
        return message, 0
    assert isinstance(result, dict)
    return {**message, "result": {**result, "tools": kept}}, len(tools) - len(kept)


def responses(value: Any) -> Iterable[dict[str, Any]]:
    """The JSON-RPC responses in a decoded answer (one object, or a batch's array)."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, dict) and "id" in item and ("result" in item or "error" in item):
            yield item


def outcome(response: Mapping[str, Any]) -> tuple[bool | None, int | None]:
    """``(isError, error code)`` of one response: a result's ``isError`` (MCP "Tools":
    false when absent) and None, or None and the JSON-RPC error's ``code``."""
    if "error" in response:
        error = response.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        return None, code if isinstance(code, int) and not isinstance(code, bool) else None
    result = response.get("result")
    return (isinstance(result, dict) and result.get("isError") is True), None


def error_object(ident: Any, code: int, message: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON-RPC 2.0 error response (section 5.1)."""
    return {
        "jsonrpc": "2.0",
        "id": ident,
        "error": {"code": code, "message": message, "data": dict(data)},
    }


def refusal_answer(
    messages: list[Message],
    batch: bool,
    code: int,
    message: str,
    data: Mapping[str, Any],
    refused: Mapping[int, Refusal] | None = None,
) -> Any:
    """The JSON-RPC answer of a refused body: for one request its error object; for a
    batch an array with one per request (the requests refused by name carry their own
    message and rule; the others say they were not forwarded); None when no request
    needs an answer (notifications and responses only). ``refused`` maps indexes of
    ``messages`` to their refusal."""
    refused = refused or {}
    out = []
    for index, m in enumerate(messages):
        if m.kind != "request":
            continue
        own = refused.get(index)
        if own is not None:
            detail = {**data, "reason": own.reason, "rule": own.rule}
            if own.argument is not None:
                detail["argument"] = own.argument
            out.append(error_object(m.id, code, own.message, detail))
        elif refused:
            note = "not forwarded: another request of this batch was refused"
            out.append(error_object(m.id, code, note, {**data, "reason": "batch_refused"}))
        else:
            out.append(error_object(m.id, code, message, data))
    if not out:
        return None
    return out if batch else out[0]


@dataclass(slots=True)
class McpExchange:
    """One HTTP exchange with an MCP target, as the sidecar follows it: the messages the
    agent sent, the outcome of each request as its response passes (``outcomes``: id ->
    ``(isError, error code)``), the refusal when the body was refused, and the answer
    body when the sidecar rewrote it (a filtered ``tools/list``)."""

    spec: McpSpec
    messages: list[Message]
    batch: bool = False
    outcomes: dict[Any, tuple[bool | None, int | None]] = field(default_factory=dict)
    #: Indexes of ``messages`` refused by the rules (a refused body is never forwarded).
    refused: dict[int, Refusal] = field(default_factory=dict)
    #: The rewritten answer body (JSON), None when the upstream's went back unchanged.
    body: bytes | None = None
    removed_tools: int = 0

    @property
    def requests(self) -> list[Message]:
        return [m for m in self.messages if m.kind == "request"]

    def read(self, value: Any) -> tuple[Any, bool]:
        """Read one decoded answer (a response, a batch of them, or a server's request or
        notification on a stream): record the outcomes of the agent's requests, filter a
        ``tools/list`` result. Returns the value to relay and whether it changed.

        A response that answers none of the pending requests (a stream resumed with
        ``Last-Event-ID`` on a GET replays another POST's answers: MCP "Resumability") is
        filtered as a ``tools/list`` result whenever it has the shape of one."""
        pending = {m.id: m for m in self.requests if m.id not in self.outcomes}
        changed = False
        items = value if isinstance(value, list) else [value]
        out = []
        for item in items:
            for response in responses([item]):
                request = pending.get(response.get("id"))
                if request is None:
                    item, removed = filter_tools(self.spec, item)
                    self.removed_tools += removed
                    changed = changed or removed > 0
                    continue
                is_error, code = outcome(response)
                # isError belongs to tool results (MCP "Tools"); other results have none.
                self.outcomes[request.id] = (
                    is_error if request.method == TOOLS_CALL else None,
                    code,
                )
                if request.method == TOOLS_LIST:
                    item, removed = filter_tools(self.spec, item)
                    self.removed_tools += removed
                    changed = changed or removed > 0
            out.append(item)
        return (out if isinstance(value, list) else out[0]), changed

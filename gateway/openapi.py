"""The sidecar's HTTP contract as an OpenAPI 3.1 document (``GET /openapi.json``, and
``docs/openapi.json``, which a test keeps equal to this module's output).

Generated, never written by hand: the schemas are the envelope models' own JSON Schemas
(pydantic's ``model_json_schema``, JSON Schema 2020-12 as OpenAPI 3.1 uses), and the
answers' HTTP statuses and error codes come from the exception tree
(:mod:`gateway.errors`), so a code added there appears here, with its status and
whether it is retryable. ``python -m gateway.openapi`` prints the document.

Described: ``POST /v1/calls`` (JSON answer, or ``text/event-stream`` when the agent asks
for it) on the calls listener; ``/healthz``, ``/readyz``, ``/metrics`` and this document
on both listeners. The drop-in provider routes (``/proxy/{target}/{path}``) and the MCP
routes of the design are not built yet, so they are not in the document: it describes
what answers, nothing more.

Two rules of the envelope are checked by its validators, not by JSON Schema: strings
copied into headers and logs hold no control characters, and ``metadata`` is bounded
(size, depth, keys); an envelope breaking them gets INVALID_PAYLOAD like any other.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from typing import Any, Final

from gateway import __version__
from gateway.envelope import ErrorCode, ExternalCallRequest, ExternalCallResponse
from gateway.errors import GatewayError

OPENAPI_VERSION: Final = "3.1.0"
_REF: Final = "#/components/schemas/{model}"
CALLS_SERVER: Final = {
    "url": "http://127.0.0.1:8181",
    "description": "the calls listener (server.host, server.port)",
}
OPS_SERVER: Final = {
    "url": "http://127.0.0.1:8182",
    "description": "the ops listener (server.ops_host, server.ops_port): health, readiness, "
    "metrics, this document, and the operator's routes behind an operator token (the stop "
    "switch, /v1/controls/...: docs/features/stopping.md; approvals and dead letters: "
    "docs/features/approvals.md; not described here)",
}
#: Statuses an error code is answered with besides its class's ``http_status``
#: (docs/api/envelope.md): a too-large envelope is 413; an upstream's own 4xx verdict is
#: passed on, and an unfollowed 3xx or a refusal inside a 200 stream is 502.
_EXTRA_STATUSES: Final[dict[ErrorCode, tuple[str, ...]]] = {
    ErrorCode.INVALID_PAYLOAD: ("413",),
    ErrorCode.UPSTREAM_REJECTED: ("4XX", "502"),
}


def _classes(root: type[GatewayError]) -> list[type[GatewayError]]:
    found = [root]
    for sub in root.__subclasses__():
        found.extend(_classes(sub))
    return found


def error_codes() -> dict[str, dict[str, Any]]:
    """Every error code: the HTTP statuses it is answered with and whether it is
    retryable by default (the answer's own ``retryable`` decides: an upstream's
    ``x-should-retry: false`` turns it off)."""
    table: dict[str, dict[str, Any]] = {}
    for cls in _classes(GatewayError):  # an intermediate class repeats its parent's
        entry = table.setdefault(cls.code.value, {"http_status": set(), "retryable": set()})
        entry["http_status"].add(str(cls.http_status))
        entry["retryable"].add(cls.retryable)
    for code, statuses in _EXTRA_STATUSES.items():
        table[code.value]["http_status"].update(statuses)
    missing = {c.value for c in ErrorCode} - set(table)
    assert not missing, f"error codes without a class in gateway.errors: {sorted(missing)}"
    return {
        code.value: {
            "http_status": sorted(table[code.value]["http_status"]),
            "retryable": any(table[code.value]["retryable"]),
        }
        for code in ErrorCode
    }


def _schemas() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    # What the sidecar accepts, and what it writes.
    request = ExternalCallRequest.model_json_schema(ref_template=_REF, mode="validation")
    response = ExternalCallResponse.model_json_schema(ref_template=_REF, mode="serialization")
    for name, schema in (("ExternalCallRequest", request), ("ExternalCallResponse", response)):
        for sub_name, sub in schema.pop("$defs", {}).items():
            assert schemas.setdefault(sub_name, sub) == sub, sub_name
        schemas[name] = schema
    schemas["Health"] = {
        "type": "object",
        "properties": {"status": {"const": "alive"}},
        "required": ["status"],
    }
    schemas["Readiness"] = {
        "type": "object",
        "description": "checks: policy_loaded, draining, secrets (booleans); redis (with a "
        "redis: section) the last Redis operation's outcome, reported, never gating",
        "properties": {
            "status": {"enum": ["ready", "not_ready"]},
            "checks": {"type": "object", "additionalProperties": True},
        },
        "required": ["status", "checks"],
    }
    return dict(sorted(schemas.items()))


def _failure(codes: list[str]) -> dict[str, Any]:
    """An ExternalCallResponse that failed with one of ``codes``."""
    return {
        "allOf": [
            {"$ref": _REF.format(model="ExternalCallResponse")},
            {
                "properties": {
                    "success": {"const": False},
                    "error": {
                        "type": "object",
                        "properties": {"code": {"enum": codes}},
                        "required": ["code"],
                    },
                },
                "required": ["success", "error"],
            },
        ]
    }


def _call_responses(codes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    by_status: dict[str, list[str]] = {}
    for code, entry in codes.items():
        for status in entry["http_status"]:
            by_status.setdefault(status, []).append(code)
    # An explicit status wins over its range (OpenAPI 3.1, Responses Object): the
    # upstream's 4xx verdict may come with any of them.
    for status, listed in by_status.items():
        if status.startswith("4") and status != "4XX":
            listed.append(ErrorCode.UPSTREAM_REJECTED.value)
    responses: dict[str, Any] = {
        "200": {
            "description": "The upstream answered and the call succeeded. With `Accept: "
            "text/event-stream` and an upstream that streams, the answer is the "
            "upstream's server-sent events relayed unchanged as they arrive (their "
            "`event:`, `data:`, `id:` lines and comments), then one last event `event: "
            "egress.response` whose data is the ExternalCallResponse (`data` null); that "
            "final answer may be a failure (STREAM_INTERRUPTED, an error event's code).",
            "content": {
                "application/json": {
                    "schema": {
                        "allOf": [
                            {"$ref": _REF.format(model="ExternalCallResponse")},
                            {"properties": {"success": {"const": True}}},
                        ]
                    }
                },
                "text/event-stream": {
                    "schema": {"type": "string", "description": "server-sent events"}
                },
            },
        }
    }
    for status in sorted(by_status, key=lambda s: (s.replace("X", "9"), s)):
        listed = sorted(set(by_status[status]))
        responses[status] = {
            "description": "Refused or failed: " + ", ".join(listed),
            "content": {"application/json": {"schema": _failure(listed)}},
        }
    return responses


def _ops_paths() -> dict[str, Any]:
    def json_answer(description: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": schema}}}

    metrics = {"schema": {"type": "string"}}
    return {
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "Liveness: the process is alive",
                "responses": {"200": json_answer("alive", {"$ref": _REF.format(model="Health")})},
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "Readiness: a policy is loaded, secrets are usable, not draining",
                "responses": {
                    status: json_answer(what, {"$ref": _REF.format(model="Readiness")})
                    for status, what in (("200", "ready"), ("503", "not ready"))
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics (OpenMetrics when the scraper asks for it)",
                "responses": {
                    "200": {
                        "description": "the metrics",
                        "content": {"text/plain": metrics, "application/openmetrics-text": metrics},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "responses": {"200": json_answer("OpenAPI 3.1", {"type": "object"})},
            }
        },
    }


def _description(codes: dict[str, dict[str, Any]]) -> str:
    rows = "\n".join(
        f"| `{code}` | {', '.join(e['http_status'])} | {'yes' if e['retryable'] else 'no'} |"
        for code, e in codes.items()
    )
    return (
        "An egress sidecar for AI agents: the agent POSTs an ExternalCallRequest envelope "
        "and always gets an ExternalCallResponse back, whose `error.code` and "
        "`error.retryable` say what to do next. Codes are added, never renamed or "
        "removed. Any other path or method is answered INVALID_PAYLOAD with 404 or 405."
        "\n\n| code | HTTP | retryable |\n|---|---|---|\n" + rows
    )


@cache  # constant for the process (built from the code): built once, when first served
def build_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document (a JSON-able dict; do not mutate it)."""
    codes = error_codes()
    calls = {
        "servers": [CALLS_SERVER],
        "post": {
            "operationId": "call",
            "summary": "Make one outbound call through the sidecar",
            "description": "Send `Accept: text/event-stream` to have a streamed upstream "
            "answer relayed as it arrives (see the 200 answer); otherwise it is assembled.",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": _REF.format(model="ExternalCallRequest")}
                    }
                },
            },
            "responses": _call_responses(codes),
        },
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "egress-gateway",
            "version": __version__,
            "description": _description(codes),
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "servers": [CALLS_SERVER, OPS_SERVER],
        # The drop-in provider routes (/proxy/{target}/{path}) and MCP routes are not
        # built yet: left out rather than describing what does not answer.
        "paths": {"/v1/calls": calls, **_ops_paths()},
        "components": {"schemas": _schemas()},
        "x-error-codes": codes,
    }


@cache  # constant for the process, as build_document
def document_bytes() -> bytes:
    """The document as served and as committed in ``docs/openapi.json``."""
    return (json.dumps(build_document(), indent=2, ensure_ascii=False) + "\n").encode()


if __name__ == "__main__":
    sys.stdout.buffer.write(document_bytes())

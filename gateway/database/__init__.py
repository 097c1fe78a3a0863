"""Database targets: named statements run with server-side binding (README, "Database
targets"; the policy: :mod:`gateway.policy.database`).

The pure parts live here: binding an envelope to a statement (:func:`bind`), the
statement's answer in JSON-safe types within its limits (:func:`shape_rows`), and the
hashes the audit record keeps. The engine (asyncpg) lives in
:mod:`gateway.database.postgres`, the leases in :mod:`gateway.database.credentials`, the
registry the call path reads in :mod:`gateway.database.registry`.

Errors of :func:`bind` (the envelope, before anything runs):

    a body, a query or headers         INVALID_PAYLOAD   reason not_for_database
    an unknown parameter               INVALID_PAYLOAD   reason unknown_parameter
    a missing or mistyped parameter    INVALID_PAYLOAD   reason missing_parameter / parameter_type
    a value outside its rules          PERMISSION_DENIED reason parameter_refused
"""

from __future__ import annotations

import base64
import datetime
import decimal
import hashlib
import ipaddress
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gateway.envelope import ExternalCallRequest
from gateway.errors import InvalidPayload, PermissionDenied, ResponseTooLarge
from gateway.policy.database import ParamSpec, StatementSpec
from gateway.providers.mcp import argument_problem

#: The JSON types each parameter type takes (``true`` is never an integer).
_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


@dataclass(frozen=True, slots=True)
class StatementCall:
    """A statement bound to an envelope's parameters: ``values`` in ``$1..$N`` order."""

    name: str
    spec: StatementSpec
    values: tuple[Any, ...]
    sql_sha256: str
    #: Of the parameters as canonical JSON; None with ``audit.payloads: none``.
    params_sha256: str | None


@dataclass(slots=True)
class DbLog:
    """What running a statement learned, for the audit record and metrics (never a
    value or a credential)."""

    user: str | None = None
    rows: int | None = None
    sqlstate: str | None = None
    pool_wait_s: float | None = None
    retries: list[str] = field(default_factory=list)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def bind(
    request: ExternalCallRequest, statements: dict[str, StatementSpec], *, digest: bool = True
) -> StatementCall:
    """The statement the envelope names (``endpoint`` ``/NAME``, already allowed by the
    egress decision) with its parameters checked and ordered; ``digest`` False leaves
    out the parameters' hash (``audit.payloads: none``). Raises InvalidPayload or
    PermissionDenied (module docstring)."""
    if request.body is not None or request.query or request.headers:
        raise InvalidPayload(
            "a database target takes only 'parameters' (no body, query or headers)",
            details={"reason": "not_for_database"},
        )
    name = request.endpoint.strip("/")
    spec = statements.get(name)
    if spec is None:  # the egress decision refuses it first; kept for a direct caller
        raise PermissionDenied(
            f"no statement {name[:64]!r} on target {request.target_system!r}",
            details={"reason": "unknown_statement"},
        )
    known = {p.name for p in spec.params}
    unknown = sorted(k for k in request.parameters if k not in known)
    if unknown:
        raise InvalidPayload(
            f"statement {name!r} takes no parameter {unknown[0][:64]!r} (it takes: "
            f"{', '.join(p.name for p in spec.params) or 'none'})",
            details={"reason": "unknown_parameter", "statement": name},
        )
    values = tuple(_value(name, p, request.parameters) for p in spec.params)
    canonical = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)
    params_sha256 = sha256_hex(canonical) if digest else None
    return StatementCall(name, spec, values, sha256_hex(spec.sql), params_sha256)


def _value(statement: str, param: ParamSpec, parameters: dict[str, Any]) -> Any:
    details = {"statement": statement, "parameter": param.name}
    if param.name not in parameters:
        if param.required:
            raise InvalidPayload(
                f"statement {statement!r} needs parameter {param.name!r}",
                details={**details, "reason": "missing_parameter"},
            )
        return None
    value = parameters[param.name]
    if value is None and not param.required:
        return None
    is_type = isinstance(value, _TYPES[param.type]) and (
        param.type == "boolean" or not isinstance(value, bool)
    )
    if not is_type:
        raise InvalidPayload(
            f"parameter {param.name!r} of statement {statement!r} must be a {param.type}",
            details={**details, "reason": "parameter_type"},
        )
    problem = argument_problem(param, value)
    if problem is not None:
        raise PermissionDenied(
            f"parameter {param.name!r} of statement {statement!r} {problem}",
            details={**details, "reason": "parameter_refused"},
        )
    return float(value) if param.type == "number" else value


def json_safe(value: Any) -> Any:
    """A database value in JSON's types: decimals as strings (no precision lost),
    dates and times ISO 8601, bytes base64 (RFC 4648 section 4), UUIDs and addresses as
    text, json and jsonb already parsed (the engine decodes them), arrays as lists."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, uuid.UUID | ipaddress.IPv4Address | ipaddress.IPv6Address):
        return str(value)
    return str(value)  # ranges, geometric types, intervals...: their text form


def shape_rows(
    call: StatementCall, columns: Sequence[str], rows: Sequence[Sequence[Any]], fetched_more: bool
) -> tuple[list[list[Any]], bool]:
    """The rows answered (JSON-safe) and whether they were truncated, within the
    statement's ``max_rows`` and ``max_bytes``. ``fetched_more``: the engine had a row
    beyond ``max_rows``. Raises ResponseTooLarge when ``on_limit: error``."""
    spec = call.spec
    out: list[list[Any]] = []
    size = 0
    truncated = fetched_more or len(rows) > spec.max_rows
    for row in rows[: spec.max_rows]:
        safe = [json_safe(v) for v in row]
        size += len(json.dumps(safe, separators=(",", ":"), default=str))
        if size > spec.max_bytes:
            truncated = True
            break
        out.append(safe)
    if truncated and spec.on_limit == "error":
        raise ResponseTooLarge(
            f"statement {call.name!r} answered more than its limits ({spec.max_rows} rows, "
            f"{spec.max_bytes} bytes); the policy says on_limit: error",
            details={"reason": "statement_limit", "statement": call.name, "columns": len(columns)},
        )
    return out, truncated

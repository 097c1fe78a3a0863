"""What an answer carries back on the routes that answer in the upstream's own shape
(drop-in, MCP, A2A: :mod:`gateway.api.proxy`, :mod:`gateway.api.mcp`,
:mod:`gateway.api.a2a`): the upstream's headers passed back (less hop-by-hop ones), the
sidecar's own ``x-egress-*`` headers (error code, retry advice, the call's ids, who
served it, the models), and a stored answer's body for a replay. Pure; the one answer
writer (:mod:`gateway.api.writer`) writes and scrubs them."""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping
from typing import Final

from gateway import fastjson
from gateway.call.header_routes import HOP_BY_HOP, is_utf8
from gateway.call.proxy import CORRELATION_ID_HEADER, OCTETS, TRACE_ID_HEADER
from gateway.call.record import CallContext
from gateway.envelope import ErrorPayload, ExternalCallResponse, ServedBy

#: Upstream headers not passed back besides those: the body is framed anew by the server.
#: ``Content-Encoding``: every body is written decoded (aiohttp or
#: :mod:`gateway.upstream.codings` undid its codings, to scrub it).
_NOT_PASSED_BACK: Final = HOP_BY_HOP | {"content-length", "content-encoding"}
#: The sidecar's own answer headers (:func:`egress_headers`, :func:`id_headers`).
_OWN_PREFIX: Final = "x-egress-"
#: Who answered (docs/features/failover.md): ``target=NAME; model=MODEL``.
SERVED_BY_HEADER: Final = "x-egress-served-by"


def passback_headers(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """The upstream's answer headers that go back to the agent: all of them (repeats
    kept, e.g. ``Set-Cookie``) but hop-by-hop ones, those the upstream's ``Connection``
    names, ``Content-Length``, and ``Content-Encoding`` (the body is written decoded:
    :mod:`gateway.upstream.codings` refuses an answer whose codings it cannot undo). An
    upstream header named like the sidecar's own (``x-egress-*``) goes back renamed
    ``x-upstream-egress-*``: only the sidecar says which call this was, whether it failed
    or was replayed. A value holding bytes that are not UTF-8 (RFC 9110 section 5.5's
    obs-text, e.g. Latin-1; aiohttp decodes them as surrogate escapes) is not passed
    back: the sidecar's HTTP writer writes header values as UTF-8, so it could only pass
    such a value altered, and a changed value is worse than an absent one. A value
    holding a control character other than HTAB (``\\x01``, ``\\x1b``, DEL: not a valid
    field value, RFC 9110 section 5.5) is not passed back either: aiohttp's writer
    refuses it, which would drop the whole answer. ``headers`` is aiohttp's multi-valued
    mapping (``items()`` gives every line)."""
    names = tuple(headers.keys())
    plan = _PLANS.get(names)
    if plan is not None:
        values = tuple(headers.values())
        joined = "".join(values)
        # Printable ASCII (isascii() is a flag, isprintable() one pass in C): no value to
        # test for UTF-8 or a control character, the plan holds. HTAB, valid but not
        # printable, is routed header by header.
        if joined.isascii() and joined.isprintable():
            return [(passed, values[at]) for at, passed in plan]
    return _routed(headers, names)


#: A control character other than HTAB: never in a field value or reason phrase (RFC 9110
#: section 5.5, RFC 9112 section 4), and refused by aiohttp's writer.
_CONTROL: Final = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


#: An upstream's header names, in order (as sent) -> which of them go back and under
#: what name (position, name passed back): an upstream sends the same names on every
#: answer, so they are routed once, not per answer. Only names whose route does not
#: depend on a value are planned (``Connection`` is not), and a plan is used only when
#: every value is printable ASCII (each then passes as it is). Bounded, as
#: :data:`_NAMES` is.
_PLANS: Final[dict[tuple[str, ...], tuple[tuple[int, str], ...]]] = {}
_MAX_PLANS: Final = 256
_MAX_PLANNED_NAMES: Final = 64


def _routed(headers: Mapping[str, str], names: tuple[str, ...]) -> list[tuple[str, str]]:
    """:func:`passback_headers`, header by header; plans ``names`` when it may."""
    out = []
    lowers = []  # each passed header's lower-case name, for a Connection header's names
    connection = None
    for name, value in headers.items():
        lower, passed = _NAMES.get(name) or _name_route(name)
        if passed is None:
            if lower == "connection" and connection is None:  # the first, as get() reads
                connection = value  # the names it lists are left out below, wherever they are
            continue
        # Printable text (ASCII or not) passes; else a control character (HTAB aside) or
        # a byte that was not UTF-8 (a surrogate escape) leaves the header out.
        if not value.isprintable() and (_CONTROL.search(value) is not None or not is_utf8(value)):
            continue
        out.append((passed, value))
        lowers.append(lower)
    if connection is None:  # most answers: no name of the upstream's to leave out
        if len(_PLANS) < _MAX_PLANS and len(names) <= _MAX_PLANNED_NAMES:
            _plan(names)
        return out
    named = {t.strip().lower() for t in connection.split(",")}
    return [pair for pair, lower in zip(out, lowers, strict=True) if lower not in named]


#: An upstream header name (as sent) -> (its lower case, the name it is passed back
#: under or None: never passed back), so that the few names an upstream sends on every
#: answer are not lower-cased and compared again per answer. Bounded (at most ~200 KB): a
#: name past the count or the length is routed without being kept.
_NAMES: Final[dict[str, tuple[str, str | None]]] = {}
_MAX_NAMES: Final = 1024
_MAX_KEPT_NAME: Final = 64


def _name_route(name: str) -> tuple[str, str | None]:
    """``name``'s entry in :data:`_NAMES` (kept while there is room)."""
    lower = name.lower()
    if lower in _NOT_PASSED_BACK:
        route: tuple[str, str | None] = (lower, None)
    elif lower.startswith(_OWN_PREFIX):  # only the sidecar says which call this was
        route = (lower, "x-upstream-" + name[2:])
    else:
        route = (lower, name)
    if len(_NAMES) < _MAX_NAMES and len(name) <= _MAX_KEPT_NAME:
        _NAMES[name] = route
    return route


def _plan(names: tuple[str, ...]) -> None:
    """Keep ``names``' plan in :data:`_PLANS` unless a route among them depends on a value."""
    plan = []
    for at, name in enumerate(names):
        if len(name) > _MAX_KEPT_NAME:
            return
        lower, passed = _NAMES.get(name) or _name_route(name)
        if lower == "connection":
            return
        if passed is not None:
            plan.append((at, passed))
    _PLANS[names] = tuple(plan)


def passback_reason(reason: str) -> str | None:
    """The upstream's reason phrase to write back, or None (the status's standard phrase):
    one holding bytes that are not UTF-8 (obs-text, RFC 9112 section 4) could only be
    written altered, as a header value (:func:`passback_headers`), and one holding a
    control character (HTAB included, here) cannot be written at all."""
    if not reason or reason.isprintable():
        return reason or None
    return None if _CONTROL.search(reason) or "\t" in reason or not is_utf8(reason) else reason


def egress_headers(
    error: ErrorPayload | None, *, upstream: Mapping[str, str] | None = None, status: int = 0
) -> dict[str, str]:
    """The sidecar's headers on a failed drop-in answer: ``x-egress-error-code``,
    ``x-egress-retryable``, ``retry-after`` (whole seconds, RFC 9110 section 10.2.3) and
    ``retry-after-ms`` when the wait is known (the OpenAI and Anthropic SDKs read both),
    and ``x-should-retry``, the header with which the OpenAI and Anthropic APIs tell their
    SDKs whether to retry (``_base_client.py``, ``_should_retry``).

    On the sidecar's own refusal ``x-should-retry`` says ``retryable``. On an upstream
    answer passed on (``upstream``: its headers, lower-case names; ``status``) nothing the
    upstream said is replaced, and ``x-should-retry: false`` is added only where the SDK
    would otherwise resend what the sidecar judged final (a 429 or 5xx not retryable,
    e.g. QUOTA_EXHAUSTED): the SDK keeps its own rules for the rest (408, 409)."""
    if error is None:
        return {}
    out = {
        "x-egress-error-code": error.code.value,
        "x-egress-retryable": "true" if error.retryable else "false",
    }
    given = upstream or {}
    wait = error.suggested_retry_after
    if wait is not None and "retry-after" not in given and "retry-after-ms" not in given:
        out["retry-after"] = str(math.ceil(wait))
        out["retry-after-ms"] = str(round(wait * 1000))
    if upstream is None:
        out["x-should-retry"] = "true" if error.retryable else "false"
    elif "x-should-retry" not in given and not error.retryable and (status == 429 or status >= 500):
        out["x-should-retry"] = "false"
    return out


def id_headers(trace_id: str | None, correlation_id: str | None) -> list[tuple[str, str]]:
    """The call's ids, on every drop-in answer, so that its audit record can be found
    (header lines: pairs, to be added to an answer's list as they are)."""
    if trace_id and correlation_id:  # every call the pipeline ran
        return [(TRACE_ID_HEADER, trace_id), (CORRELATION_ID_HEADER, correlation_id)]
    out = []
    if trace_id:
        out.append((TRACE_ID_HEADER, trace_id))
    if correlation_id:
        out.append((CORRELATION_ID_HEADER, correlation_id))
    return out


#: Headers of a drop-in answer under ``models:`` rules: the model asked for, the one sent.
MODEL_REQUESTED_HEADER: Final = "x-egress-model-requested"
MODEL_SENT_HEADER: Final = "x-egress-model-sent"


def model_headers(ctx: CallContext) -> list[tuple[str, str]]:
    """The model the call asked for and the one sent (after a pin), when a ``models:``
    rule applied (none otherwise); a name that is not visible ASCII (the agent's own
    text) is not put in a header."""
    choice = ctx.model
    if choice is None:
        return []
    pairs = ((MODEL_REQUESTED_HEADER, choice.requested), (MODEL_SENT_HEADER, choice.sent))
    return [(k, v) for k, v in pairs if v.isascii() and v.isprintable() and " " not in v]


def answer_ids(response: ExternalCallResponse, ctx: CallContext) -> list[tuple[str, str]]:
    """The id headers of a drop-in or MCP answer (pairs, as :func:`id_headers`): the
    call's ids, else those the request claimed; and ``x-egress-served-by`` when an
    upstream answered well."""
    ids = id_headers(
        response.trace_id or ctx.claimed.get("trace_id"),
        response.correlation_id or ctx.claimed.get("correlation_id"),
    )
    if response.served_by is not None:
        ids.append((SERVED_BY_HEADER, served_by_value(response.served_by)))
    return ids


def served_by_value(served: ServedBy) -> str:
    """``x-egress-served-by``: ``target=NAME`` and, when the request named one,
    ``; model=MODEL`` (the request's model written in ASCII escapes where it is not
    printable ASCII: a header value cannot carry it)."""
    if served.model is None:
        return f"target={served.target}"
    model = served.model
    if not (model.isascii() and model.isprintable()):
        model = model.encode("unicode_escape").decode("ascii")
    return f"target={served.target}; model={model}"


def replayed_body(
    response: ExternalCallResponse, *, json: bool = False
) -> tuple[str | None, bytes] | None:
    """The body of a stored answer replayed on a drop-in route, rebuilt from its ``data``
    (:mod:`gateway.call.bodies` forms): ``(content type, bytes)``; None when the stored
    answer cannot give one (``data`` null on a 200: a relayed stream stored without its
    events; one stored with them is replayed to the relay instead, by
    :func:`gateway.call.idempotent.replay`). JSON is written compactly (the same value;
    whitespace may differ). ``json``: ``data`` is a JSON body's value, written back as
    JSON whatever its shape (a ``null``, or an object shaped like a form)."""
    data = response.data
    if json:
        return "application/json", fastjson.compact(data)
    if data is None:
        return None if response.status_code == 200 else (None, b"")
    if isinstance(data, dict) and set(data) == {"content_type", "base64", "bytes"}:
        return data["content_type"] or OCTETS, base64.b64decode(data["base64"])
    if isinstance(data, dict) and set(data) == {"content_type", "text"}:
        return data["content_type"] or "text/plain", str(data["text"]).encode()
    return "application/json", fastjson.compact(data)

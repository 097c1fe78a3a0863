"""Upstream bodies -> the ``data`` of the answer (pure, no I/O).

* JSON (``application/json`` or any ``+json`` type, or a body that parses as JSON when
  the type is missing) becomes the parsed value, if it is JSON as RFC 8259 defines it
  (no ``NaN``/``Infinity``, no number beyond a double, no lone surrogate) and nested at
  most :data:`MAX_DATA_DEPTH` levels (what the answer's JSON writer can write back).
  Anything else is answered as text, unchanged, never as a lossy or failing value.
* Server-sent events (``text/event-stream``, what LLM APIs stream) become
  ``{"content_type": "text/event-stream", "events": [...], "content": "..."}`` where
  ``events`` holds each ``data:`` payload (parsed when it is JSON) and ``content`` is the
  assembled text of the chunks, in any dialect :func:`gateway.providers.delta_text` knows
  (OpenAI ``choices[0].delta.content``, Anthropic ``text_delta``). Events may be of any
  size (no line-length limit).
* Text (``text/*``, XML, forms..., or no type) that is valid UTF-8 becomes
  ``{"content_type": ..., "text": ...}``; for error statuses the text is cut to
  :data:`ERROR_TEXT_LIMIT` characters (an HTML 502 page is not data).
* Anything else (audio, images, PDFs, or bytes that are not UTF-8 whatever their type
  says) becomes ``{"content_type": ..., "base64": ..., "bytes": N}``: never decoded
  lossily.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Final

from gateway import fastjson
from gateway.call.intake import has_lone_surrogates
from gateway.call.sse import decode_all
from gateway.providers import delta_text
from gateway.redaction import nesting_depth, scrub_cut

ERROR_TEXT_LIMIT: Final = 512
_TEXT_TYPES: Final = frozenset(
    {
        "application/xml",
        "application/javascript",
        "application/ecmascript",
        "application/x-www-form-urlencoded",
        "application/x-ndjson",
        "application/jsonl",
        "application/graphql",
        "application/yaml",
        "application/x-yaml",
    }
)
#: Levels of nesting an upstream JSON value may have to be answered as parsed data: the
#: answer's writer (pydantic-core) refuses values deeper than 255 levels, and the answer
#: and the idempotency store wrap ``data`` in a few more.
MAX_DATA_DEPTH: Final = 200
#: In the SSE form each event sits two levels down (``{"events": [event]}``).
_EVENT_DEPTH: Final = MAX_DATA_DEPTH - 2


class _NotJson(ValueError):
    """A JSON text Python would read but RFC 8259 does not allow (NaN, 1e999...)."""


def _refuse_constant(name: str) -> Any:
    raise _NotJson(name)


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _NotJson(text[:32])
    return value


#: One decoder for every answer: ``json.loads`` with these hooks would build a new
#: ``JSONDecoder`` (and its scanner) on every call.
_DECODER: Final = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite)


def _decode(text: str | bytes) -> Any:
    """``json.loads(text, parse_constant=..., parse_float=...)``, step for step (the
    encoding of bytes detected as RFC 8259 and ``json.loads`` do; a BOM refused in a
    str), with the module's one decoder."""
    if isinstance(text, str):
        if text.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    else:
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    return _DECODER.decode(text)


def _loads(text: str | bytes, max_depth: int) -> Any:
    """``text`` as a JSON value that can be written back exactly, or raises ValueError."""
    # orjson where it gives json's value (~30,000 instructions less for a chat answer);
    # what it refuses (NaN, infinities, a BOM, lone surrogates) json decides, as before.
    value = fastjson.orjson_value(text) if isinstance(text, bytes) else fastjson.UNDECIDED
    if value is fastjson.UNDECIDED:
        value = _decode(text)
    raw = text.encode() if isinstance(text, str) else text
    # Cheap bound first: fewer opening brackets than the limit cannot nest deeper.
    if raw.count(b"[") + raw.count(b"{") > max_depth and (
        nesting_depth(value, max_depth + 1) > max_depth
    ):
        raise _NotJson("nested too deeply")
    if has_lone_surrogates(raw, value):
        raise _NotJson("lone surrogate")
    return value


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def is_json_type(mtype: str) -> bool:
    return mtype == "application/json" or mtype.endswith("+json")


def parse_body(content_type: str | None, body: bytes, status: int) -> tuple[Any, bool]:
    """Decode ``body``. Returns ``(data, is_json)``; never raises on bad input."""
    if not body:
        return None, False
    mtype = media_type(content_type)
    if mtype == "text/event-stream":
        if _as_text(mtype, body) is None:
            return binary_form(mtype, body, status), False  # not UTF-8: kept whole
        return parse_sse(body), False
    if is_json_type(mtype) or not mtype:
        try:
            return _loads(body, MAX_DATA_DEPTH), True
        except (ValueError, UnicodeDecodeError, RecursionError):
            pass
    text = _as_text(mtype, body)
    if text is None:
        return binary_form(mtype, body, status), False
    if status >= 400 and len(text) > ERROR_TEXT_LIMIT:
        text = scrub_cut(text, ERROR_TEXT_LIMIT)
    return {"content_type": mtype or None, "text": text}, False


def _as_text(mtype: str, body: bytes) -> str | None:
    """``body`` as text when its type is textual (or unknown) and it is valid UTF-8."""
    if mtype and not is_text_type(mtype):
        return None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return None


def is_text_type(mtype: str) -> bool:
    """Media types whose bodies are text: ``text/*``, JSON and XML (any ``+json`` or
    ``+xml``), JavaScript, form data (RFC 6838 section 4.2.1; RFC 7303; RFC 8259)."""
    return (
        mtype.startswith("text/")
        or is_json_type(mtype)
        or mtype.endswith("+xml")
        or mtype in _TEXT_TYPES
    )


def binary_form(mtype: str, body: bytes, status: int) -> dict[str, Any]:
    """A body that is not text as data: its bytes in standard base64 (RFC 4648 section 4)
    and their count; for an error status at most :data:`ERROR_TEXT_LIMIT` bytes of it."""
    kept = body if status < 400 else body[:ERROR_TEXT_LIMIT]
    return {
        "content_type": mtype or None,
        "base64": base64.b64encode(kept).decode("ascii"),
        "bytes": len(body),
    }


def looks_like_a_form(data: Any) -> bool:
    """Whether ``data`` could be read back as one of the forms :func:`parse_body` gives a
    body that is not JSON (``{content_type, text}``, :func:`binary_form`'s) or as no body
    (None): a JSON body of that value needs saying so, where it is stored, to be written
    back as the JSON it was (:func:`gateway.api.answers.replayed_body`)."""
    if data is None:
        return True
    return isinstance(data, dict) and (
        data.keys() == {"content_type", "text"} or data.keys() == _BINARY_KEYS
    )


_BINARY_KEYS: Final = frozenset({"content_type", "base64", "bytes"})


def is_stream_form(data: Any) -> bool:
    """True for the data :func:`parse_sse` makes of an event stream."""
    return isinstance(data, dict) and data.get("content_type") == "text/event-stream"


def parse_sse(body: bytes) -> dict[str, Any]:
    """Parse a complete ``text/event-stream`` body (WHATWG HTML, "Server-sent events",
    by :mod:`gateway.call.sse`, the grammar the relay reads too)."""
    events: list[Any] = []
    pieces: list[str] = []
    for sse in decode_all(body, len(body) + 1):
        if sse.data == "[DONE]":
            continue
        event = event_data(sse.data)
        events.append(event)
        piece = delta_text(event)
        if piece:
            pieces.append(piece)
    return {"content_type": "text/event-stream", "events": events, "content": "".join(pieces)}


def event_data(data: str) -> Any:
    """One event's ``data`` as JSON when it is JSON that can be written back, else as is."""
    try:
        return _loads(data, _EVENT_DEPTH)
    except (ValueError, RecursionError):
        return data

"""Upstream bodies -> the ``data`` of the answer (pure, no I/O).

* JSON (``application/json`` or any ``+json`` type, or a body that parses as JSON when
  the type is missing) becomes the parsed value.
* Server-sent events (``text/event-stream``, what LLM APIs stream) become
  ``{"content_type": "text/event-stream", "events": [...], "content": "..."}`` where
  ``events`` holds each ``data:`` payload (parsed when it is JSON) and ``content`` is the
  assembled text of the chunks, in any dialect :func:`gateway.providers.delta_text` knows
  (OpenAI ``choices[0].delta.content``, Anthropic ``text_delta``). Events may be of any
  size (no line-length limit).
* Anything else becomes ``{"content_type": ..., "text": ...}``; for error statuses the
  text is cut to :data:`ERROR_TEXT_LIMIT` characters (an HTML 502 page is not data).
"""

from __future__ import annotations

import json
from typing import Any, Final

from gateway.call.intake import has_lone_surrogates
from gateway.providers import delta_text
from gateway.redaction import scrub_cut

ERROR_TEXT_LIMIT: Final = 512


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
        return parse_sse(body), False
    if is_json_type(mtype) or not mtype:
        try:
            value = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            pass
        else:
            if not has_lone_surrogates(body, value):
                return value, True
    text = body.decode("utf-8", errors="replace")
    if status >= 400 and len(text) > ERROR_TEXT_LIMIT:
        text = scrub_cut(text, ERROR_TEXT_LIMIT)
    return {"content_type": mtype or None, "text": text}, False


def parse_sse(body: bytes) -> dict[str, Any]:
    """Parse a complete ``text/event-stream`` body (WHATWG HTML, "Server-sent events")."""
    events: list[Any] = []
    pieces: list[str] = []
    text = body.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    for block in text.split("\n\n"):
        data_lines = [
            line[5:].removeprefix(" ") for line in block.split("\n") if line.startswith("data:")
        ]
        if not data_lines:
            continue
        payload = "\n".join(data_lines)
        if payload == "[DONE]":
            continue
        try:
            event: Any = json.loads(payload)
        except ValueError:
            event = payload
        events.append(event)
        piece = delta_text(event)
        if piece:
            pieces.append(piece)
    return {"content_type": "text/event-stream", "events": events, "content": "".join(pieces)}

"""Text printed on an operator's terminal (pure, no I/O).

What the operator's commands print holds what agents wrote: endpoints, MCP tool names,
arguments, ids as recorded. A control character among them would drive the terminal
(ESC and U+009B start escape sequences: clear the screen, rewrite lines, set the
clipboard; a newline starts a line of the agent's making), so it is printed as a JSON
escape (``\\u009b``), which is also valid inside a JSON string.
"""

from __future__ import annotations

import re
from typing import Final

#: C0 controls, DEL and C1 controls (as :data:`gateway.envelope.CONTROL_CHARACTERS`).
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def inert(text: str, keep: str = "") -> str:
    """``text`` with each control character but those in ``keep`` written ``\\uXXXX``."""
    if _CONTROL.search(text) is None:
        return text
    return _CONTROL.sub(lambda m: m[0] if m[0] in keep else f"\\u{ord(m[0]):04x}", text)

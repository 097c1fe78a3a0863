"""Import a library without the optional packages it would load only because they are installed.

Some libraries import an optional package at import time when it happens to be installed,
for a feature the sidecar does not use: pybreaker imports redis-py (for its
``CircuitRedisStorage``; the sidecar keeps breaker state in memory), structlog imports
rich (for the tracebacks of its ``ConsoleRenderer``; the sidecar renders JSON). Each costs
megabytes of resident memory in every sidecar (docs/performance.md, "Memory").
:func:`without` hides such packages while the library is imported: the library then
takes its own "not installed" branch, for good. The package itself stays importable
afterwards, for the code that does use it (the cluster stores import redis-py when the
policy has a ``redis:`` section).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

__all__ = ["without"]


@contextlib.contextmanager
def without(*names: str) -> Iterator[None]:
    """Within the block, ``import name`` raises ImportError for each of ``names`` that is
    not imported yet (a None entry in ``sys.modules``: the import system's documented
    way to block an import). Afterwards they import normally. A name already imported
    is left alone: the library then sees the package, as it would have anyway.
    """
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]

"""The event loop the sidecar runs on (the only module that imports uvloop).

uvloop (libuv under asyncio's API) is used when it is installed, i.e. with the ``fast``
extra (``pip install 'egress-gateway[fast]'``); the sidecar behaves the same on either
loop, uvloop only spends less CPU per call (docs/performance.md). The process setting
``GATEWAY_LOOP`` chooses: ``auto`` (default: uvloop if installed), ``asyncio`` (always
the standard loop) or ``uvloop`` (required: an error if it is missing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

T = TypeVar("T")

LOOP_CHOICES: Final = ("auto", "asyncio", "uvloop")


def loop_factory(choice: str | None = None) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory for :class:`asyncio.Runner` (None: asyncio's default loop).

    Raises ValueError for a ``choice`` outside :data:`LOOP_CHOICES`, or for ``uvloop``
    when uvloop is not installed.
    """
    choice = (choice or "auto").strip().lower()
    if choice not in LOOP_CHOICES:
        raise ValueError(f"GATEWAY_LOOP must be one of {', '.join(LOOP_CHOICES)}, not {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ValueError(
                "GATEWAY_LOOP=uvloop but uvloop is not installed (install the 'fast' extra)"
            ) from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], choice: str | None = None) -> T:
    """Run ``main`` to completion on a new loop of the chosen kind (like ``asyncio.run``)."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``"uvloop"`` or ``"asyncio"``: what the ``listening`` log line reports."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"

"""Which listener a connection came on (gateway.agents.identity._listener_of): by the
transport's class where that fixes it (uvloop's TCP and Unix transports), by its socket's
family otherwise (asyncio's); both ways give the same answer on real connections."""

from __future__ import annotations

import asyncio
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.agents.identity import _listener_of


def _by_family(transport: Any) -> str:
    sock = transport.get_extra_info("socket")
    return "unix" if sock.family == socket.AF_UNIX else "tcp"


async def _listeners_seen() -> list[tuple[str, str, str]]:
    """(listener, by class, by socket family) of one TCP and one Unix connection, read on
    the server's side."""
    servers_side: list[asyncio.StreamWriter] = []
    arrived = asyncio.Event()

    async def on_connect(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        servers_side.append(writer)
        arrived.set()

    tcp = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    path = str(Path(tempfile.mkdtemp()) / "s.sock")
    unix = await asyncio.start_unix_server(on_connect, path)
    seen: list[tuple[str, str, str]] = []
    clients: list[asyncio.StreamWriter] = []
    for kind, opened in (
        ("tcp", asyncio.open_connection("127.0.0.1", tcp.sockets[0].getsockname()[1])),
        ("unix", asyncio.open_unix_connection(path)),
    ):
        arrived.clear()
        _, client = await opened
        clients.append(client)
        await asyncio.wait_for(arrived.wait(), 10)
        transport = servers_side[-1].transport
        seen.append((kind, _listener_of(transport), _by_family(transport)))
    for writer in clients + servers_side:
        writer.close()
        await writer.wait_closed()
    for server in (tcp, unix):
        server.close()
        await server.wait_closed()
    return seen


def _loops() -> list[Callable[[], asyncio.AbstractEventLoop]]:
    loops: list[Callable[[], asyncio.AbstractEventLoop]] = [asyncio.new_event_loop]
    try:
        import uvloop
    except ImportError:  # pragma: no cover - the fast extra
        return loops
    return [*loops, uvloop.new_event_loop]


@pytest.mark.parametrize("new_loop", _loops(), ids=lambda f: f.__module__)
def test_the_listener_by_class_is_the_listener_by_socket(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    loop = new_loop()
    try:
        seen = loop.run_until_complete(_listeners_seen())
    finally:
        loop.close()
    assert [kind for kind, _, _ in seen] == ["tcp", "unix"]
    for kind, by_class, by_family in seen:
        assert by_class == kind
        assert by_family == kind
    assert _listener_of(None) == "tcp"

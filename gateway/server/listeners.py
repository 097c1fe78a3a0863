"""The sites ``serve`` listens on: the calls API on TCP and, optionally, on a Unix socket
(docs/features/identity.md), and the ops API on TCP.

On the Unix socket a caller is known by its UID (``SO_PEERCRED``,
:mod:`gateway.agents.identity`), not by the file's permissions: the socket is made
connectable by every UID (mode 0666), so that agents running as their own UIDs reach
it through a shared directory. A stale socket file at the path is replaced (asyncio's
``create_unix_server``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Final

from aiohttp import web

#: Connections the kernel queues before the sidecar accepts them (capped by the host's
#: ``net.core.somaxconn``). aiohttp's 128 drops the SYNs of a burst past it (an agent
#: fleet opening hundreds of streams at once), and a dropped SYN is retried after 1 s,
#: then 3 s: the added time to first byte would be the kernel's, not the sidecar's.
LISTEN_BACKLOG: Final = 4096


def calls_sites(
    runner: web.AppRunner, host: str, port: int, unix_socket: str | None
) -> list[web.BaseSite]:
    """The calls API's sites: TCP ``host:port``, and the Unix socket at ``unix_socket``."""
    sites: list[web.BaseSite] = [
        web.TCPSite(runner, host, port, reuse_address=True, backlog=LISTEN_BACKLOG)
    ]
    if unix_socket is not None:
        sites.append(web.UnixSite(runner, unix_socket, backlog=LISTEN_BACKLOG))
    return sites


async def start_sites(sites: Sequence[web.BaseSite], unix_socket: str | None) -> list[str]:
    """Start ``sites`` in order (``unix_socket``: the path of the Unix site among them);
    return each TCP site's bound ``host:port`` (port 0 made real), in order. Raises
    OSError when an address or path cannot be bound."""
    for site in sites:
        await site.start()
    if unix_socket is not None:
        os.chmod(unix_socket, 0o666)  # noqa: S103 - who calls is its UID, not the mode
    return [_bound(site) for site in sites if isinstance(site, web.TCPSite)]


def _bound(site: web.TCPSite) -> str:
    server = site._server  # aiohttp exposes no public accessor for the bound socket
    sockets = getattr(server, "sockets", None) or []
    if sockets:
        host, port = sockets[0].getsockname()[:2]
        return f"{host}:{port}"
    return site.name

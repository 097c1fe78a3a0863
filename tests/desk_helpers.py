"""The operator's ops routes for tests: an :class:`Ops` client with a token, and the
``ops_factory`` fixture serving a sidecar's ops app on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.server import create_ops_app
from tests.conftest import Sidecar

TOKEN = "op-token-ALICE-0001"


class Ops:
    def __init__(self, server: TestServer, session: aiohttp.ClientSession) -> None:
        self.server, self.session = server, session

    async def __call__(self, method: str, path: str, token: str | None = TOKEN) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        url = f"http://127.0.0.1:{self.server.port}{path}"
        async with self.session.request(method, url, headers=headers) as resp:
            return resp.status, await resp.json()


@pytest.fixture
async def ops_factory() -> AsyncIterator[Callable[[Sidecar], Awaitable[Ops]]]:
    made: list[Ops] = []

    async def make(sc: Sidecar) -> Ops:
        server = TestServer(create_ops_app(sc.gateway), host="127.0.0.1")
        await server.start_server()
        ops = Ops(server, aiohttp.ClientSession())
        made.append(ops)
        return ops

    yield make
    for ops in made:
        await ops.session.close()
        await ops.server.close()

"""Fixtures of the client's tests (the fake sidecar itself is in fake_sidecar.py)."""

from __future__ import annotations

from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fake_sidecar import FakeSidecar


@pytest.fixture
def fake_sidecar() -> Iterator[FakeSidecar]:
    fake = FakeSidecar()
    yield fake
    fake.close()


@pytest.fixture
def closed_port() -> int:
    """A loopback port where nothing listens (bound then released)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = server.server_address[1]
    server.server_close()
    return port

"""A scripted stand-in for the sidecar: a real HTTP server on 127.0.0.1 (port 0), in a
thread, that records each request and plays the answers a test queues. (A module of its
own name, not conftest: the sidecar's tests/conftest.py is also a top-level "conftest".)

The client's own tests need nothing of the sidecar (the sidecar's suite checks the client
against the real one, tests/test_client_contract.py).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: How long a scripted answer waits for the test to release its rest (seconds).
GATE_TIMEOUT_S = 10.0


@dataclass
class Answer:
    """One scripted answer. ``parts`` are written in order: bytes are sent (as one
    chunk of a chunked body each, flushed), a ``threading.Event`` is waited for. With
    ``cut`` the connection is closed before the body's end; with ``drop`` it is closed
    without any answer."""

    status: int = 200
    content_type: str = "application/json"
    parts: list[bytes | threading.Event] = field(default_factory=list)
    cut: bool = False
    drop: bool = False


def envelope_answer(status: int = 200, **fields: Any) -> Answer:
    """An ExternalCallResponse answer (success unless ``error`` is given)."""
    doc: dict[str, Any] = {"success": "error" not in fields, "latency_ms": 1.5, **fields}
    return Answer(status=status, parts=[json.dumps(doc).encode()])


def error_answer(
    status: int, code: str, *, retryable: bool, retry_after: float | None = None, **details: Any
) -> Answer:
    error = {
        "code": code,
        "message": f"{code} for the test",
        "details": details,
        "retryable": retryable,
        "suggested_retry_after": retry_after,
    }
    return envelope_answer(status, error=error)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class FakeSidecar:
    def __init__(self) -> None:
        self.answers: list[Answer] = []
        self.seen: list[Seen] = []
        self.received = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                fake.seen.append(Seen("POST", self.path, dict(self.headers.items()), body))
                fake.received.set()
                answer = fake.answers.pop(0) if fake.answers else envelope_answer()
                if answer.drop:
                    self.close_connection = True
                    return
                self.send_response(answer.status)
                self.send_header("Content-Type", answer.content_type)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for part in answer.parts:
                    if isinstance(part, threading.Event):
                        part.wait(GATE_TIMEOUT_S)
                        continue
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.flush()
                if answer.cut:
                    self.close_connection = True
                    return
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

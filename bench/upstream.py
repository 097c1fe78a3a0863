"""A fast stand-in for an LLM API, for the benchmark only (not part of the test suite).

    python bench/upstream.py [--host 127.0.0.1] [--port 0]

Answers every HTTP/1.1 request with the same OpenAI-style chat completion (JSON with a
``usage`` block), keep-alive, no parsing beyond what framing needs (request line,
``Content-Length``). Written on a bare asyncio protocol (uvloop when installed) so that it
is never the bottleneck: the sidecar and the pass-through it is compared with must be.
Prints ``{"listening": "host:port"}`` on stdout once bound; stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

ANSWER = json.dumps(
    {
        "id": "chatcmpl-bench0001",
        "object": "chat.completion",
        "created": 1735689600,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "The capital of France is Paris.",
                    "refusal": None,
                },
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 24,
            "completion_tokens": 8,
            "total_tokens": 32,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
        },
        "system_fingerprint": "fp_bench",
    },
    separators=(",", ":"),
).encode()

RESPONSE = (
    b"HTTP/1.1 200 OK\r\n"
    b"Content-Type: application/json\r\n"
    b"Content-Length: " + str(len(ANSWER)).encode() + b"\r\n"
    b"x-ratelimit-limit-requests: 1000000\r\n"
    b"x-ratelimit-remaining-requests: 999999\r\n"
    b"x-ratelimit-reset-requests: 1ms\r\n"
    b"\r\n" + ANSWER
)


class _Http(asyncio.Protocol):
    """HTTP/1.1 framing only: header block, then ``Content-Length`` bytes of body."""

    __slots__ = ("_buf", "_need", "_transport")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._need = -1  # body bytes still to skip; -1: reading headers
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        out = []
        while True:
            if self._need < 0:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    break
                head = bytes(buf[:end]).lower()
                del buf[: end + 4]
                length = 0
                at = head.find(b"content-length:")
                if at >= 0:
                    stop = head.find(b"\r\n", at)
                    length = int(head[at + 15 : stop if stop >= 0 else None])
                self._need = length
            if len(buf) < self._need:
                break
            del buf[: self._need]
            self._need = -1
            out.append(RESPONSE)
        if out and self._transport is not None:
            self._transport.write(b"".join(out))


async def _main(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Http, host, port, backlog=1024)
    bound = server.sockets[0].getsockname()
    print(json.dumps({"listening": f"{bound[0]}:{bound[1]}"}), flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(_main(args.host, args.port))
    else:
        uvloop.run(_main(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())

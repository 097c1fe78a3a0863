"""Agents for the A2A tests: each an a2a-sdk server (JSON-RPC, protocol 1.0 with 0.3
compatibility) run by uvicorn on loopback (port 0) in the test's event loop. An agent
answers a message with its own name, after asking the next agent (if it has one)
through its own sidecar with the SDK's client; it passes on the chain it received
(``x-egress-call-chain`` headers) unless told to drop it, and always ``traceparent``."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from a2a.client import ClientConfig, create_client
from a2a.helpers import new_task_from_user_message, new_text_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Message,
    Part,
    Role,
    SendMessageRequest,
)
from starlette.applications import Starlette

PASSED = ("x-egress-call-chain", "x-egress-deadline", "x-egress-call-chain-sig", "traceparent")


def card(name: str, url: str) -> AgentCard:
    return AgentCard(
        name=name,
        description=f"test agent {name}",
        version="1.0",
        supported_interfaces=[
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0")
        ],
        capabilities=AgentCapabilities(streaming=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        # One skill: the A2A spec requires the list non-empty (the SDK warns otherwise).
        skills=[AgentSkill(id="relay", name="relay", description="relays the text", tags=["test"])],
    )


@dataclass
class Agent:
    """One agent: ``name``; ``next_url`` (its sidecar's ``/a2a/{next}``) or None;
    ``drop_chain``: call on without the chain headers; ``steps``: status updates streamed
    before the answer; ``before_reply``: awaited with the incoming headers (an LLM call)."""

    name: str
    next_url: str | None = None
    drop_chain: bool = False
    steps: int = 0
    before_reply: Callable[[dict[str, str]], Awaitable[None]] | None = None
    received: list[dict[str, Any]] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    url: str = ""
    signer: Callable[[AgentCard], AgentCard] | None = None
    _server: uvicorn.Server | None = None
    _task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        agent_card = card(self.name, self.url)
        if self.signer is not None:
            agent_card = self.signer(agent_card)
        handler = DefaultRequestHandler(
            agent_executor=_Executor(self), task_store=InMemoryTaskStore(), agent_card=agent_card
        )
        routes = create_agent_card_routes(agent_card) + create_jsonrpc_routes(handler, "/")
        config = uvicorn.Config(Starlette(routes=routes), log_level="warning", lifespan="off")
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        for _ in range(500):  # bounded: the server says when it is up
            if self._server.started:
                return
            await asyncio.sleep(0.01)
        raise RuntimeError("agent server did not start")

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task


async def ask(url: str, text: str, headers: dict[str, str] | None = None,
              streaming: bool = False) -> list[Any]:  # fmt: skip
    """Send ``text`` with the SDK's client pointed at ``url``; the events it yields."""
    async with httpx.AsyncClient(headers=headers or {}, timeout=30) as http:
        client = await create_client(
            url, client_config=ClientConfig(streaming=streaming, httpx_client=http)
        )
        message = Message(role=Role.ROLE_USER, message_id=f"m-{text}", parts=[Part(text=text)])
        return [event async for event in client.send_message(SendMessageRequest(message=message))]


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the test process's SIGTERM handler stays the
    test runner's. (sse-starlette, under the SDK's streams and the MCP test server's,
    looks the running uvicorn server up through the SIGTERM handler and ends every stream
    once that server is exiting, in any thread; two agents stopped in the order they
    started leave the first one's handler installed, and its stopped server would end the
    next test's streams.)"""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _Executor(AgentExecutor):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        agent = self.agent
        headers = {k.lower(): v for k, v in context.call_context.state.get("headers", {}).items()}
        agent.received.append(headers)
        if context.current_task is None and context.message is not None:
            await event_queue.enqueue_event(new_task_from_user_message(context.message))
        task = context.current_task
        updater = TaskUpdater(
            event_queue, task.id if task else context.task_id or "",
            task.context_id if task else context.context_id or "",
        )  # fmt: skip
        for step in range(agent.steps):
            await updater.start_work(new_text_message(f"{agent.name} step {step}"))
        if agent.before_reply is not None:
            await agent.before_reply(headers)
        reply = agent.name
        if agent.next_url is not None:
            passed = {k: v for k, v in headers.items() if k in PASSED}
            if agent.drop_chain:
                passed = {k: v for k, v in passed.items() if k == "traceparent"}
            try:
                events = await ask(agent.next_url, f"from-{agent.name}", passed)
                reply += ">" + _text(events)
            except Exception as exc:
                reply += f"!{type(exc).__name__}:{exc}"
        agent.replies.append(reply)
        await updater.complete(new_text_message(reply))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        raise NotImplementedError


def _text(events: list[Any]) -> str:
    """The text of the last message or final status in the client's events."""
    out = ""
    for event in events:
        item = event[0] if isinstance(event, tuple) else event
        task = getattr(item, "task", None)
        if task is not None and task.status.message.parts:
            out = task.status.message.parts[0].text
        msg = getattr(item, "message", None)
        if msg is not None and msg.parts:
            out = msg.parts[0].text
    return out


@pytest.fixture(name="agents")
async def agents_fixture() -> AsyncIterator[Callable[..., Awaitable[Agent]]]:
    """Make real A2A agents (:class:`Agent`) on loopback: ``await agents(name, ...)``;
    each is stopped when the test ends."""
    made: list[Agent] = []

    async def make(name: str, **kwargs: Any) -> Agent:
        agent = Agent(name, **kwargs)
        await agent.start()
        made.append(agent)
        return agent

    yield make
    for agent in made:
        await agent.stop()

"""The parts the policy drives come from one list: a part added to it is built at start,
takes in each reload and is closed at shutdown, and the keys a reload applies without a
restart are what the parts in the list say they take in.

Real objects only: a real Gateway, its real outbound client and audit log, a real policy
file reloaded from disk.
"""

from __future__ import annotations

import io
import json
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, ClassVar

import pytest

from gateway.policy import Policy, PolicySet, load_policy
from gateway.server.components import COMPONENTS
from gateway.server.parts import Component, Keys, Parts, hot_keys, restart_needed
from gateway.server.runtime import Gateway
from tests.conftest import compile_policy, openai_target, policy_yaml

_TARGETS = {"fake-openai": openai_target("http://127.0.0.1:9")}
_VAULT = {"vault": {"address": "http://127.0.0.1:1", "auth": {"method": "token"}}}


class _Seen:
    """What the probe components were asked to do, in order."""

    events: ClassVar[list[tuple[str, Any]]] = []


class _Probe:
    """A part that remembers the agent id of each policy it is built or reloaded with."""

    keys: ClassVar = Keys(hot=("agent_id",))

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        # It reads a part built before it: the list's order is the build order.
        _Seen.events.append(("build", (policy.policy.agent_id, parts.upstream.closed)))
        upstream = parts.upstream

        async def close() -> None:
            # Closed before the outbound client, which was opened before it.
            _Seen.events.append(("close", upstream.closed))

        stack.push_async_callback(close)

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        _Seen.events.append(("apply", policy.policy.agent_id))


class _FailsToBuild:
    keys: ClassVar = Keys()

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        raise ValueError("this part cannot start")

    def apply(self, policy: PolicySet, parts: Parts) -> None:  # pragma: no cover - never built
        raise AssertionError


def _write(path: Path, **extra: Any) -> str:
    path.write_text(policy_yaml(_TARGETS, **extra))
    return str(path)


def _reload_events(log: io.StringIO) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in log.getvalue().splitlines() if line.startswith("{")]
    return [r for r in records if r.get("event") == "policy_reload"]


@pytest.fixture(autouse=True)
def _forget_seen() -> None:
    _Seen.events.clear()


async def test_a_part_added_to_the_list_is_built_reloaded_and_closed(tmp_path: Path) -> None:
    source = _write(tmp_path / "policy.yaml", agent_id="first")
    parts: list[type[Component]] = [*COMPONENTS, _Probe]
    gateway = Gateway(load_policy(source), log_stream=io.StringIO(), components=parts)
    await gateway.start()
    assert _Seen.events == [("build", ("first", False))]
    _write(tmp_path / "policy.yaml", agent_id="second")
    assert await gateway.reload() is True
    assert _Seen.events[-1] == ("apply", "second")
    assert gateway.pipeline is not None
    assert gateway.pipeline.policy.policy.agent_id == "second"
    await gateway.aclose()
    assert _Seen.events[-1] == ("close", False)  # closed first: the reverse of the start
    await gateway.aclose()  # idempotent: closed once
    assert [e for e, _ in _Seen.events] == ["build", "apply", "close"]


async def test_a_start_that_fails_in_a_part_closes_the_parts_before_it() -> None:
    parts: list[type[Component]] = [*COMPONENTS, _Probe, _FailsToBuild]
    gateway = Gateway(compile_policy(_TARGETS), log_stream=io.StringIO(), components=parts)
    with pytest.raises(ValueError, match="cannot start"):
        await gateway.start()
    assert _Seen.events == [("build", ("test-agent", False)), ("close", False)]
    assert gateway.pipeline is None
    assert gateway.ready()[0] is False


def test_the_keys_applied_on_reload_are_those_the_parts_say_they_take_in() -> None:
    hot = hot_keys(COMPONENTS)
    assert hot == {key for part in COMPONENTS for key in part.keys.hot}
    # The server keys that apply without a restart: each taken in by one part.
    assert {k for k in hot if k.startswith("server.")} == {
        "server.drain_s",
        "server.shutdown",
        "server.max_response_bytes",
        "server.max_inflight_request_bytes",
        "server.debug",
    }
    assert hot_keys([*COMPONENTS, _Probe]) == hot  # agent_id: already taken in


def test_every_policy_section_is_read_by_a_part_in_the_list() -> None:
    claimed = {
        key.partition(".")[0]
        for part in COMPONENTS
        for key in (*part.keys.hot, *part.keys.restart, *part.keys.start_only)
    }
    # "version" selects the file's shape; it drives no part.
    assert claimed == set(Policy.model_fields) - {"version"}


@pytest.mark.parametrize(
    ("change", "needed"),
    [
        ({"server": {"port": 8081}}, ["server"]),
        ({"server": {"drain_s": 3}}, []),
        ({"server": {"port": 8081}, "secrets": _VAULT}, ["server", "secrets"]),
        ({"redis": {"url": "redis://127.0.0.1:6379/0"}}, ["redis"]),
        ({"rate_limit_groups": {"g": {"requests_per_second": 5}}}, []),
    ],
)
def test_a_reload_needs_a_restart_for_what_a_part_reads_at_start_only(
    change: dict[str, Any], needed: list[str]
) -> None:
    old, new = compile_policy(_TARGETS), compile_policy(_TARGETS, **change)
    assert restart_needed(old, new, COMPONENTS) == needed


async def test_the_restart_needed_keys_follow_the_list(tmp_path: Path) -> None:
    class _ReadsPortOnReload:
        keys: ClassVar = Keys(hot=("server.port",))

        async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
            return None

        def apply(self, policy: PolicySet, parts: Parts) -> None:
            return None

    class _ReadsAuditAtStart(_ReadsPortOnReload):
        keys: ClassVar = Keys(restart=("audit",))

    source = _write(tmp_path / "policy.yaml")
    log = io.StringIO()
    parts: list[type[Component]] = [*COMPONENTS, _ReadsPortOnReload, _ReadsAuditAtStart]
    gateway = Gateway(load_policy(source), log_stream=log, components=parts)
    await gateway.start()
    try:
        _write(tmp_path / "policy.yaml", server={"port": 8081}, audit={"payloads": "none"})
        assert await gateway.reload() is True
    finally:
        await gateway.aclose()
    # Without the two parts: ["server"] (the port); with them, the audit section instead.
    assert _reload_events(log)[0]["restart_needed_for"] == ["audit"]

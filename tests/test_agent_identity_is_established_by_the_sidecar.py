"""Who is calling is established by the sidecar (UID, token, policy), never taken from
the caller's word: the pure decision, table by table, and the kernel's answers about
real sockets of this process."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from typing import Any

import pytest

from gateway.agents import peers
from gateway.agents.identity import (
    UNKNOWN_AGENT,
    Agents,
    Seen,
    build_agents,
    establish,
    identify,
    policy_identity,
)
from gateway.errors import PermissionDenied

AGENTS = build_agents(
    "sidecar-default",
    [
        ("planner", 1001, None, None),
        ("coder", 1002, "coder-token-0123456789", ["openai"]),
        ("interpreter", None, "interp-token-0123456789", None),
    ],
)
NONE = Agents("sidecar-default")

# seen, agents -> (agent_id, agent_auth, refusal reason or None, claimed)
CASES: list[tuple[str, Seen, Agents, tuple[Any, ...]]] = [
    ("no agents: the policy's", Seen("tcp"), NONE, ("sidecar-default", "policy", None, None)),
    ("no agents: a token is not looked at", Seen("tcp", token="x" * 20), NONE,
     ("sidecar-default", "policy", None, None)),
    ("no agents: an equal claim", Seen("tcp", claim="sidecar-default"), NONE,
     ("sidecar-default", "policy", None, None)),
    ("no agents: another claim", Seen("tcp", claim="other"), NONE,
     ("sidecar-default", "policy", "agent_mismatch", "other")),
    ("uid", Seen("tcp", peer_uid=1001), AGENTS, ("planner", "uid", None, None)),
    ("uid on the unix socket", Seen("unix", peer_uid=1002), AGENTS, ("coder", "uid", None, None)),
    ("token", Seen("tcp", peer_uid=4242, token="interp-token-0123456789"), AGENTS,
     ("interpreter", "token", None, None)),
    ("uid and its own token", Seen("tcp", 1002, token="coder-token-0123456789"), AGENTS,
     ("coder", "uid", None, None)),
    ("uid and another agent's token", Seen("tcp", 1001, token="coder-token-0123456789"), AGENTS,
     ("planner", "uid", "agent_mismatch", "coder")),
    ("an unknown token", Seen("tcp", 1001, token="guess-0123456789"), AGENTS,
     (UNKNOWN_AGENT, None, "unknown_agent", None)),
    ("an unknown uid", Seen("tcp", peer_uid=4242), AGENTS,
     (UNKNOWN_AGENT, None, "unknown_agent", None)),
    ("an unreadable owner is never a default", Seen("tcp"), AGENTS,
     (UNKNOWN_AGENT, None, "unknown_agent", None)),
    ("an unknown caller's claim changes nothing", Seen("tcp", claim="planner"), AGENTS,
     (UNKNOWN_AGENT, None, "unknown_agent", None)),
    ("uid and an equal claim", Seen("tcp", 1001, claim="planner"), AGENTS,
     ("planner", "uid", None, None)),
    ("uid and another's claim", Seen("tcp", 1001, claim="coder"), AGENTS,
     ("planner", "uid", "agent_mismatch", "coder")),
]  # fmt: skip


@pytest.mark.parametrize(("seen", "agents", "expected"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_who_is_calling(seen: Seen, agents: Agents, expected: tuple[Any, ...]) -> None:
    identity = establish(seen, agents)
    reason = identity.refusal.details["reason"] if identity.refusal else None
    assert (identity.agent_id, identity.agent_auth, reason, identity.claimed) == expected
    assert identity.peer_uid == seen.peer_uid
    if identity.refusal is not None:
        assert "token-0123456789" not in str(identity.refusal.message)
        assert "token-0123456789" not in repr(identity.refusal.details)


def test_an_unknown_caller_is_refused_with_what_the_sidecar_saw() -> None:
    refusal = establish(Seen("unix", peer_uid=4242), AGENTS).refusal
    assert refusal is not None
    assert refusal.details == {"reason": "unknown_agent", "peer_uid": 4242, "listener": "unix"}
    assert "UID 4242" in refusal.message


def test_a_mismatch_names_both_agents() -> None:
    refusal = establish(Seen("tcp", 1001, claim="coder"), AGENTS).refusal
    assert refusal is not None
    assert refusal.details == {
        "reason": "agent_mismatch",
        "claimed": "coder",
        "agent_id": "planner",
        "agent_auth": "uid",
    }


@pytest.mark.parametrize(
    ("claim", "target", "reason"),
    [
        (None, "openai", None),
        ("coder", "openai", None),
        ("planner", "openai", "agent_mismatch"),
        (None, "anthropic", "target_not_allowed"),
    ],
)
def test_the_envelope_claim_and_the_agents_targets(
    claim: str | None, target: str, reason: str | None
) -> None:
    identity = establish(Seen("tcp", 1002), AGENTS).with_claim(claim)
    if reason is None:
        identity.admit(target)
        return
    with pytest.raises(PermissionDenied) as caught:
        identity.admit(target)
    assert caught.value.details["reason"] == reason


def test_without_agents_every_target_is_open() -> None:
    policy_identity("a").admit("anything")


# -- the kernel's word -----------------------------------------------------------------

_LOCAL = (ipaddress.ip_address("127.0.0.1"), 8181)
_PEER = (ipaddress.ip_address("127.0.0.1"), 40000)
_HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  inode"


def _line(local: str, remote: str, uid: int, inode: int) -> str:
    times = "00000000:00000000 00:00000000 00000000"
    return f"   1: {local} {remote} 01 {times}  {uid}        0 {inode} 1"


def _hex4(address: str, port: int) -> str:
    raw = int.from_bytes(socket.inet_aton(address), sys.byteorder)  # a native u32
    return f"{raw:08X}:{port:04X}"


@pytest.mark.parametrize(
    ("lines", "owner"),
    [
        # The client's socket: its own address is our peer, its remote is us.
        ([_line(_hex4("127.0.0.1", 40000), _hex4("127.0.0.1", 8181), 1001, 77)], 1001),
        # Our own accepted socket (the other direction) is not the client's.
        ([_line(_hex4("127.0.0.1", 8181), _hex4("127.0.0.1", 40000), 0, 78)], None),
        # An orphan (its process exited) or a TIME_WAIT left by an earlier connection.
        ([_line(_hex4("127.0.0.1", 40000), _hex4("127.0.0.1", 8181), 0, 0)], None),
        ([_line(_hex4("127.0.0.1", 40000), _hex4("127.0.0.1", 8181), 0, 0),
          _line(_hex4("127.0.0.1", 40000), _hex4("127.0.0.1", 8181), 1002, 79)], 1002),
        (["garbage", "1: zz:zz yy:yy 01 0 0 0 x 0 y"], None),
    ],
)  # fmt: skip
def test_the_owner_of_a_loopback_socket(lines: list[str], owner: int | None) -> None:
    assert peers.socket_owner([_HEADER, *lines], _LOCAL, _PEER) == owner


@pytest.mark.parametrize(
    ("lines", "v6", "owner"),
    [
        ([_line(_hex4("127.0.0.1", 40000), _hex4("127.0.0.1", 8181), 1001, 77)], False, 1001),
        # A TIME_WAIT entry of an earlier connection first, then the live one.
        ([_line(_hex4("127.0.0.1", 40000), _hex4("127.0.0.1", 8181), 0, 0),
          _line(_hex4("127.0.0.1", 41000), _hex4("127.0.0.1", 8181), 1009, 81),
          _line(_hex4("127.0.0.1", 40000), _hex4("127.0.0.1", 8181), 1002, 79)], False, 1002),
        ([_line(_hex4("127.0.0.1", 8181), _hex4("127.0.0.1", 40000), 0, 78)], False, None),
        ([_line("0000000000000000FFFF00000100007F:9C40",
                "0000000000000000FFFF00000100007F:1FF5", 1003, 80)], True, 1003),
    ],
)  # fmt: skip
def test_the_owner_is_found_in_a_whole_table(lines: list[str], v6: bool, owner: int | None) -> None:
    text = "\n".join([_HEADER, *lines]) + "\n"
    assert peers.find_owner(text, _LOCAL, _PEER, v6=v6) == owner
    assert peers.find_owner(text.rstrip("\n"), _LOCAL, _PEER, v6=v6) == owner


def test_an_ipv6_pair_is_not_looked_for_in_the_ipv4_table() -> None:
    local = (ipaddress.ip_address("::1"), 8181)
    assert (
        peers.find_owner(_HEADER + "\n", local, (ipaddress.ip_address("::1"), 1), v6=False) is None
    )


def test_ipv6_and_ipv4_mapped_entries_are_read() -> None:
    mapped = "0000000000000000FFFF00000100007F"  # ::ffff:127.0.0.1, as tcp6 prints it
    line = _line(f"{mapped}:9C40", f"{mapped}:1FF5", 1003, 80)
    assert peers.socket_owner([line], _LOCAL, _PEER) == 1003


class _Transport:
    """The one thing identify asks of asyncio's transport: its socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._sock if name == "socket" else default


def _pair(family: int) -> tuple[socket.socket, socket.socket]:
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname()[:2])
    server, _ = listener.accept()
    listener.close()
    return client, server


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_the_kernel_names_this_process_as_the_owner(family: int) -> None:
    client, server = _pair(family)
    with client, server:
        assert peers.peer_uid(server) == os.getuid()


def test_a_peer_whose_socket_was_let_go_has_no_owner() -> None:
    client, server = _pair(socket.AF_INET)
    with server:
        client.close()  # no process holds it now: an orphan in FIN_WAIT (inode 0)
        assert peers.peer_uid(server) is None
        identity = identify(_Transport(server), {}, AGENTS)
        assert identity.refusal is not None
        assert identity.refusal.details == {
            "reason": "unknown_agent", "peer_uid": None, "listener": "tcp",
        }  # fmt: skip


def test_a_unix_socket_peer_is_known_by_its_credentials() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert peers.peer_uid(b) == os.getuid()
        agents = build_agents("d", [("me", os.getuid(), None, None)])
        identity = identify(_Transport(b), {"x-egress-agent": "me"}, agents)
        assert (identity.agent_id, identity.agent_auth, identity.refusal) == ("me", "uid", None)


def test_no_socket_is_no_owner() -> None:
    assert peers.peer_uid(None) is None

"""What the kernel says about the process at the other end of a socket (Linux).

* A Unix-socket peer: ``SO_PEERCRED`` (socket(7)), the UID of the process that called
  ``connect()``, fixed for the connection's life.
* A loopback TCP peer: the owner of the client's own socket, found in ``/proc/net/tcp``
  and ``/proc/net/tcp6`` (proc(5)) as the socket whose local address is our peer's and
  whose remote address is ours. Both ends of a loopback connection live in this network
  namespace (a pod's containers share it). A socket its process has let go of (the
  process exited: an orphan, inode 0) or one outside this namespace has no owner here.

The parsing is pure (:func:`socket_owner`); :func:`peer_uid` reads the kernel.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Iterable
from typing import Any, Final, Protocol

#: The tables read for a TCP peer, in order: IPv4 sockets, then IPv6 (and IPv4-mapped).
TCP_TABLES: Final = ("/proc/net/tcp", "/proc/net/tcp6")
_UCRED: Final = struct.Struct("=iII")  # struct ucred: pid, uid, gid
Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


class PeerSocket(Protocol):
    """What :func:`peer_uid` needs of a socket (``socket.socket`` or asyncio's
    ``TransportSocket``)."""

    @property
    def family(self) -> int: ...

    def getpeername(self) -> Any: ...

    def getsockname(self) -> Any: ...

    def getsockopt(self, level: int, option: int, buflen: int) -> bytes: ...


def _address(host: str, port: int) -> Address:
    address = ipaddress.ip_address(host.partition("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack listener sees an IPv4 peer this way
    return address, port


def _table_address(text: str) -> Address:
    """``0100007F:1F90`` (a u32 per 4 bytes, in host byte order, and a hex port)."""
    raw, _, port = text.partition(":")
    words = [int(raw[i : i + 8], 16) for i in range(0, len(raw), 8)]
    packed = b"".join(struct.pack("=I", w) for w in words)
    address = ipaddress.ip_address(packed)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address, int(port, 16)


def socket_owner(lines: Iterable[str], local: Address, peer: Address) -> int | None:
    """The UID owning the socket whose own address is ``peer`` and whose remote address is
    ``local`` (our end), from the lines of a ``/proc/net/tcp``-style table; None when no
    such socket is there or its process let it go (inode 0)."""
    for line in lines:
        fields = line.split()
        if len(fields) < 10 or fields[0] == "sl":
            continue
        try:
            own, remote = _table_address(fields[1]), _table_address(fields[2])
            uid, inode = int(fields[7]), int(fields[9])
        except ValueError:
            continue
        # An orphan or a TIME_WAIT entry of an earlier connection has inode 0: no owner.
        if own == peer and remote == local and inode != 0:
            return uid
    return None


def _entry(address: Address, v6: bool) -> str:
    """``address`` as a table prints it: ``%08X`` per 4 bytes in host order, ``:%04X``."""
    ip, port = address
    if v6 and isinstance(ip, ipaddress.IPv4Address):
        ip = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed)  # v4-mapped
    packed = ip.packed
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def find_owner(text: str, local: Address, peer: Address, *, v6: bool) -> int | None:
    """:func:`socket_owner` over a whole table's ``text`` (``v6``: ``/proc/net/tcp6``'s),
    parsing only the lines that name the pair: a search in C instead of a parse per line
    of a table that holds every socket of the pod."""
    if not v6 and (peer[0].version == 6 or local[0].version == 6):
        return None
    needle = f"{_entry(peer, v6)} {_entry(local, v6)} "
    at = text.find(needle)
    while at != -1:
        end = text.find("\n", at)
        line = text[text.rfind("\n", 0, at) + 1 : end if end != -1 else len(text)]
        uid = socket_owner([line], local, peer)
        if uid is not None:
            return uid
        at = text.find(needle, at + len(needle))
    return None


def peer_uid(sock: PeerSocket | None) -> int | None:
    """The UID of the process at the other end of ``sock`` (module docstring), or None
    when the kernel does not say (not a Unix or TCP socket, the peer gone, another host).
    Reads ``/proc/net/tcp*`` for a TCP socket: blocking, but in-memory and short."""
    if sock is None:
        return None
    try:
        if sock.family == socket.AF_UNIX:
            _pid, uid, _gid = _UCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            return int(uid)
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        local, peer = _address(*sock.getsockname()[:2]), _address(*sock.getpeername()[:2])
    except (OSError, ValueError):
        return None  # the connection is already gone, or an address we cannot read
    for table in TCP_TABLES:
        try:
            with open(table, encoding="ascii") as file:
                uid = find_owner(file.read(), local, peer, v6=table.endswith("6"))
        except OSError:
            continue
        if uid is not None:
            return uid
    return None

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
                uid = socket_owner(file, local, peer)
        except OSError:
            continue
        if uid is not None:
            return uid
    return None

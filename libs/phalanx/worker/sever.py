"""Cut this process's TCP connections to a lost node, so that gloo lets go of it.

A peer that dies closes its sockets and every rank blocked in a collective with
it fails within milliseconds (the cascade). A node cut off from the network
closes nothing: its peers would sit in the collective until the per-op timeout,
because gloo has no abort for an operation in flight. Once the planner has
declared the node lost (its plan lists the node's address), each surviving rank
shuts down its own connections to that address: ``shutdown(2)`` on a socket wakes
gloo's blocked read with end-of-file, the collective fails as if the peer had
died, and recovery goes on at once.

The same cut ends a gloo collective on demand (:class:`SocketSet`): the sockets a
process group opened while it was built are noted, and shutting them down releases
an operation blocked in them within a millisecond (gloo's own ``abort()`` does
nothing to one in flight), and the peers at their other ends fail as if this rank
had died.

Linux only: the connections are found in ``/proc/self/net/tcp{,6}`` and matched to
this process's descriptors through ``/proc/self/fd``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterable

__all__ = ["SocketSet", "open_sockets", "sever"]


def _remote_by_inode() -> dict[str, str]:
    """Established TCP connections of this network namespace: socket inode -> remote address."""
    out: dict[str, str] = {}
    for name, v6 in (("tcp", False), ("tcp6", True)):
        with contextlib.suppress(OSError):
            with open(f"/proc/self/net/{name}") as f:
                rows = f.read().splitlines()[1:]
            for row in rows:
                fields = row.split()
                remote, state, inode = fields[2], fields[3], fields[9]
                if state != "01":  # ESTABLISHED
                    continue
                raw = bytes.fromhex(remote.split(":")[0])
                if v6:  # four little-endian 32-bit words
                    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    addr = ipaddress.IPv6Address(raw)
                    host = str(addr.ipv4_mapped or addr)
                else:
                    host = str(ipaddress.IPv4Address(raw[::-1]))
                out[inode] = host
    return out


def open_sockets() -> dict[int, int]:
    """This process's sockets now: descriptor -> the socket's inode."""
    out: dict[int, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(fd)] = int(target[8:-1])
    return out


def _shutdown(fd: int, inode: int | None = None, spared: frozenset[tuple[str, int]] = frozenset()) -> bool:
    """``shutdown(2)`` the socket behind ``fd`` through a second handle (the owner's
    stays open), if it still is socket ``inode`` (a closed descriptor may have been
    reused), is not listening and is not connected to an endpoint in ``spared``."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        if inode is not None and os.fstat(dup).st_ino != inode:
            return False
        s = socket.socket(fileno=dup)
        dup = -1  # the socket object owns it now
        try:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return False  # a listener: gloo treats its failure as fatal, and it carries no op
            if spared:
                with contextlib.suppress(OSError):
                    if s.getpeername()[:2] in spared:
                        return False
            s.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
        finally:
            s.close()
    finally:
        if dup >= 0:
            os.close(dup)


def sever(hosts: Iterable[str]) -> int:
    """Shut down every TCP connection of this process to one of ``hosts``; returns how many."""
    wanted = set(hosts)
    if not wanted:
        return 0
    remote = _remote_by_inode()
    return sum(
        _shutdown(fd, inode) for fd, inode in open_sockets().items() if remote.get(str(inode)) in wanted
    )


class SocketSet:
    """The sockets something in this process opened (a gloo group's pairs), to cut later.

    ``note_before()`` then, once the thing is built, ``note_after()``: the sockets that
    appeared in between are its own (a group built in the training thread; another
    thread's rare new connection in that window would be cut with it, except one to an
    endpoint in ``spared``). :meth:`cut` shuts them down, from any thread, at most once:
    an op blocked in one of them fails at once. With ``late=True`` (gloo's lazy pairs,
    connected on first use) :meth:`cut` also takes the sockets that appeared since
    ``note_before()``.
    """

    def __init__(self, spared: Iterable[tuple[str, int]] = (), *, late: bool = False) -> None:
        self.spared = frozenset(spared)
        self.late = late
        self._before: dict[int, int] = {}
        self._own: dict[int, int] = {}
        self._cut = False

    def note_before(self) -> None:
        self._before = open_sockets()

    def note_after(self) -> None:
        before = self._before
        self._own = {fd: ino for fd, ino in open_sockets().items() if before.get(fd) != ino}

    def __len__(self) -> int:
        return len(self._own)

    def cut(self) -> int:
        """Shut the sockets down (once); returns how many were."""
        if self._cut:
            return 0
        self._cut = True
        own = dict(self._own)
        if self.late:
            before = self._before
            own.update({fd: ino for fd, ino in open_sockets().items() if before.get(fd) != ino})
        return sum(_shutdown(fd, ino, self.spared) for fd, ino in own.items())

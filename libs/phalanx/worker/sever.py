"""Cut this process's TCP connections to a lost node, so that gloo lets go of it.

A peer that dies closes its sockets and every rank blocked in a collective with
it fails within milliseconds (the cascade). A node cut off from the network
closes nothing: its peers would sit in the collective until the per-op timeout,
because gloo has no abort for an operation in flight. Once the planner has
declared the node lost (its plan lists the node's address), each surviving rank
shuts down its own connections to that address: ``shutdown(2)`` on a socket wakes
gloo's blocked read with end-of-file, the collective fails as if the peer had
died, and recovery goes on at once.

Linux only: the connections are found in ``/proc/self/net/tcp{,6}`` and matched to
this process's descriptors through ``/proc/self/fd``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterable


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


def sever(hosts: Iterable[str]) -> int:
    """Shut down every TCP connection of this process to one of ``hosts``; returns how many."""
    wanted = set(hosts)
    if not wanted:
        return 0
    remote = _remote_by_inode()
    cut = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith("socket:[") or remote.get(target[8:-1]) not in wanted:
            continue
        with contextlib.suppress(OSError):
            s = socket.socket(fileno=os.dup(int(fd)))  # a second handle; the owner's stays open
            try:
                s.shutdown(socket.SHUT_RDWR)
                cut += 1
            finally:
                s.close()
    return cut

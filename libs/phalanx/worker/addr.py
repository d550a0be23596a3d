"""Addresses of a node: where its store and gloo listen, and how to parse ``host:port``.

No torch here: a launcher binds its store's socket and joins its job before it
imports torch.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


def split_addr(addr: str) -> tuple[str, int]:
    """``"10.0.0.1:29400"`` -> ``("10.0.0.1", 29400)``; a clear ValueError otherwise."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def local_address_towards(url: str) -> str:
    """The address of this host's interface that reaches the first server of ``url``:
    the one the node is reached by. Loopback for a local server. A UDP ``connect``
    only picks the route; it sends nothing."""
    first = url.split(",")[0].strip()
    parts = urlsplit(first if "://" in first else f"nats://{first}")
    host = parts.hostname or "127.0.0.1"
    port = parts.port or 4222
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return str(s.getsockname()[0])


def listen_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host`` only (``port=0``: a free one), for :func:`host_store`.

    Plain Python: a launcher learns its store's address before it imports torch.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


_SIOCGIFADDR = 0x8915


def interface_of(addr: str) -> str | None:
    """The name of this host's interface holding IPv4 or IPv6 ``addr`` (None: none does).

    What ``GLOO_SOCKET_IFNAME`` takes: a script left to gloo's default binds to the
    address its hostname resolves to, which on a host whose name maps to loopback (or
    to another interface than the one its peers reach) is not the node's address.
    """
    import fcntl
    import ipaddress
    import struct

    try:
        ip = ipaddress.ip_address(addr.strip("[]"))
    except ValueError:
        return None
    if ip.version == 6:
        try:
            with open("/proc/net/if_inet6") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) >= 6 and ipaddress.ip_address(int(fields[0], 16)) == ip:
                        return fields[5]
        except OSError:
            return None
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(raw[20:24]) == str(ip):
                return name
    return None

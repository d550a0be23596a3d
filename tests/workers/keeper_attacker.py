"""A local user and a network peer turned against a node's keepers, for a bounded time
(tests/e2e/test_flood.py; run as another uid).

- The ranks' Unix socket (``--socket``): ``--socket-conns`` connections held at once, each
  announcing a 16 MiB request and sending it (what once took a keeper from 60 to
  829 MiB resident with 48 of them); each is counted as ``refused:<error>`` (the
  connect or a send failed), ``answered`` (the keeper replied, refusing) or ``silent``.
- The peers' TCP port of each ``--peer host:port``: ``--per-address`` silent
  connections from each of the loopback addresses 127.0.0.2-9, each reconnecting as
  soon as the keeper drops it (what once kept a node's replica out of its peer).

Stops after ``--seconds`` and prints its counts as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
from collections import Counter

REQUEST_BYTES = 16 << 20
SOURCES = [f"127.0.0.{i}" for i in range(2, 10)]


def hold_socket(path: str, body: memoryview, until: float, out: Counter[str], lock: threading.Lock) -> None:
    """One connection to the ranks' socket: the huge request, then whatever the keeper says."""
    outcome = "silent"
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(max(0.1, until - time.monotonic()))
        try:
            s.connect(path)
            s.sendall(struct.pack(">I", len(body)))
            s.sendall(body)
            if s.recv(65536):
                outcome = "answered"
        except TimeoutError:
            pass
        except OSError as exc:
            outcome = f"refused:{type(exc).__name__}"
    with lock:
        out[outcome] += 1


async def flood_peer(host: str, port: int, source: str, until: float, out: Counter[str]) -> None:
    """Silent connections from ``source``, each reconnecting once the keeper drops it."""
    while time.monotonic() < until:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            out["connect_failed"] += 1
            await asyncio.sleep(0.2)
            continue
        out["opened"] += 1
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(reader.read(), max(0.01, until - time.monotonic()))
            out["dropped"] += 1
        writer.close()
        await asyncio.sleep(0.05)


async def flood_peers(peers: list[str], per_address: int, until: float) -> dict[str, int]:
    out: Counter[str] = Counter()
    tasks = []
    for peer in peers:
        host, _, port = peer.rpartition(":")
        tasks += [flood_peer(host, int(port), src, until, out) for src in SOURCES for _ in range(per_address)]
    await asyncio.gather(*tasks)
    return dict(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True, help="the keeper's socket for ranks")
    p.add_argument("--socket-conns", type=int, default=200)
    p.add_argument("--peer", action="append", default=[], help="a keeper's peer address, host:port")
    p.add_argument("--per-address", type=int, default=12)
    p.add_argument("--seconds", type=float, default=30.0)
    args = p.parse_args()
    until = time.monotonic() + args.seconds
    body = memoryview(bytearray(REQUEST_BYTES))
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    threads = [
        threading.Thread(target=hold_socket, args=(args.socket, body, until, counts, lock), daemon=True)
        for _ in range(args.socket_conns)
    ]
    for t in threads:
        t.start()
    peers = asyncio.run(flood_peers(args.peer, args.per_address, until))
    for t in threads:
        t.join(max(0.1, until - time.monotonic()) + 10)
    print(json.dumps({"socket": dict(counts), "peers": peers}))


if __name__ == "__main__":
    main()

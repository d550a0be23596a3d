"""The job's rendezvous store, hosted in a process of its own that the node's launcher starts.

``python -m phalanx.runtime.store --fd N --host H``: a
:class:`~phalanx.runtime.storeserver.StoreServer` serving on the listening socket the
launcher bound on ``H`` and handed down as descriptor ``N``. Neither the launcher nor
this process imports torch (the launcher must start in milliseconds beside the ranks;
this one is ready as soon as Python is).

What the launcher relies on (:mod:`phalanx.launcher.store`):

- one line ``ready <port>`` on stdout once the store serves (not before: the
  launcher waits for it, never sleeps on it);
- each line ``allow <secret>`` on its stdin adds a generation the store serves (the
  launcher writes one for every plan it applies, before the plan reaches a rank);
- it serves until its stdin reaches end of file -- the launcher closed it, or
  died (it is also SIGKILLed when the launcher dies, ``PR_SET_PDEATHSIG``) --
  then exits 0; any other exit is a death the launcher reports;
- Ctrl-C in the terminal (SIGINT to the whole process group) is the launcher's
  to act on: the store keeps serving while the launcher stops the ranks.

Ranks connect with :func:`phalanx.runtime.comm.connect_store`; a rank that hosts a
store for the script it runs uses :func:`host_store`.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys

from phalanx.runtime.storeserver import StoreServer, ThreadedStore
from phalanx.worker.addr import listen_socket

READY = "ready"
ALLOW = "allow"
MAX_LINE = 4096


def host_store(
    host: str = "127.0.0.1", port: int = 0, sock: socket.socket | None = None, secrets: tuple[str, ...] = ()
) -> ThreadedStore:
    """Host a store in this process, on a thread of its own, listening on ``host`` only
    (``store.port``) and serving the generations of ``secrets`` (more with ``allow``)."""
    sock = sock or listen_socket(host, port)
    try:
        return ThreadedStore(sock, secrets)
    except BaseException:
        sock.close()
        raise


async def serve(sock: socket.socket) -> int:
    server = StoreServer()
    await server.start(sock)
    print(f"{READY} {sock.getsockname()[1]}", flush=True)
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader(limit=MAX_LINE)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    while line := await stdin.readline():
        word, _, secret = line.decode(errors="replace").strip().partition(" ")
        if word == ALLOW and secret:
            server.allow(secret)
    await server.close()
    return 0  # end of file: the launcher is done with the store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m phalanx.runtime.store", description="The job's store.")
    parser.add_argument("--fd", type=int, required=True, help="the listening socket, inherited")
    parser.add_argument("--host", required=True, help="the address the socket is bound to")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return asyncio.run(serve(socket.socket(fileno=args.fd)))


if __name__ == "__main__":
    sys.exit(main())

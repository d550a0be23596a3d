"""The job's rendezvous store, hosted in a process of its own that the node's launcher starts.

``python -m phalanx.runtime.store --fd N --host H``: a ``TCPStore``
(:func:`host_store`) serving on the listening socket the launcher bound on ``H``
and handed down as descriptor ``N``. The launcher imports no torch (it must start
in milliseconds, beside the ranks); the store does, so it lives here, one per job
on each node, started once and outliving every rank. This module imports
``torch.distributed`` and nothing else of torch or of phalanx's bus side, so the
process is ready as soon as torch is imported.

What the launcher relies on (:mod:`phalanx.launcher.store`):

- one line ``ready <port>`` on stdout once the store serves (not before: the
  launcher waits for it, never sleeps on it);
- it serves until its stdin reaches end of file -- the launcher closed it, or
  died (it is also SIGKILLed when the launcher dies, ``PR_SET_PDEATHSIG``) --
  then exits 0; any other exit is a death the launcher reports;
- Ctrl-C in the terminal (SIGINT to the whole process group) is the launcher's
  to act on: the store keeps serving while the launcher stops the ranks.

Ranks connect with :func:`phalanx.runtime.comm.connect_store`.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys

import torch.distributed as dist

from phalanx.worker.addr import listen_socket

READY = "ready"


def host_store(host: str = "127.0.0.1", port: int = 0, sock: socket.socket | None = None) -> dist.TCPStore:
    """Host a store listening on ``host`` only (``store.port``).

    ``TCPStore(is_master=True)`` alone listens on every interface whatever ``host``
    says; handing it a socket already bound to ``host`` (``sock``, or one made
    here) keeps it on the interface the node is reached by.
    """
    sock = sock or listen_socket(host, port)
    try:
        store = dist.TCPStore(
            host,
            int(sock.getsockname()[1]),
            is_master=True,
            wait_for_workers=False,
            use_libuv=True,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store serves on this fd from now on: Python must not close it
    return store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m phalanx.runtime.store", description="The job's store.")
    parser.add_argument("--fd", type=int, required=True, help="the listening socket, inherited")
    parser.add_argument("--host", required=True, help="the address the socket is bound to")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = host_store(args.host, sock=socket.socket(fileno=args.fd))
    print(f"{READY} {store.port}", flush=True)
    while sys.stdin.buffer.read(4096):
        pass  # the launcher writes nothing: end of file is the one message
    return 0


if __name__ == "__main__":
    sys.exit(main())

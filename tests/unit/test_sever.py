"""Cutting this process's connections to a lost node's address (phalanx.worker.sever):
a read blocked on such a connection ends at once; other connections are untouched."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from phalanx.worker.sever import sever


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv
    srv.close()


def _connect(listener: socket.socket, src: str) -> tuple[socket.socket, socket.socket]:
    """A connection from this process to itself whose far end is ``src`` for the accepted side."""
    c = socket.create_connection(listener.getsockname(), source_address=(src, 0))
    s, _ = listener.accept()
    return c, s


def test_a_blocked_read_on_a_cut_host_ends_and_other_connections_live(listener: socket.socket) -> None:
    # the accepted sockets' remote ends are 127.0.0.2 and 127.0.0.3: "two peers"
    c2, s2 = _connect(listener, "127.0.0.2")
    c3, s3 = _connect(listener, "127.0.0.3")
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(s2.recv(1)), daemon=True)
    reader.start()
    try:
        # one socket of this process has 127.0.0.2 as its remote address: s2
        assert sever(["127.0.0.2"]) == 1
        reader.join(10)
        assert not reader.is_alive() and got == [b""]  # end-of-file, as from a peer that died
        c3.sendall(b"x")
        assert s3.recv(1) == b"x"  # the other peer's connection is untouched
        assert sever([]) == 0 and sever(["127.0.0.9"]) == 0
    finally:
        for s in (c2, s2, c3, s3):
            s.close()

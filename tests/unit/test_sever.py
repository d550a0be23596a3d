"""Cutting this process's connections to a lost node's address (phalanx.worker.sever):
a read blocked on such a connection ends at once; other connections are untouched.
The same for the sockets something opened between two moments (SocketSet: a gloo
group's pairs)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from phalanx.worker.sever import SocketSet, sever


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


def test_a_socket_set_cuts_what_opened_in_its_window_and_nothing_else(listener: socket.socket) -> None:
    old_c, old_s = _connect(listener, "127.0.0.1")  # before the window: not the set's
    spared_srv = socket.socket()
    spared_srv.bind(("127.0.0.1", 0))
    spared_srv.listen(1)
    cut = SocketSet(spared=[spared_srv.getsockname()])
    cut.note_before()
    new_c, new_s = _connect(listener, "127.0.0.1")  # the set's: both ends are this process's
    store_c = socket.create_connection(spared_srv.getsockname())  # a store's client: spared
    cut.note_after()
    store_s, _ = spared_srv.accept()  # (the server's end opens after the window)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(new_c.recv(1)), daemon=True)
    reader.start()
    try:
        assert cut.cut() == 2  # new_c and new_s
        reader.join(10)
        assert not reader.is_alive() and got == [b""]
        assert cut.cut() == 0  # once
        store_c.sendall(b"s")  # the client of the spared endpoint lives
        assert store_s.recv(1) == b"s"
        old_c.sendall(b"o")
        assert old_s.recv(1) == b"o"  # opened before the window: untouched
        listener.getsockname()  # the listeners are never cut
        probe = socket.create_connection(listener.getsockname())
        probe.close()
    finally:
        for s in (old_c, old_s, new_c, new_s, store_c, store_s, spared_srv):
            s.close()


def test_a_socket_set_skips_a_descriptor_reused_by_another_socket(listener: socket.socket) -> None:
    cut = SocketSet()
    cut.note_before()
    c, s = _connect(listener, "127.0.0.1")
    cut.note_after()
    fd = c.fileno()
    c.close()
    other, other_s = _connect(listener, "127.0.0.1")  # may take c's descriptor number
    try:
        cut.cut()
        other.sendall(b"x")
        assert other_s.recv(1) == b"x"  # a reused descriptor is another socket: left alone
        assert fd >= 0
    finally:
        for x in (s, other, other_s):
            x.close()

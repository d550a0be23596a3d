"""The rendezvous store against a non-member (phalanx.runtime.storeserver): what a client
with only the store's address can do over the wire -- read, write, delete, list, stall --
tried with raw sockets against the real server, and refused; what a member needs still
works beside it."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from phalanx.runtime import storeserver
from phalanx.runtime import storewire as wire
from phalanx.runtime.comm import connect_store, generation_store
from phalanx.runtime.storeserver import ThreadedStore
from tests.stores import addr, hosted

SECRET = "gen-7-s3cret"


@pytest.fixture
def store() -> Iterator[ThreadedStore]:
    s = hosted(SECRET)
    yield s
    s.close()


def raw(store: ThreadedStore, host: str = "127.0.0.1") -> tuple[socket.socket, bytes]:
    """A bare connection (an attacker's): the store's greeting read, its nonce returned."""
    sock = socket.create_connection(("127.0.0.1", store.port), timeout=5)
    if host != "127.0.0.1":
        sock.close()
        sock = socket.socket()
        sock.settimeout(5)
        sock.bind((host, 0))
        sock.connect(("127.0.0.1", store.port))
    magic, nonce = wire.receive(sock)
    assert magic == wire.MAGIC
    return sock, bytes(nonce)


def closed(sock: socket.socket, within_s: float = 5.0) -> bool:
    """Whether the store closed ``sock`` (after any answer it sent)."""
    sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def prove(sock: socket.socket, nonce: bytes, secret: str) -> list[Any]:
    mine = wire.nonce()
    wire.send(sock, [wire.AUTH, wire.space_id(secret), mine, wire.proof(secret, "client", nonce, mine)])
    return list(wire.receive(sock))


def member(store: ThreadedStore, timeout_s: float = 5.0) -> dist.Store:
    return generation_store(connect_store(addr(store), timeout_s), SECRET)


# -- read, write, delete, list ----------------------------------------------------------------


@pytest.mark.parametrize(
    "request_",
    [
        [wire.SET, 0, "arrived/1", b"forged"],
        [wire.GET, 0, "arrived/0", 100],
        [wire.DELETE, 0, "arrived/0"],
        [wire.CHECK, 0, ["arrived/0"]],
        [wire.WAIT, 0, ["arrived/0"], 100],
        [wire.ADD, 0, "arrived/count", 1],
        ["list_keys"],
    ],
    ids=["set", "get", "delete", "check", "wait", "add", "list"],
)
def test_before_a_proof_every_request_ends_the_connection_and_changes_nothing(
    store: ThreadedStore, request_: list[Any]
) -> None:
    m = member(store)
    m.set("arrived/0", "1")
    m.add("arrived/count", 1)
    sock, _ = raw(store)
    wire.send(sock, request_)
    assert closed(sock)  # no answer at all: not even whether the key exists
    assert store.keys(SECRET) == ["arrived/0", "arrived/count"]
    assert m.get("arrived/0") == b"1" and m.add("arrived/count", 0) == 1


def test_a_wrong_proof_is_refused_and_the_secret_of_one_generation_opens_no_other(
    store: ThreadedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storeserver, "LEARN_S", 0.1)
    sock, nonce = raw(store)
    mine = wire.nonce()
    wire.send(sock, [wire.AUTH, wire.space_id(SECRET), mine, wire.proof("a-guess", "client", nonce, mine)])
    status, why = wire.receive(sock)
    assert status == wire.ERROR and "authentication failed" in why and closed(sock)
    sock, nonce = raw(store)
    assert prove(sock, nonce, "another-generation")[0] == wire.ERROR  # a secret this store does not serve
    store.allow("other-gen")
    sock, nonce = raw(store)
    status, (slot, _) = prove(sock, nonce, "other-gen")
    wire.send(sock, [wire.SET, slot, "arrived/1", b"forged"])
    assert wire.receive(sock) == [wire.OK, None]
    wire.send(sock, [wire.GET, slot + 1, "arrived/1", 100])  # a slot it was never given
    assert wire.receive(sock)[0] == wire.ERROR
    assert store.keys(SECRET) == [] and store.keys("other-gen") == ["arrived/1"]


def test_failed_proofs_from_an_address_are_refused_at_once_after_a_burst(
    store: ThreadedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storeserver, "LEARN_S", 0.0)
    for _ in range(storeserver.FAILURE_BURST):
        sock, nonce = raw(store)
        assert "authentication failed" in prove(sock, nonce, "guess")[1]
    sock, nonce = raw(store)
    status, why = prove(sock, nonce, SECRET)  # even the right secret: this address is out of tries
    assert status == wire.ERROR and "too many failed authentications" in why
    other, nonce = raw(store, "127.0.0.2")  # another address is not held back
    assert prove(other, nonce, SECRET)[0] == wire.OK


def test_the_client_refuses_a_store_that_cannot_prove_the_secret() -> None:
    """Whoever takes the store's address cannot pose as it: the client checks the
    store's own proof, and a wrong one fails the rendezvous."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def impostor() -> None:
        conn, _ = listener.accept()
        wire.send(conn, wire.hello(wire.nonce()))
        wire.receive(conn)
        wire.send(conn, [wire.OK, [0, b"\0" * 32]])
        time.sleep(1)
        conn.close()

    threading.Thread(target=impostor, daemon=True).start()
    client = connect_store(f"127.0.0.1:{port}", 5)
    with pytest.raises(dist.DistStoreError, match="could not prove"):
        generation_store(client, SECRET)
    listener.close()


# -- stall ---------------------------------------------------------------------------------------


def test_connections_that_prove_nothing_cannot_keep_a_member_out(
    store: ThreadedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-member fills the unproven pool of its address and of the whole store: each
    member that connects takes the place of the oldest silent connection and meets."""
    monkeypatch.setattr(storeserver, "MAX_UNPROVEN", 16)
    monkeypatch.setattr(storeserver, "MAX_UNPROVEN_PER_HOST", 8)
    s = hosted(SECRET)  # built with the smaller pools
    try:
        silent = [raw(s, f"127.0.0.{2 + i // 8}")[0] for i in range(16)]  # the whole pool, from 2 addresses
        silent += [raw(s)[0] for _ in range(8)]  # and the members' own address's share
        for i in range(4):
            m = generation_store(connect_store(addr(s), 5), SECRET)
            m.set(f"k{i}", "v")
            assert m.get(f"k{i}") == b"v"
        assert sum(closed(x, 0.05) for x in silent) >= 4  # the oldest gave way
    finally:
        s.close()


def test_a_silent_connection_is_closed_and_a_spares_early_one_reconnects(
    store: ThreadedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storeserver, "AUTH_S", 0.3)
    sock, _ = raw(store)
    early = connect_store(addr(store), 5)  # a spare's, connected long before its first plan
    assert closed(sock, 3.0)
    time.sleep(0.3)
    m = generation_store(early, SECRET)  # the store closed it meanwhile: proved on a new one
    m.set("k", "v")
    assert m.get("k") == b"v"


def test_a_frame_too_large_or_never_finished_costs_the_store_nothing(
    store: ThreadedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storeserver, "BODY_S", 0.3)
    sock, _ = raw(store)
    sock.sendall(struct.pack(">I", 64 * 1024 * 1024))  # 64 MiB announced: refused before a byte is read
    assert closed(sock, 2.0)
    sock, _ = raw(store)
    sock.sendall(struct.pack(">I", 100) + b"\x93")  # a header, then silence
    assert closed(sock, 3.0)
    sock, _ = raw(store)
    sock.sendall(struct.pack(">I", 3) + b"\xc1\xc1\xc1")  # not msgpack
    assert closed(sock, 2.0)
    m = member(store)
    m.set("still", "serving")
    assert m.get("still") == b"serving"


# -- a member's bounds ---------------------------------------------------------------------------


def test_a_value_too_large_is_refused_and_the_connection_goes_on(store: ThreadedStore) -> None:
    m = member(store)
    with pytest.raises(dist.DistStoreError, match="at most"):
        m.set("big", b"x" * (wire.MAX_VALUE + 1))
    m.set("small", "ok")
    assert m.get("small") == b"ok" and "big" not in store.keys(SECRET)


def test_an_old_generation_is_retired_and_its_waiters_answered(
    store: ThreadedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storeserver, "MAX_SPACES", 3)
    m = member(store, timeout_s=30)
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            m.wait(["never"], timedelta(seconds=30))
        except BaseException as exc:
            failed.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    for g in range(3):  # three newer generations: the oldest (SECRET) goes
        store.allow(f"newer-{g}")
    waiter.join(5)
    assert not waiter.is_alive() and failed and "retired" in str(failed[0])
    assert store.keys(SECRET) == []


def test_torchs_store_semantics_hold(store: ThreadedStore) -> None:
    """What gloo, NCCL and the arrival rely on: get waits for the key, add counts,
    compare_set as TCPStore's, check, delete, a wait's timeout."""
    m = member(store)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(member(store).get("late")))
    reader.start()
    time.sleep(0.1)
    m.set("late", b"\x00\xff")
    reader.join(5)
    assert got == [b"\x00\xff"]
    assert [m.add("n", 2), m.add("n", -5), m.get("n")] == [2, -3, b"-3"]
    assert m.compare_set("c", "", "v") == b"v"  # absent and expected empty: set
    assert m.compare_set("c", "x", "w") == b"v"  # not the expected: the value held
    assert m.compare_set("c", "v", "w") == b"w"
    assert m.compare_set("absent", "x", "y") == b"x"  # absent, expected non-empty: expected back
    assert m.check(["c", "n"]) and not m.check(["c", "absent"])
    whole = connect_store(addr(store), 5)  # torch's PrefixStore does not pass delete_key on
    whole.prove(SECRET)
    assert whole.delete_key(f"{SECRET}/c") and not whole.delete_key(f"{SECRET}/c")
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout"):
        m.wait(["absent"], timedelta(seconds=0.2))
    assert time.monotonic() - started < 2.0
    with pytest.raises(dist.DistStoreError, match="does not hold an integer"):
        m.set("s", "text")
        m.add("s", 1)


def test_torchs_own_store_client_gets_nothing_from_it(store: ThreadedStore) -> None:
    """The attack that worked on torch's TCPStore (a client with host:port listed the
    keys, the secret in their names, then read and planted them) fails at connect."""
    member(store).set("arrived/0", "1")
    with pytest.raises(dist.DistError):
        client = dist.TCPStore(
            "127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=2), use_libuv=True
        )
        client.list_keys()
    assert store.keys(SECRET) == ["arrived/0"]


def test_a_generations_bytes_are_counted_once_per_key() -> None:
    """Overwriting a key counts the change of its value, not the key again: the cap is
    reached by what is held, not by how often it was written."""
    space = storeserver.Space()
    space.put("key", b"12345")
    space.put("key", b"123")
    assert space.size == len("key") + 3
    assert space.delete("key") and space.size == 0

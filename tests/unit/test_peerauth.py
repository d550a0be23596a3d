"""The keepers' handshake and sealed frames (phalanx.checkpoint.peerauth) over real
loopback sockets: both sides prove the key, a wrong key or a replayed handshake is
refused, and a sealed frame cannot be forged, replayed or moved to another session."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from phalanx.checkpoint import peerauth, wire
from phalanx.checkpoint.peerauth import AuthError, Session

KEY = b"k" * 32
Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Recorder:
    """A writer that keeps a copy of every byte written (a passive eavesdropper)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer, self.sent = writer, b""

    def write(self, data: bytes) -> None:
        self.sent += data
        self.writer.write(data)

    async def drain(self) -> None:
        await self.writer.drain()


@contextlib.asynccontextmanager
async def pair(
    server: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[Any]],
) -> AsyncIterator[tuple[Streams, asyncio.Future[Any]]]:
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            done.set_result(await server(reader, writer))
        except Exception as exc:
            done.set_exception(exc)
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield (reader, writer), done
    finally:
        writer.close()
        srv.close()


def accepting(key: bytes) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[Session]]:
    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Session:
        session = await peerauth.accept(reader, writer, key, 5.0)
        got = await session.recv(reader, 5.0)  # one sealed request, one sealed reply
        await session.send(writer, {"echo": got}, 5.0)
        return session

    return server


async def test_both_sides_prove_the_key_and_frames_are_sealed() -> None:
    async with pair(accepting(KEY)) as ((reader, writer), server):
        session = await peerauth.connect(reader, writer, KEY, 5.0)
        await session.send(writer, {"op": "fetch", "step": 3}, 5.0)
        assert await session.recv(reader, 5.0) == {"echo": {"op": "fetch", "step": 3}}
        theirs = await server
        assert theirs.key == session.key and theirs.client is not session.client


@pytest.mark.parametrize(("client_key", "server_key"), [(b"w" * 32, KEY), (KEY, b"w" * 32)])
async def test_a_wrong_key_on_either_side_is_refused(client_key: bytes, server_key: bytes) -> None:
    async with pair(accepting(server_key)) as ((reader, writer), server):
        with pytest.raises(AuthError, match="the keeper reached does not know the keeper key"):
            await peerauth.connect(reader, writer, client_key, 5.0)
        writer.close()
        with pytest.raises(wire.WireError):  # the client went away: the server has no session
            await server


async def test_a_client_that_cannot_prove_the_key_is_refused() -> None:
    async with pair(accepting(KEY)) as ((reader, writer), server):
        await wire.write_frame(writer, {"op": "hello", "v": 1, "nonce": b"n" * 32})
        await wire.read_frame(reader)  # the server's nonce and proof: useless without the key
        await wire.write_frame(writer, {"proof": b"p" * 32})
        with pytest.raises(AuthError, match="the peer does not know the keeper key"):
            await server


async def test_a_replayed_handshake_is_refused() -> None:
    recorded = b""
    async with pair(accepting(KEY)) as ((reader, writer), server):
        tap = Recorder(writer)
        session = await peerauth.connect(reader, tap, KEY, 5.0)  # type: ignore[arg-type]
        await session.send(tap, {"op": "fetch", "step": 3}, 5.0)  # type: ignore[arg-type]
        await session.recv(reader, 5.0)
        await server
        recorded = tap.sent
    async with pair(accepting(KEY)) as ((reader, writer), server):
        writer.write(recorded)  # the whole conversation again: hello, proof, request
        await writer.drain()
        with pytest.raises(AuthError, match="the peer does not know the keeper key"):
            await server


def test_a_sealed_frame_cannot_be_forged_replayed_or_moved() -> None:
    a, b = Session(b"s" * 32, client=True), Session(b"s" * 32, client=False)
    frame = a.seal({"op": "fetch", "job": "j1", "step": 3})
    assert b.open(frame) == {"op": "fetch", "job": "j1", "step": 3}
    with pytest.raises(AuthError, match="forged, replayed or out of order"):
        b.open(frame)  # the same frame again
    other = Session(b"t" * 32, client=False)
    with pytest.raises(AuthError, match="forged, replayed or out of order"):
        other.open(a.seal({"op": "fetch"}))  # sealed for another session
    body = bytearray(a.seal({"op": "fetch", "job": "j1"})["b"])
    body[-1] ^= 1
    with pytest.raises(AuthError):
        b.open({"b": bytes(body), "t": b"x" * 32})
    with pytest.raises(AuthError, match="without its seal"):
        b.open({"op": "fetch"})
    reflected = b.seal({"ok": True})  # the server's own frame sent back to it
    with pytest.raises(AuthError):
        Session(b"s" * 32, client=False, received=1).open(reflected)


async def test_a_big_frame_before_authentication_is_refused_unread() -> None:
    async with pair(accepting(KEY)) as ((_reader, writer), server):
        writer.write(struct.pack(">I", peerauth.HELLO_MAX + 1))
        await writer.drain()
        with pytest.raises(wire.WireError, match=f"over {peerauth.HELLO_MAX}"):
            await server


async def test_a_silent_peer_is_dropped_after_the_timeout() -> None:
    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Session:
        return await peerauth.accept(reader, writer, KEY, 0.2)

    async with pair(server) as (_streams, done):
        with pytest.raises(TimeoutError):
            await done


@pytest.mark.parametrize("key", [b"", b"short"])
def test_a_short_key_is_refused(key: bytes) -> None:
    with pytest.raises(ValueError, match="needs at least 32"):
        peerauth.check_key(key)

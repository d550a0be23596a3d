"""The keeper's TCP (and Unix socket) protocol: checkpoint bytes never go through NATS.

Every message is a frame: a 4-byte big-endian length and a msgpack map, then,
when the map says so, raw file bytes in the manifest's file order. Peers
authenticate each other first (:mod:`phalanx.checkpoint.peerauth`), then
replicate to each other (``replicate``: a manifest and its files, answered
after the digests are verified) and fetch from each other (``fetch``); a
rank asks its own keeper over the node's Unix socket (``list``, ``load``,
``register``, ``skipped``). A frame over its bound (:data:`MAX_FRAME`, far
less before authentication) or that is not a map is refused before anything
is allocated for it.

Every read from a peer is bounded in time: a frame by ``timeout_s``, file bytes
by a :class:`Deadline` (a per-read timeout, and an end for the whole transfer
computed from its size and a minimum rate), so a peer that stops sending, or
trickles, is dropped.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

import msgpack

MAX_FRAME = 16 << 20
_LEN = struct.Struct(">I")
PIECE = 8 << 20


class WireError(RuntimeError):
    """The other side sent something that is not the protocol, or said no."""


class FrameTooLarge(WireError):
    """A frame announced more bytes than the reader takes (refused before reading them)."""


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError(f"frame is not msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError(f"frame is a {type(obj).__name__}, not a map")
    return obj


def encode_frame(obj: dict[str, Any]) -> bytes:
    raw = msgpack.packb(obj, use_bin_type=True)
    if len(raw) > MAX_FRAME:
        raise WireError(f"frame of {len(raw)} bytes is over {MAX_FRAME}")
    return _LEN.pack(len(raw)) + raw


@dataclass(frozen=True)
class Deadline:
    """How long a transfer of bytes may take: each read at most ``read_s``, the whole
    transfer until ``end`` (``time.monotonic()``)."""

    read_s: float
    end: float

    @classmethod
    def for_bytes(cls, nbytes: int, read_s: float, min_rate: float) -> Deadline:
        """A transfer of ``nbytes`` at no less than ``min_rate`` bytes/s on the whole."""
        return cls(read_s, time.monotonic() + read_s + nbytes / min_rate)

    def next_s(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the transfer is slower than the minimum rate: dropped")
        return min(self.read_s, left)


async def read_frame(
    reader: asyncio.StreamReader, *, timeout_s: float | None = None, max_bytes: int = MAX_FRAME
) -> dict[str, Any]:
    """One frame, within ``timeout_s`` (None: no bound)."""
    if timeout_s is None:
        return await _read_frame(reader, max_bytes)
    try:
        return await asyncio.wait_for(_read_frame(reader, max_bytes), timeout_s)
    except TimeoutError:
        raise TimeoutError(f"no whole frame within {timeout_s}s: dropped") from None


async def _read_frame(reader: asyncio.StreamReader, max_bytes: int) -> dict[str, Any]:
    try:
        (n,) = _LEN.unpack(await reader.readexactly(4))
    except asyncio.IncompleteReadError:
        raise WireError("connection closed before a frame") from None
    if n > max_bytes:
        raise FrameTooLarge(f"frame of {n} bytes announced, over {max_bytes}")
    try:
        return _decode(await reader.readexactly(n))
    except asyncio.IncompleteReadError:
        raise WireError("connection closed inside a frame") from None


async def write_frame(
    writer: asyncio.StreamWriter, obj: dict[str, Any], timeout_s: float | None = None
) -> None:
    writer.write(encode_frame(obj))
    await asyncio.wait_for(writer.drain(), timeout_s)


async def write_bytes(writer: asyncio.StreamWriter, data: memoryview, deadline: Deadline) -> None:
    for i in range(0, len(data), PIECE):
        writer.write(data[i : i + PIECE])
        await asyncio.wait_for(writer.drain(), deadline.next_s())


async def read_into(reader: asyncio.StreamReader, into: memoryview, deadline: Deadline) -> None:
    """Fill ``into`` from the stream (the caller allocated it from a checked size)."""
    at = 0
    while at < len(into):
        try:
            piece = await asyncio.wait_for(reader.read(min(PIECE, len(into) - at)), deadline.next_s())
        except TimeoutError:
            raise TimeoutError(f"no bytes in time after {at} of {len(into)}: dropped") from None
        if not piece:
            raise WireError(f"connection closed after {at} of {len(into)} bytes")
        into[at : at + len(piece)] = piece
        at += len(piece)


def checked(reply: dict[str, Any]) -> dict[str, Any]:
    if not reply.get("ok"):
        raise WireError(str(reply.get("error") or "refused without a reason"))
    return reply


# -- the blocking side (a training rank talking to its node's keeper) ------------------------
def call(path: str, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One request to the keeper listening on the Unix socket ``path``; its checked reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ConnectionError(
                f"no keeper answers at {path} ({exc.strerror}): is state-replication running on this node"
                " with the same PHALANX_NODE and --shm-root?"
            ) from None
        try:
            s.sendall(encode_frame(request))
        except (BrokenPipeError, ConnectionResetError) as exc:
            # The keeper refused before reading it all (too large, too many connections):
            # its reason is in the reply it sent before closing, if it got here.
            try:
                reply = recv_frame(s)
            except (OSError, WireError):
                raise ConnectionError(f"the keeper at {path} closed the connection ({exc})") from None
            return checked(reply)
        return checked(recv_frame(s))


def recv_frame(s: socket.socket) -> dict[str, Any]:
    """One frame from a blocking socket."""
    (n,) = _LEN.unpack(_recv_exactly(s, 4))
    if n > MAX_FRAME:
        raise WireError(f"frame of {n} bytes announced, over {MAX_FRAME}")
    return _decode(_recv_exactly(s, n))


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, at = memoryview(buf), 0
    while at < n:
        got = s.recv_into(view[at:], n - at)
        if not got:
            raise WireError(f"keeper closed the connection after {at} of {n} bytes")
        at += got
    return bytes(buf)

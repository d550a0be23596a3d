"""The keeper's TCP (and Unix socket) protocol: checkpoint bytes never go through NATS.

Every message is a frame: a 4-byte big-endian length and a msgpack map, then,
when the map says so, raw file bytes in the manifest's file order. Peers
replicate to each other (``replicate``: a manifest and its files, answered
after the checksums are verified) and fetch from each other (``fetch``); a
rank asks its own keeper over the node's Unix socket (``list``, ``load``,
``register``). A frame over :data:`MAX_FRAME` or that is not a map is refused
before anything is allocated for it.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgpack

MAX_FRAME = 16 << 20
_LEN = struct.Struct(">I")
PIECE = 8 << 20


class WireError(RuntimeError):
    """The other side sent something that is not the protocol, or said no."""


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


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    try:
        (n,) = _LEN.unpack(await reader.readexactly(4))
    except asyncio.IncompleteReadError:
        raise WireError("connection closed before a frame") from None
    if n > MAX_FRAME:
        raise WireError(f"frame of {n} bytes announced, over {MAX_FRAME}")
    try:
        return _decode(await reader.readexactly(n))
    except asyncio.IncompleteReadError:
        raise WireError("connection closed inside a frame") from None


async def write_frame(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    writer.write(encode_frame(obj))
    await writer.drain()


async def write_bytes(writer: asyncio.StreamWriter, data: memoryview) -> None:
    for i in range(0, len(data), PIECE):
        writer.write(data[i : i + PIECE])
        await writer.drain()


async def read_into(reader: asyncio.StreamReader, into: memoryview) -> None:
    """Fill ``into`` from the stream (the caller allocated it from a checked size)."""
    at = 0
    while at < len(into):
        piece = await reader.read(min(PIECE, len(into) - at))
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
        s.sendall(encode_frame(request))
        return checked(recv_frame(s))


def recv_frame(s: socket.socket) -> dict[str, Any]:
    """One frame from a blocking socket."""
    (n,) = _LEN.unpack(_recv_exactly(s, 4))
    if n > MAX_FRAME:
        raise WireError(f"frame of {n} bytes announced, over {MAX_FRAME}")
    return _decode(_recv_exactly(s, n))


def recv_into(s: socket.socket, into: memoryview) -> None:
    """Fill ``into`` from a blocking socket, straight from the kernel (no buffer between)."""
    at = 0
    while at < len(into):
        got = s.recv_into(into[at : at + PIECE])
        if not got:
            raise WireError(f"connection closed after {at} of {len(into)} bytes")
        at += got


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, at = memoryview(buf), 0
    while at < n:
        got = s.recv_into(view[at:], n - at)
        if not got:
            raise WireError(f"keeper closed the connection after {at} of {n} bytes")
        at += got
    return bytes(buf)

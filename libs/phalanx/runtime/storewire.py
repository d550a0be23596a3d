"""The rendezvous store's wire: frames, requests, and the handshake that keeps non-members out.

A frame is a 4-byte big-endian length and a msgpack body, at most :data:`MAX_FRAME`
bytes. The server speaks first (:func:`hello`: a fresh 16-byte nonce); then every frame
of the client is a request ``[op, *args]`` and every frame of the server the answer
``[status, value]`` (:data:`OK`, :data:`TIMEOUT` or :data:`ERROR` with a message).

A generation's members share one secret (the plan's ``store_secret``, which only the
job's users and the services read). A client proves it for the generation it wants
(``auth``): it names the generation by :func:`space_id` (a hash, never the secret)
and answers the server's nonce with :func:`proof`; the server, told the secret by its
launcher, checks the proof and answers with one of its own (the client knows it talks
to the store, not to whoever took its address) and a slot number. Every later request
names that slot and a key *inside* the generation: the secret never crosses the wire,
and a connection sees only the generations it proved. No request lists keys.

This module imports no torch: the store process (:mod:`phalanx.runtime.storeserver`)
runs without it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
from typing import Any

import msgpack

MAGIC = "phalanx-store/1"
MAX_FRAME = 2 * 1024 * 1024
"""The largest frame either side sends or reads: a value (at most :data:`MAX_VALUE`)
and its key with room to spare."""
MAX_VALUE = 1024 * 1024
"""The largest value a key may hold: gloo's bootstrap keys are an address and 8 bytes a
peer, NCCL's unique id 128 bytes."""
MAX_KEY = 1024
MAX_KEYS_PER_REQUEST = 65536

OK, TIMEOUT, ERROR = "ok", "timeout", "error"
AUTH, SET, GET, ADD, CAS, DELETE, CHECK, WAIT = "auth", "set", "get", "add", "cas", "delete", "check", "wait"

_HEADER = struct.Struct(">I")


class WireError(ConnectionError):
    """The other side broke the protocol, or the connection ended."""


def space_id(secret: str) -> bytes:
    """The name of a generation's key space on the wire: a hash of its secret."""
    return hashlib.sha256(f"{MAGIC}/space/{secret}".encode()).digest()[:16]


def proof(secret: str, side: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What ``side`` ("client" or "server") sends to show it holds ``secret``."""
    message = f"{MAGIC}/{side}".encode() + server_nonce + client_nonce
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def nonce() -> bytes:
    return secrets.token_bytes(16)


def hello(server_nonce: bytes) -> list[Any]:
    return [MAGIC, server_nonce]


def pack(body: Any) -> bytes:
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > MAX_FRAME:
        raise ValueError(f"a store frame of {len(data)} bytes (at most {MAX_FRAME})")
    return _HEADER.pack(len(data)) + data


def frame_length(header: bytes) -> int:
    (n,) = _HEADER.unpack(header)
    if n > MAX_FRAME:
        raise WireError(f"a frame of {n} bytes announced (at most {MAX_FRAME})")
    return n


def unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several kinds on malformed input
        raise WireError(f"a malformed frame: {exc}") from None


def send(sock: socket.socket, body: Any) -> None:
    sock.sendall(pack(body))


def receive(sock: socket.socket) -> Any:
    """One frame from a blocking socket (its own timeout applies to each read)."""
    return unpack(_read(sock, frame_length(_read(sock, _HEADER.size))))


def _read(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise WireError("the store closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


HEADER_SIZE = _HEADER.size

"""Who may talk to a keeper over TCP: keepers that know the cluster's keeper key.

**Why a per-cluster key and not mutual TLS.** Every keeper of a deployment is
the same service with the same rights (hold, replicate and serve checkpoints of
every job), so one secret shared by them says all there is to say about a peer;
it is one Kubernetes Secret or one file to provision and rotate, needs no CA,
no certificate per node and no renewal, and costs nothing on the data path.
What it does not give, and TLS would, is confidentiality: checkpoint bytes
cross the network in clear. A deployment whose weights are secret from the
cluster network runs keepers on an encrypted network (WireGuard/IPsec, a
service mesh) -- see the README's security model.

The key is ``PHALANX_KEEPER_KEY`` or the file ``PHALANX_KEEPER_KEY_FILE``, at
least :data:`MIN_KEY_BYTES` bytes; a keeper without one refuses to start, on
loopback too (a test or a one-machine stack makes one: ``LocalStack`` does).

**Handshake** (C connects, S listens, K the key, every frame at most
:data:`HELLO_MAX` bytes, within ``timeout_s``; no thread is used before it)::

    C -> S  {"op": "hello", "v": 1, "nonce": Nc}          Nc, Ns: 32 random bytes each
    S -> C  {"nonce": Ns, "proof": HMAC(K, "server" Nc Ns)}
    C -> S  {"proof": HMAC(K, "client" Nc Ns)}

Each side checks the other's proof with :func:`hmac.compare_digest`; the labels
keep one side's proof from being reflected as the other's, and the nonce each
side picked keeps a recorded handshake from being replayed. The session key is
``HMAC(K, "session" Nc Ns)``: every later control frame is sealed with it and a
per-direction sequence number (:class:`Session`), so a frame cannot be forged,
replayed, reordered or moved to another connection, and a connection taken over
after the handshake cannot ask for anything. File bytes are not sealed: both
ends check them against the digests of the manifest committed in the catalog,
which an on-path attacker cannot change either (the catalog is NATS, with its
own authentication).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

import phalanx.checkpoint.wire as wire
from phalanx.settings import KeeperSettings, SettingsError

MIN_KEY_BYTES = 32
HELLO_MAX = 1024  # bytes in a frame before the peer is authenticated
_NONCE = 32
_SEQ = struct.Struct(">Q")


class AuthError(wire.WireError):
    """The other side does not know the key, or broke the handshake."""


def load_key(settings: KeeperSettings) -> bytes:
    """The keeper key from ``PHALANX_KEEPER_KEY`` or ``PHALANX_KEEPER_KEY_FILE``;
    :class:`SettingsError` naming what to set when there is none or it is short."""
    if settings.keeper_key is not None and settings.keeper_key_file is not None:
        raise SettingsError("bad setting: set PHALANX_KEEPER_KEY or PHALANX_KEEPER_KEY_FILE, not both")
    if settings.keeper_key_file is not None:
        try:
            key = settings.keeper_key_file.read_bytes().strip()
        except OSError as exc:
            raise SettingsError(
                f"bad setting: PHALANX_KEEPER_KEY_FILE={str(settings.keeper_key_file)!r}: {exc.strerror}"
            ) from None
        where = "PHALANX_KEEPER_KEY_FILE"
    elif settings.keeper_key is not None:
        key, where = settings.keeper_key.get_secret_value().encode(), "PHALANX_KEEPER_KEY"
    else:
        raise SettingsError(
            "bad setting: a keeper needs the cluster's keeper key (PHALANX_KEEPER_KEY or"
            f" PHALANX_KEEPER_KEY_FILE, at least {MIN_KEY_BYTES} bytes, the same on every node):"
            " its peers prove they know it before it serves or accepts any checkpoint"
        )
    check_key(key, where)
    return key


def check_key(key: bytes, where: str = "the keeper key") -> None:
    if len(key) < MIN_KEY_BYTES:
        raise SettingsError(f"bad setting: {where} has {len(key)} bytes, needs at least {MIN_KEY_BYTES}")


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


@dataclass
class Session:
    """An authenticated connection: control frames sealed with the session key."""

    key: bytes
    client: bool
    peer: str = ""
    sent: int = field(default=0)
    received: int = field(default=0)

    def _label(self, outgoing: bool) -> bytes:
        return b"c>s" if outgoing == self.client else b"s>c"

    def seal(self, obj: dict[str, Any]) -> dict[str, Any]:
        body = msgpack.packb(obj, use_bin_type=True)
        tag = _mac(self.key, self._label(True), _SEQ.pack(self.sent), body)
        self.sent += 1
        return {"b": body, "t": tag}

    def open(self, frame: dict[str, Any]) -> dict[str, Any]:
        body, tag = frame.get("b"), frame.get("t")
        if not isinstance(body, bytes) or not isinstance(tag, bytes):
            raise AuthError("a frame without its seal")
        want = _mac(self.key, self._label(False), _SEQ.pack(self.received), body)
        if not hmac.compare_digest(want, tag):
            raise AuthError("a frame whose seal does not match (forged, replayed or out of order)")
        self.received += 1
        return wire._decode(body)

    async def send(self, writer: asyncio.StreamWriter, obj: dict[str, Any], timeout_s: float) -> None:
        await wire.write_frame(writer, self.seal(obj), timeout_s)

    async def recv(self, reader: asyncio.StreamReader, timeout_s: float) -> dict[str, Any]:
        return self.open(await wire.read_frame(reader, timeout_s=timeout_s))


def _nonce(frame: dict[str, Any]) -> bytes:
    nonce = frame.get("nonce")
    if not isinstance(nonce, bytes) or len(nonce) != _NONCE:
        raise AuthError("the handshake has no nonce")
    return nonce


def _proof(frame: dict[str, Any]) -> bytes:
    proof = frame.get("proof")
    if not isinstance(proof, bytes):
        raise AuthError("the handshake has no proof")
    return proof


async def accept(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes, timeout_s: float
) -> Session:
    """The listening side's handshake: the peer proved it knows ``key``, or
    :class:`AuthError` / :class:`~phalanx.checkpoint.wire.WireError` / TimeoutError."""
    async with asyncio.timeout(timeout_s):
        hello = await wire.read_frame(reader, max_bytes=HELLO_MAX)
        if hello.get("op") != "hello" or hello.get("v") != 1:
            raise AuthError(f"expected a hello, got op {str(hello.get('op'))[:40]!r}")
        theirs, ours = _nonce(hello), os.urandom(_NONCE)
        await wire.write_frame(writer, {"nonce": ours, "proof": _mac(key, b"server", theirs, ours)})
        answer = await wire.read_frame(reader, max_bytes=HELLO_MAX)
        if not hmac.compare_digest(_proof(answer), _mac(key, b"client", theirs, ours)):
            raise AuthError("the peer does not know the keeper key")
    return Session(_mac(key, b"session", theirs, ours), client=False)


async def connect(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes, timeout_s: float
) -> Session:
    """The connecting side's handshake: the keeper it reached proved it knows ``key``."""
    async with asyncio.timeout(timeout_s):
        ours = os.urandom(_NONCE)
        await wire.write_frame(writer, {"op": "hello", "v": 1, "nonce": ours})
        reply = await wire.read_frame(reader, max_bytes=HELLO_MAX)
        if "error" in reply:
            raise AuthError(f"refused: {str(reply['error'])[:200]}")
        theirs = _nonce(reply)
        if not hmac.compare_digest(_proof(reply), _mac(key, b"server", ours, theirs)):
            raise AuthError("the keeper reached does not know the keeper key")
        await wire.write_frame(writer, {"proof": _mac(key, b"client", ours, theirs)})
    return Session(_mac(key, b"session", ours, theirs), client=True)

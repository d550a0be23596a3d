"""msgpack encoding of bus messages, tagged in headers.

Headers carry ``Phalanx-Kind``, ``Phalanx-Schema`` (version) and
``Phalanx-Encoding`` (``msgpack``), so the receiver can refuse a message before
it parses the payload. Every failure to decode is a :class:`DecodeError`:

>>> from phalanx.contract import Ping
>>> data, headers = encode(Ping(ts=1.0))
>>> decode(data, headers)
Ping(ts=1.0)
>>> decode(b"\\xc1", headers)
Traceback (most recent call last):
...
phalanx.contract.codec.DecodeError: malformed msgpack payload for 'ping': ...
"""

from __future__ import annotations

import zlib
from typing import TypeVar, overload

import msgpack
from pydantic import ValidationError

from phalanx.contract._base import Message, message_class

__all__ = [
    "HDR_ENCODING",
    "HDR_KIND",
    "HDR_SCHEMA",
    "DecodeError",
    "decode",
    "decode_map",
    "encode",
    "headers_for",
]

HDR_KIND = "Phalanx-Kind"
HDR_SCHEMA = "Phalanx-Schema"
HDR_ENCODING = "Phalanx-Encoding"
ENCODING = "msgpack"
ENCODING_ZLIB = "msgpack+zlib"
MAX_INFLATED = 64 << 20
"""The most a compressed payload may inflate to: a few KB on the wire must never become
gigabytes in a receiver (a record of 100,000 ranks inflates to a few MB)."""

M = TypeVar("M", bound=Message)


class DecodeError(ValueError):
    """A message that cannot be turned into a known, valid model."""

    def __init__(self, reason: str, kind: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


def headers_for(cls: type[Message]) -> dict[str, str]:
    """The headers a ``cls`` message carries; for payloads stored without them (KV)."""
    encoding = ENCODING_ZLIB if cls.COMPRESSED else ENCODING
    return {HDR_KIND: cls.KIND, HDR_SCHEMA: str(cls.SCHEMA_VERSION), HDR_ENCODING: encoding}


def encode(msg: Message) -> tuple[bytes, dict[str, str]]:
    payload = msgpack.packb(msg.model_dump(mode="json"), use_bin_type=True)
    if type(msg).COMPRESSED:
        payload = zlib.compress(payload, 6)
    return payload, headers_for(type(msg))


def _inflate(data: bytes, kind: str) -> bytes:
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, MAX_INFLATED)
    except zlib.error as exc:
        raise DecodeError(f"malformed zlib payload for {kind!r}: {exc}", kind) from exc
    if inflater.unconsumed_tail:
        raise DecodeError(f"payload of {kind!r} inflates past {MAX_INFLATED} bytes", kind)
    if not inflater.eof:
        raise DecodeError(f"truncated zlib payload for {kind!r}", kind)
    return out


@overload
def decode(data: bytes, headers: dict[str, str] | None) -> Message: ...
@overload
def decode(data: bytes, headers: dict[str, str] | None, expected: type[M]) -> M: ...
def decode(data: bytes, headers: dict[str, str] | None, expected: type[Message] | None = None) -> Message:
    """Decode a payload; raises :class:`DecodeError` for anything but a valid message."""
    cls, obj = decode_map(data, headers, expected)
    try:
        return cls.model_validate(obj)
    except ValidationError as exc:
        errs = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()
        )
        raise DecodeError(f"invalid {cls.KIND!r}: {errs}", cls.KIND) from exc


def decode_map(
    data: bytes, headers: dict[str, str] | None, expected: type[Message] | None = None
) -> tuple[type[Message], dict[str, object]]:
    """The payload's class and its map, checked for kind, version and encoding but not yet
    validated as the model: for a reader that needs one part of a large message (a
    launcher's node out of a 16k-rank record) and validates that part itself."""
    headers = headers or {}
    kind = headers.get(HDR_KIND)
    if kind is None:
        raise DecodeError(f"missing {HDR_KIND} header")
    cls = message_class(kind)
    if cls is None:
        raise DecodeError(f"unknown message kind {kind!r}", kind)
    if expected is not None and cls is not expected:
        raise DecodeError(f"expected {expected.KIND!r}, got {kind!r}", kind)
    encoding = headers.get(HDR_ENCODING, ENCODING)
    if encoding not in (ENCODING, ENCODING_ZLIB):
        raise DecodeError(f"unsupported encoding {encoding!r} for {kind!r}", kind)
    version = headers.get(HDR_SCHEMA)
    if version != str(cls.SCHEMA_VERSION):
        raise DecodeError(
            f"schema version {version!r} of {kind!r} not understood (this side speaks {cls.SCHEMA_VERSION})",
            kind,
        )
    if encoding == ENCODING_ZLIB:
        data = _inflate(data, kind)
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"malformed msgpack payload for {kind!r}: {exc!r}", kind) from exc
    if not isinstance(obj, dict):
        raise DecodeError(f"payload of {kind!r} is {type(obj).__name__}, not a map", kind)
    return cls, obj

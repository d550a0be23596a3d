"""Moving training state between ranks over the data plane, never through NATS.

:func:`send_state` / :func:`recv_state` move a state packed by
:func:`phalanx.checkpoint.packing.pack` (one contiguous byte buffer plus a small
msgpack description) over a generation's communicator, each message under the
bound the caller gives (a state transfer is one of recovery's collectives).

Nothing a peer sends is unpickled, and nothing is allocated from a size that
has not been checked. On the wire a state is three messages:

* a 32-byte header: magic ``PHXS``, format version (2), flags, metadata length
  (1 to 64 MiB), buffer length (0 to ``PHALANX_STATE_MAX_BYTES``, 64 GiB by
  default, a multiple of 16), CRC32 of the metadata, checksum of the buffer.
  Flags: bit 0 says which checksum the buffer's is (0: CRC32, 1: ``wsum31``);
  every other bit must be 0;
* the metadata (:mod:`phalanx.checkpoint.packing` describes it);
* the buffer.

Header and metadata travel as CPU tensors (gloo); the buffer travels on the
communicator's device (NCCL for cuda), and the receiver allocates it there.

The receiver checks the header before it allocates the metadata, and the whole
metadata (:func:`phalanx.checkpoint.packing.read_meta`) before it allocates the
buffer. Any violation is a :class:`StateTransferError`.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, NamedTuple, Protocol

import torch

from phalanx.checkpoint.packing import (
    ALIGN,
    CHECKSUM_KINDS,
    CRC32,
    MAX_META_BYTES,
    VERSION,
    WSUM31,
    StateTransferError,
    build,
    checksum,
    default_checksum_kind,
    read_meta,
)
from phalanx.settings import RankSettings, load

__all__ = [
    "MAX_BUFFER_BYTES_ENV",
    "Link",
    "StateTransferError",
    "max_buffer_bytes",
    "recv_state",
    "send_state",
]

_TAG_HEADER, _TAG_META, _TAG_BUF = 101, 102, 103
_MAGIC = b"PHXS"
# magic, version, flags, meta length, buffer length, meta CRC32, buffer checksum (little-endian)
_HEADER = struct.Struct("<4sHHqqII")
_FLAG_WSUM31 = 0x1  # header flags bit 0: the buffer's checksum is WSUM31 (else CRC32)
_KNOWN_FLAGS = _FLAG_WSUM31
MAX_BUFFER_BYTES_ENV = "PHALANX_STATE_MAX_BYTES"


def max_buffer_bytes() -> int:
    """The largest state buffer :func:`recv_state` accepts: ``PHALANX_STATE_MAX_BYTES``,
    else 64 GiB."""
    return load(RankSettings).state_max_bytes


class Link(Protocol):
    """Point-to-point messages between two members of a generation, each under a
    bound (:class:`phalanx.runtime.comm.Communicator` is one)."""

    @property
    def device(self) -> torch.device: ...

    def send(self, t: torch.Tensor, dst: int, tag: int = 0, timeout_s: float | None = None) -> None: ...

    def recv(self, t: torch.Tensor, src: int, tag: int = 0, timeout_s: float | None = None) -> None: ...


# -- over a communicator ------------------------------------------------------------------------


class _Header(NamedTuple):
    meta_len: int
    buf_len: int
    meta_crc: int
    buf_crc: int
    kind: str  # which checksum buf_crc is


def _flags_for(kind: str) -> int:
    if kind not in CHECKSUM_KINDS:
        raise ValueError(f"unknown checksum kind {kind!r} (one of {CHECKSUM_KINDS})")
    return _FLAG_WSUM31 if kind == WSUM31 else 0


def _encode_header(
    meta_len: int, buf_len: int, meta_crc: int, buf_crc: int, kind: str = CRC32
) -> torch.Tensor:
    raw = _HEADER.pack(_MAGIC, VERSION, _flags_for(kind), meta_len, buf_len, meta_crc, buf_crc)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _parse_header(raw: bytes, max_bytes: int, src: int) -> _Header:
    """Check a header before anything it sizes is allocated."""
    if len(raw) != _HEADER.size:
        raise StateTransferError(f"state header from rank {src} is {len(raw)} bytes, not {_HEADER.size}")
    magic, version, flags, meta_len, buf_len, meta_crc, buf_crc = _HEADER.unpack(raw)
    if magic != _MAGIC:
        raise StateTransferError(f"not a state header from rank {src} (magic {magic!r})")
    if version != VERSION:
        raise StateTransferError(f"unsupported state format version {version} from rank {src}")
    if flags & ~_KNOWN_FLAGS:
        raise StateTransferError(f"unknown state header flags {flags:#x} from rank {src}")
    if not 1 <= meta_len <= MAX_META_BYTES:
        raise StateTransferError(
            f"state metadata length {meta_len} from rank {src} outside [1, {MAX_META_BYTES}]"
        )
    if not 0 <= buf_len <= max_bytes:
        raise StateTransferError(
            f"state buffer length {buf_len} from rank {src} outside [0, {max_bytes}] ({MAX_BUFFER_BYTES_ENV})"
        )
    if buf_len % ALIGN:
        raise StateTransferError(f"state buffer length {buf_len} from rank {src} not a multiple of {ALIGN}")
    kind = WSUM31 if flags & _FLAG_WSUM31 else CRC32
    return _Header(meta_len, buf_len, meta_crc, buf_crc, kind)


def send_state(
    comm: Link,
    meta: bytes,
    buf: torch.Tensor,
    crc: int,
    dst: int,
    kind: str | None = None,
    timeout_s: float | None = None,
) -> None:
    """Send ``pack``'s output with ``crc`` = ``checksum(buf, kind)``: header, metadata, buffer.

    ``timeout_s`` bounds each message (None: the communicator's backstop). ``kind`` defaults to :func:`default_checksum_kind` of ``buf``'s device, which is
    what ``checksum(buf)`` computes. Header and metadata go as CPU tensors (gloo);
    the buffer goes on ``comm.device`` (NCCL for cuda), copied there first if it
    was packed elsewhere.
    """
    kind = default_checksum_kind(buf.device) if kind is None else kind
    if not 1 <= len(meta) <= MAX_META_BYTES:
        raise StateTransferError(f"state metadata is {len(meta)} bytes, outside [1, {MAX_META_BYTES}]")
    header = _encode_header(len(meta), buf.numel(), zlib.crc32(meta), crc, kind)
    if buf.numel() and buf.device != comm.device:
        buf = buf.to(comm.device)  # the receiver's buffer is on its comm.device: same backend
    comm.send(header, dst, _TAG_HEADER, timeout_s)
    comm.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), dst, _TAG_META, timeout_s)
    if buf.numel():
        comm.send(buf, dst, _TAG_BUF, timeout_s)


def recv_state(
    comm: Link, src: int, max_bytes: int | None = None, timeout_s: float | None = None
) -> tuple[Any, int]:
    """Receive and verify a state; returns (state, bytes received). ``max_bytes`` bounds
    the buffer (default :func:`max_buffer_bytes`), ``timeout_s`` each message. The buffer is allocated on
    ``comm.device`` and verified there with the checksum kind the header names."""
    limit = max_buffer_bytes() if max_bytes is None else max_bytes
    raw = torch.zeros(_HEADER.size, dtype=torch.uint8)
    comm.recv(raw, src, _TAG_HEADER, timeout_s)
    head = _parse_header(raw.numpy().tobytes(), limit, src)
    meta_t = torch.empty(head.meta_len, dtype=torch.uint8)
    comm.recv(meta_t, src, _TAG_META, timeout_s)
    meta = meta_t.numpy().tobytes()
    got = zlib.crc32(meta)
    if got != head.meta_crc:
        raise StateTransferError(
            f"metadata checksum mismatch from rank {src}: sent {head.meta_crc:#x}, got {got:#x}"
        )
    layout = read_meta(meta, head.buf_len)
    buf = torch.empty(head.buf_len, dtype=torch.uint8, device=comm.device)
    if head.buf_len:
        comm.recv(buf, src, _TAG_BUF, timeout_s)
    got = checksum(buf, head.kind)
    if got != head.buf_crc:
        raise StateTransferError(f"checksum mismatch from rank {src}: sent {head.buf_crc:#x}, got {got:#x}")
    return build(layout, buf), head.buf_len

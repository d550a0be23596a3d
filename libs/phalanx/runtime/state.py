"""Moving training state between ranks over the data plane, never through NATS.

:func:`pack` turns any nest of dicts/lists/tuples holding tensors (a model's
and an optimizer's ``state_dict``, RNG states, the data position) into one
contiguous byte buffer plus a small structure description; :func:`unpack`
reverses it. :func:`send_state` / :func:`recv_state` move a packed state over a
generation's communicator with a CRC32 checked on arrival.

>>> meta, buf = pack({"w": torch.ones(2), "step": 7})
>>> unpack(meta, buf)["step"]
7
"""

from __future__ import annotations

import pickle
import zlib
from typing import Any

import torch

from phalanx.runtime.comm import Communicator

_TAG_HEADER, _TAG_META, _TAG_BUF = 101, 102, 103
_ALIGN = 16


class StateTransferError(RuntimeError):
    """State arrived corrupted or malformed; the receiver must not use it."""


class _TensorRef:
    __slots__ = ("dtype", "index", "shape")

    def __init__(self, index: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.index, self.dtype, self.shape = index, dtype, shape


def _same_mapping(like: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    """A mapping of ``like``'s type (an OrderedDict stays one) keeping its
    ``_metadata``, which ``load_state_dict`` reads for module versions."""
    out = type(like)(items) if type(like) is not dict else items
    meta = getattr(like, "_metadata", None)
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]
    return out


def pack(obj: Any) -> tuple[bytes, torch.Tensor]:
    tensors: list[torch.Tensor] = []

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            tensors.append(t)
            return _TensorRef(len(tensors) - 1, t.dtype, tuple(t.shape))
        if isinstance(o, dict):
            return _same_mapping(o, {k: walk(v) for k, v in o.items()})
        if isinstance(o, list):
            return [walk(v) for v in o]
        if isinstance(o, tuple):
            return tuple(walk(v) for v in o)
        return o

    skeleton = walk(obj)
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
    # Each tensor starts on a 16-byte boundary so that unpack can view it in place
    # as its dtype whatever came before it (an odd-sized uint8 tensor, say).
    offsets, end = [], 0
    for f in flat:
        offsets.append(end)
        end += (f.numel() + _ALIGN - 1) // _ALIGN * _ALIGN
    buf = torch.zeros(end, dtype=torch.uint8)
    for off, f in zip(offsets, flat, strict=True):
        buf[off : off + f.numel()] = f
    spans = [(off, f.numel()) for off, f in zip(offsets, flat, strict=True)]
    return pickle.dumps((skeleton, spans, end), protocol=pickle.HIGHEST_PROTOCOL), buf


def unpack(meta: bytes, buf: torch.Tensor) -> Any:
    skeleton, spans, total = pickle.loads(meta)
    if total != buf.numel():
        raise StateTransferError(f"buffer holds {buf.numel()} bytes, structure needs {total}")

    def walk(o: Any) -> Any:
        if isinstance(o, _TensorRef):
            off, n = spans[o.index]
            return buf[off : off + n].view(o.dtype).reshape(o.shape)
        if isinstance(o, dict):
            return _same_mapping(o, {k: walk(v) for k, v in o.items()})
        if isinstance(o, list):
            return [walk(v) for v in o]
        if isinstance(o, tuple):
            return tuple(walk(v) for v in o)
        return o

    return walk(skeleton)


def checksum(buf: torch.Tensor) -> int:
    return zlib.crc32(buf.numpy().data)


def send_state(comm: Communicator, meta: bytes, buf: torch.Tensor, crc: int, dst: int) -> None:
    header = torch.tensor([len(meta), buf.numel(), crc], dtype=torch.int64)
    comm.send(header, dst, _TAG_HEADER)
    comm.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), dst, _TAG_META)
    if buf.numel():
        comm.send(buf, dst, _TAG_BUF)


def recv_state(comm: Communicator, src: int) -> tuple[Any, int]:
    """Receive and verify a state; returns (state, bytes received)."""
    header = torch.zeros(3, dtype=torch.int64)
    comm.recv(header, src, _TAG_HEADER)
    meta_len, buf_len, crc = (int(x) for x in header.tolist())
    meta = torch.empty(meta_len, dtype=torch.uint8)
    comm.recv(meta, src, _TAG_META)
    buf = torch.empty(buf_len, dtype=torch.uint8)
    if buf_len:
        comm.recv(buf, src, _TAG_BUF)
    got = checksum(buf)
    if got != crc:
        raise StateTransferError(f"checksum mismatch from rank {src}: sent {crc:#x}, got {got:#x}")
    return unpack(meta.numpy().tobytes(), buf), buf_len

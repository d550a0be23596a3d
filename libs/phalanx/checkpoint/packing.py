"""State dicts as one flat byte buffer and back: the packing shared by state
transfer between ranks (:mod:`phalanx.runtime.state`) and snapshots
(:mod:`phalanx.checkpoint.client`, :mod:`phalanx.checkpoint.slots`).

It lives in the checkpoint package, below the rank runtime, because it is the
format of what a checkpoint stores (a snapshot slot holds ``meta`` and the
buffer as they are): the runtime sends the same bytes over a communicator, and
checkpoint code never has to import the runtime to read them back.

:func:`pack` turns a nest of containers holding tensors (a model's and an
optimizer's ``state_dict``, RNG states, the data position) into one contiguous
byte buffer plus a small msgpack description; :func:`unpack` reverses it, the
tensors coming back as zero-copy views into the buffer.

Devices: ``pack(obj, device)`` builds the buffer on ``device`` (default cpu);
on a GPU, tensors already there are copied into it on the device, never through
host memory. Each tensor keeps its device *type* across the round trip: one
that was on the CPU at the sender (the RNG state, Adam's ``step``) comes back
on the CPU (copied out of a device buffer, all such tensors in one transfer);
one that was on an accelerator comes back as a view into the receiver's buffer,
on that buffer's device. :func:`checksum` is CRC32 for a CPU buffer and, for a
device buffer, a weighted sum computed on the device (``wsum31``, see there),
so verifying never copies the buffer to the host.

The metadata is a msgpack map ``{"v": 2, "size": buffer bytes, "tensors":
[[dtype name, shape, offset, nbytes, host], ...], "tree": node}``. ``host`` (a
bool) is true for a tensor that was on the CPU at the sender. Tensors lie in
table order, each on a 16-byte boundary; dtypes come from a fixed allow-list.
A tree node is None, a bool, int, float, str or bytes, or a tagged list:
``["list", items]``, ``["tuple", items]``, ``["dict", keys, values]``,
``["odict", keys, values, _metadata node or None]``, ``["tensor", index]``,
``["dtype", name]``, ``["size", dims]`` or ``["device", name]``; dict keys are
str or int.

Nothing read back is unpickled, and nothing is allocated from a size that has
not been checked: :func:`read_meta` checks the whole metadata (every span inside
the buffer and matching its dtype and shape, depth, counts, references) before
a buffer is allocated, and :func:`build` makes the views. Any violation is a
:class:`StateTransferError`; :func:`pack` refuses a value it cannot represent
with a ``TypeError`` naming where it sits (``optimizer.state.3.step``).

>>> meta, buf = pack({"w": torch.ones(2), "step": 7})
>>> unpack(meta, buf)["step"]
7
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

__all__ = [
    "ALIGN",
    "CHECKSUM_KINDS",
    "CRC32",
    "MAX_DEPTH",
    "MAX_META_BYTES",
    "MAX_TENSORS",
    "VERSION",
    "WSUM31",
    "Description",
    "Packing",
    "StateTransferError",
    "build",
    "checksum",
    "default_checksum_kind",
    "pack",
    "read_meta",
    "tensor_bytes",
    "unpack",
]

ALIGN = 16
"""Every tensor starts on a 16-byte boundary of the buffer, whose length is a multiple of it."""
VERSION = 2
"""The format version, in the metadata (``"v"``) and in a state transfer's header."""

CRC32 = "crc32"  # zlib.crc32 of the bytes, on the host
WSUM31 = "wsum31"  # weighted sum of 4-byte words mod 2**31 - 1, on the buffer's device
CHECKSUM_KINDS = (CRC32, WSUM31)
_P31 = (1 << 31) - 1  # a Mersenne prime
_WSUM_CHUNK = 1 << 22  # 4-byte words per step (bounds temporaries to ~64 MiB); divides 2**30

MAX_META_BYTES = 64 << 20
MAX_TENSORS = 1 << 20
MAX_DEPTH = 64
_MAX_DIMS = 64
_MAX_DEVICE_NAME = 64
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what msgpack can carry

_DTYPES: dict[str, torch.dtype] = {
    name: dt
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if isinstance(dt := getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {dt: name for name, dt in _DTYPES.items()}


class StateTransferError(RuntimeError):
    """State arrived corrupted or malformed; the receiver must not use it."""


def _at(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _where(path: str) -> str:
    return f"at {path!r}" if path else "at the top level"


# -- pack ----------------------------------------------------------------------------------------


def pack(obj: Any, device: torch.device | None = None) -> tuple[bytes, torch.Tensor]:
    """``obj`` as (msgpack metadata, one aligned uint8 buffer holding every tensor).

    The buffer lives on ``device`` (default cpu). On a GPU, tensors are copied into
    it where they are (device to device; CPU tensors from the host), and the
    metadata records which were CPU tensors so that :func:`unpack` returns them
    on the CPU.
    """
    target = torch.device("cpu") if device is None else torch.device(device)
    layout = Packing.of(obj, target)
    buf = torch.zeros(layout.size, dtype=torch.uint8, device=target)
    layout.copy_into(buf)
    return layout.meta, buf


@dataclass(frozen=True)
class Packing:
    """Where each tensor of a state goes in its buffer, before any byte is copied.

    :func:`pack` allocates a buffer and fills it; a caller with a buffer of its
    own (a reused shared-memory snapshot slot) calls :meth:`copy_into` instead,
    so that taking a snapshot is one copy and no allocation.
    """

    meta: bytes
    size: int
    tensors: list[torch.Tensor]  # flat uint8 views of the state's tensors
    offsets: list[int]

    @classmethod
    def of(cls, obj: Any, target: torch.device) -> Packing:
        return _layout(obj, target)

    def copy_into(self, buf: torch.Tensor) -> None:
        """Copy every tensor to its offset in ``buf`` (uint8, at least :attr:`size` long)."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < self.size:
            raise ValueError(f"need a 1-d uint8 buffer of at least {self.size} bytes, got {tuple(buf.shape)}")
        for off, f in zip(self.offsets, self.tensors, strict=True):
            buf[off : off + f.numel()].copy_(f)  # on a GPU buffer: device to device where it can


def _layout(obj: Any, target: torch.device) -> Packing:
    staged = target.type == "cpu"  # a host buffer: every tensor goes through host memory
    tensors: list[torch.Tensor] = []
    hosts: list[bool] = []

    def refuse(path: str, what: str) -> TypeError:
        return TypeError(f"cannot pack {what} {_where(path)}")

    def key(k: Any, path: str) -> str | int:
        if type(k) is str:
            return text(k, path)
        if type(k) is int and _INT_MIN <= k <= _INT_MAX:
            return k
        raise refuse(path, f"dict key {k!r} of type {type(k).__name__} (keys are str or int)")

    def text(s: str, path: str) -> str:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise refuse(path, "a str that is not valid UTF-8") from None
        return s

    def walk(o: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise StateTransferError(f"state nested deeper than {MAX_DEPTH} levels {_where(path)}")
        t = type(o)
        if o is None or t is bool or t is float or t is bytes:
            return o
        if t is str:
            return text(o, path)
        if t is int:
            if not _INT_MIN <= o <= _INT_MAX:
                raise refuse(path, f"int {o} (outside [-2**63, 2**64))")
            return o
        if isinstance(o, torch.Tensor):
            name = _DTYPE_NAMES.get(o.dtype)
            if name is None:
                raise refuse(path, f"a tensor of dtype {o.dtype}")
            if o.layout is not torch.strided or o.device.type == "meta":
                raise refuse(path, f"a {o.layout} tensor on {o.device}")
            if len(tensors) >= MAX_TENSORS:
                raise StateTransferError(f"state holds more than {MAX_TENSORS} tensors")
            d = o.detach()
            hosts.append(d.device.type == "cpu")
            if staged:
                d = d.cpu()
            tensors.append(d.resolve_conj().resolve_neg().contiguous())
            return ["tensor", len(tensors) - 1]
        if t is torch.Size:
            return ["size", list(o)]
        if t is list or t is tuple:
            items = [walk(v, _at(path, i), depth + 1) for i, v in enumerate(o)]
            return ["list" if t is list else "tuple", items]
        if t is dict or t is OrderedDict:
            keys = [key(k, path) for k in o]
            values = [walk(v, _at(path, k), depth + 1) for k, v in o.items()]
            if t is dict:
                return ["dict", keys, values]
            md = getattr(o, "_metadata", None)
            md_node = None if md is None else walk(md, _at(path, "_metadata"), depth + 1)
            return ["odict", keys, values, md_node]
        if t is torch.dtype:
            if o not in _DTYPE_NAMES:
                raise refuse(path, f"dtype {o}")
            return ["dtype", _DTYPE_NAMES[o]]
        if t is torch.device:
            return ["device", str(o)]
        raise refuse(path, f"a value of type {t.__module__}.{t.__qualname__}")

    tree = walk(obj, "", 0)
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
    # Each tensor starts on a 16-byte boundary so that unpack can view it in place
    # as its dtype whatever came before it (an odd-sized uint8 tensor, say).
    table: list[list[Any]] = []
    offsets, end = [], 0
    for t, f, host in zip(tensors, flat, hosts, strict=True):
        table.append([_DTYPE_NAMES[t.dtype], list(t.shape), end, f.numel(), host])
        offsets.append(end)
        end += _aligned(f.numel())
    meta = msgpack.packb({"v": VERSION, "size": end, "tensors": table, "tree": tree}, use_bin_type=True)
    if len(meta) > MAX_META_BYTES:
        raise StateTransferError(f"state metadata is {len(meta)} bytes, over {MAX_META_BYTES}")
    return Packing(meta, end, flat, offsets)


def tensor_bytes(obj: Any, depth: int = 0) -> int:
    """The bytes of the tensors in ``obj`` (about what :func:`pack` makes of it),
    found without copying any; what it cannot walk (or nests deeper than
    :data:`MAX_DEPTH`) counts for nothing."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if depth >= MAX_DEPTH:
        return 0
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v, depth + 1) for v in obj)
    return 0


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# -- unpack: check everything, then build ---------------------------------------------------------


@dataclass(frozen=True)
class _Span:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    host: bool  # a CPU tensor at the sender: comes back on the CPU


@dataclass(frozen=True)
class Description:
    spans: list[_Span]
    tree: Any


def _is_int(x: object) -> bool:
    return type(x) is int


def read_meta(meta: bytes, size: int) -> Description:
    """Parse and check metadata describing a ``size``-byte buffer; allocates no tensor."""
    if len(meta) > MAX_META_BYTES:
        raise StateTransferError(f"state metadata is {len(meta)} bytes, over {MAX_META_BYTES}")
    try:
        doc = msgpack.unpackb(
            meta,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_map_len=16,
            max_ext_len=0,
        )
    except Exception as exc:
        raise StateTransferError(f"state metadata is not valid msgpack: {exc!r}"[:300]) from None
    if type(doc) is not dict or set(doc) != {"v", "size", "tensors", "tree"}:
        raise StateTransferError("state metadata is not a state description")
    if not _is_int(doc["v"]) or doc["v"] != VERSION:
        raise StateTransferError(f"unsupported state format version {doc['v']!r} (this side reads {VERSION})")
    declared = doc["size"]
    if not _is_int(declared) or declared < 0:
        raise StateTransferError(f"bad buffer size {declared!r} in state metadata")
    if declared != size:
        raise StateTransferError(f"buffer holds {size} bytes, structure needs {declared}")
    table = doc["tensors"]
    if type(table) is not list or len(table) > MAX_TENSORS:
        raise StateTransferError(f"state tensor table is not a list of at most {MAX_TENSORS} entries")
    spans, end = [], 0
    for i, entry in enumerate(table):
        spans.append(_check_span(i, entry, size, end))
        end = spans[-1].offset + _aligned(spans[-1].nbytes)
    if end != size:
        raise StateTransferError(f"tensors end at byte {end}, the buffer holds {size}")
    _decode(doc["tree"], None, len(spans), "", 0)  # check the whole tree before building anything
    return Description(spans, doc["tree"])


def _check_span(i: int, entry: Any, size: int, expected: int) -> _Span:
    if type(entry) is not list or len(entry) != 5:
        raise StateTransferError(f"tensor {i}: entry is not [dtype, shape, offset, nbytes, host]")
    name, shape, off, nbytes, host = entry
    dtype = _DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise StateTransferError(f"tensor {i}: dtype {name!r} is not allowed")
    if type(shape) is not list or len(shape) > _MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        raise StateTransferError(f"tensor {i}: bad shape {shape!r}"[:200])
    if not (_is_int(off) and _is_int(nbytes)) or off < 0 or nbytes < 0:
        raise StateTransferError(f"tensor {i}: bad span offset={off!r} nbytes={nbytes!r}")
    if off % ALIGN:
        raise StateTransferError(f"tensor {i}: offset {off} is not {ALIGN}-byte aligned")
    if off + nbytes > size:
        raise StateTransferError(
            f"tensor {i}: bytes [{off}, {off + nbytes}) lie outside the {size}-byte buffer"
        )
    want = math.prod(shape) * dtype.itemsize
    if nbytes != want:
        raise StateTransferError(f"tensor {i}: {nbytes} bytes for shape {tuple(shape)} {name} (needs {want})")
    if off != expected:
        raise StateTransferError(f"tensor {i}: offset {off}, expected {expected} (tensors lie in order)")
    if type(host) is not bool:
        raise StateTransferError(f"tensor {i}: host flag {host!r} is not a bool"[:200])
    return _Span(dtype, tuple(shape), off, nbytes, host)


def _decode(node: Any, views: list[torch.Tensor] | None, ntensors: int, path: str, depth: int) -> Any:
    """One tree node as a value; with ``views`` None it only checks (tensors come back None)."""
    if depth > MAX_DEPTH:
        raise StateTransferError(f"state nested deeper than {MAX_DEPTH} levels {_where(path)}")
    t = type(node)
    if node is None or t is bool or t is int or t is float or t is str or t is bytes:
        return node
    if t is not list or not node or type(node[0]) is not str:
        raise StateTransferError(f"malformed state node {_where(path)}")
    tag, args = node[0], node[1:]

    def bad(what: str) -> StateTransferError:
        return StateTransferError(f"malformed {tag!r} node {_where(path)}: {what}")

    if tag in ("list", "tuple"):
        if len(args) != 1 or type(args[0]) is not list:
            raise bad("expected [tag, items]")
        items = [_decode(v, views, ntensors, _at(path, i), depth + 1) for i, v in enumerate(args[0])]
        return items if tag == "list" else tuple(items)
    if tag in ("dict", "odict"):
        if len(args) != (2 if tag == "dict" else 3) or type(args[0]) is not list or type(args[1]) is not list:
            raise bad("expected [tag, keys, values" + ("]" if tag == "dict" else ", metadata]"))
        keys, values = args[0], args[1]
        if len(keys) != len(values):
            raise bad(f"{len(keys)} keys for {len(values)} values")
        out: dict[Any, Any] = {} if tag == "dict" else OrderedDict()
        for k, v in zip(keys, values, strict=True):
            if type(k) is not str and type(k) is not int:
                raise bad(f"key of type {type(k).__name__}")
            if k in out:
                raise bad(f"duplicate key {k!r}"[:200])
            out[k] = _decode(v, views, ntensors, _at(path, k), depth + 1)
        if tag == "odict" and args[2] is not None:
            md = _decode(args[2], views, ntensors, _at(path, "_metadata"), depth + 1)
            if not isinstance(md, dict):
                raise bad("_metadata is not a mapping")
            out._metadata = md  # type: ignore[attr-defined]
        return out
    if tag == "tensor":
        if len(args) != 1 or not _is_int(args[0]) or not 0 <= args[0] < ntensors:
            raise bad(f"no tensor {args[0] if len(args) == 1 else args!r} among {ntensors}"[:200])
        return None if views is None else views[args[0]]
    if tag == "dtype":
        if len(args) != 1 or type(args[0]) is not str or args[0] not in _DTYPES:
            raise bad("dtype not allowed")
        return _DTYPES[args[0]]
    if tag == "size":
        dims = args[0] if len(args) == 1 else None
        if type(dims) is not list or len(dims) > _MAX_DIMS or not all(_is_int(d) and d >= 0 for d in dims):
            raise bad("bad dims")
        return torch.Size(dims)
    if tag == "device":
        name = args[0] if len(args) == 1 else None
        if type(name) is not str or len(name) > _MAX_DEVICE_NAME:
            raise bad("bad device name")
        try:
            return torch.device(name)
        except (RuntimeError, ValueError):
            raise bad(f"unknown device {name!r}") from None
    raise StateTransferError(f"unknown state node tag {tag!r}"[:200] + f" {_where(path)}")


def build(layout: Description, buf: torch.Tensor) -> Any:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous() or buf.device.type == "meta":
        raise StateTransferError(
            f"state buffer must be a contiguous 1-D uint8 tensor with storage, got {buf.dtype}"
            f" {tuple(buf.shape)} on {buf.device}"
        )
    if buf.storage_offset() % ALIGN or buf.data_ptr() % ALIGN:
        buf = buf.clone()  # views need each tensor aligned to its element size
    spans = layout.spans
    views = [buf[s.offset : s.offset + s.nbytes].view(s.dtype).reshape(s.shape) for s in spans]
    host = [i for i, s in enumerate(spans) if s.host]
    if buf.device.type != "cpu" and host:
        # CPU tensors at the sender come back on the CPU: their aligned spans, gathered
        # on the device, cross to the host in one copy (they are small: RNG, steps)
        staged = torch.cat([buf[spans[i].offset : spans[i].offset + _aligned(spans[i].nbytes)] for i in host])
        staged = staged.cpu()
        pos = 0
        for i in host:
            s = spans[i]
            views[i] = staged[pos : pos + s.nbytes].view(s.dtype).reshape(s.shape)
            pos += _aligned(s.nbytes)
    return _decode(layout.tree, views, len(views), "", 0)


def unpack(meta: bytes, buf: torch.Tensor) -> Any:
    """The object :func:`pack` was given; its tensors are views into ``buf`` (on
    ``buf``'s device), except, with a device buffer, those that were CPU tensors at
    the sender, which come back on the CPU."""
    return build(read_meta(meta, buf.numel()), buf)


def default_checksum_kind(device: torch.device) -> str:
    """:data:`CRC32` for a CPU buffer, :data:`WSUM31` for one on any other device."""
    return CRC32 if torch.device(device).type == "cpu" else WSUM31


def checksum(buf: torch.Tensor, kind: str | None = None) -> int:
    """A 32-bit checksum of ``buf``'s bytes; ``kind`` defaults to
    :func:`default_checksum_kind` of its device.

    :data:`CRC32`: ``zlib.crc32`` on the host (a device buffer would be copied over,
    which :func:`send_state` never asks for). :data:`WSUM31`: computed where the
    buffer is, with exact integer arithmetic (no overflow, no order dependence),
    so every device and the CPU agree bit for bit::

        sum over i of  x_i * ((i mod 2**30) + 1)   mod  P = 2**31 - 1

    where ``x_i`` is the i-th little-endian unsigned 32-bit word (a partial last
    word zero-padded). P is prime and every weight lies in [1, 2**30], so a
    change to one word by any amount other than a multiple of P is always caught:
    every corrupted byte, every corrupted bit. A swap of two different words is
    caught unless they lie a multiple of 2**30 words (4 GiB) apart; other
    corruption passes with probability about 2**-31.
    """
    kind = default_checksum_kind(buf.device) if kind is None else kind
    if kind == CRC32:
        host = buf.detach().reshape(-1).contiguous().view(torch.uint8).cpu()
        return zlib.crc32(host.numpy().data)
    if kind == WSUM31:
        return _wsum31(buf)
    raise ValueError(f"unknown checksum kind {kind!r} (one of {CHECKSUM_KINDS})")


def _wsum31(buf: torch.Tensor) -> int:
    flat = buf.detach().reshape(-1).contiguous().view(torch.uint8)
    n = flat.numel()
    nwords = n // 4
    if flat.storage_offset() % 4:
        flat = flat.clone()  # viewing as 32-bit words needs a 4-byte-aligned start
    words = flat[: nwords * 4].view(torch.int32)
    ramp = torch.arange(min(nwords, _WSUM_CHUNK), dtype=torch.int64, device=flat.device)
    sums: list[torch.Tensor] = []
    weighted: list[torch.Tensor] = []
    starts: list[int] = []
    for start in range(0, nwords, _WSUM_CHUNK):
        x = words[start : start + _WSUM_CHUNK].to(torch.int64).bitwise_and_(0xFFFFFFFF)  # < 2**32
        sums.append(x.sum())  # < 2**22 * 2**32: no overflow
        # (x_j * j) mod P per word, j < 2**22: products < 2**54, the sum < 2**53
        weighted.append(x.mul_(ramp[: x.numel()]).remainder_(_P31).sum())
        starts.append(start)
    total = 0
    if starts:
        # chunk k holds words start..start+L-1 with weights (start mod 2**30) + 1 + j, since
        # chunks never straddle a multiple of 2**30: sum = w0 * sum(x) + sum(x_j * j)
        w0 = torch.tensor([s % (1 << 30) + 1 for s in starts], dtype=torch.int64, device=flat.device)
        part = (w0 * torch.stack(sums).remainder_(_P31) + torch.stack(weighted)).remainder_(_P31)
        total = int(part.sum()) % _P31  # < 2**31 per chunk: no overflow; one scalar to the host
    tail = flat[nwords * 4 :]
    if tail.numel():
        last = int.from_bytes(bytes(tail.cpu().tolist()), "little")  # zero-padded to a word
        total = (total + last * (nwords % (1 << 30) + 1)) % _P31
    return total

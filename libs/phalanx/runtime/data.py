"""Deterministic, memory-mapped data loading whose position moves on recovery.

A training rank reads fixed-length samples from one flat token file. The order in
which samples are consumed is a function of ``(seed, epoch)`` alone, and the
global batch at step ``s`` is samples ``[s*G, (s+1)*G)`` of the infinite
concatenation of the epoch orders. A replica ``r`` of ``W`` takes a contiguous
shard of that batch. So what a rank reads at a step depends only on
``(seed, step, G, W, r)``: not on how many times the process restarted, not on
what it read before, and the union over ranks is the global batch whatever ``W``
is. That is what lets the runtime hand a joiner a tiny :class:`DataPosition`
instead of loader state (docs/recovery.md, phase ``data_restore``), and what keeps the
sequence of optimizer updates independent of failures (docs/invariants.md, "A
replacement continues bitwise": a replacement takes the dead rank's index and
therefore its shard).

Two node-local caches make a replacement process cheap, both in shared memory
(``/dev/shm``; a temp directory where it is absent; ``PHALANX_DATA_CACHE_DIR``
overrides): the permutation of each epoch, and optionally the next few steps'
prepared shards of a replica. Files are written to a temporary name and renamed,
so a reader sees a complete file or none; a file that does not have the expected
shape or dtype is ignored and rewritten.

Gradient scaling: shards differ by at most one sample when ``G % W != 0``; for
the exact mean over the global batch weight a shard's (or a micro-batch's)
mean loss by ``n / G`` and sum over ranks (or by ``n * W / G`` under an
averaging allreduce such as DDP's).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from phalanx.settings import RankSettings, load

TokenDtype = Literal["uint8", "uint16"]

_DTYPES: dict[str, type[np.unsignedinteger[Any]]] = {"uint8": np.uint8, "uint16": np.uint16}
_FORMAT = 1  # bump when the order or the cache layout changes
_ORDERS_IN_PROCESS = 2  # epochs kept mapped per GlobalOrder (the current one and the next)
_ORDER_FILE = re.compile(r"^order-[0-9a-f]+-e(?P<epoch>\d+)\.npy$")
_PREPARED = re.compile(r"^batch-(?P<key>[0-9a-f]+)-s(?P<step>\d+)\.npy$")


class DataError(ValueError):
    """The token file, a parameter or a data position is unusable."""


# --------------------------------------------------------------------------- cache


def default_cache_dir() -> Path:
    """Where the node-local caches live: ``PHALANX_DATA_CACHE_DIR``, else
    ``/dev/shm/phalanx-data-<uid>``, else ``<tempdir>/phalanx-data-<uid>``."""
    configured = load(RankSettings).data_cache_dir
    if configured is not None:
        return configured
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"phalanx-data-{os.getuid()}"


def _atomic_save(path: Path, array: np.ndarray) -> None:
    """Write ``array`` as ``.npy`` to ``path`` so that readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _load_cached(path: Path, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray | None:
    """A read-only map of a cached ``.npy`` with this exact shape and dtype, else None."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return None
    if arr.shape != shape or arr.dtype != dtype:
        return None
    return arr


def _digest(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


# ----------------------------------------------------------------------- token file


class TokenFile:
    """A flat file of tokens (``uint8`` bytes or ``uint16`` ids), memory-mapped.

    Sample ``i`` is the window ``tokens[i*seq_len : i*seq_len + seq_len + 1]``:
    input ``window[:-1]``, target ``window[1:]``. Windows do not overlap as inputs
    (each target's last token is the next window's first input).
    """

    def __init__(self, path: str | os.PathLike[str], seq_len: int, dtype: TokenDtype = "uint8") -> None:
        if dtype not in _DTYPES:
            raise DataError(f"unsupported token dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        self.path = Path(path)
        self.seq_len = seq_len
        self.dtype: TokenDtype = dtype
        np_dtype = np.dtype(_DTYPES[dtype])
        try:
            st = self.path.stat()
        except FileNotFoundError:
            raise DataError(f"token file {self.path} does not exist") from None
        if not self.path.is_file():
            raise DataError(f"token file {self.path} is not a regular file")
        if st.st_size == 0:
            raise DataError(f"token file {self.path} is empty")
        if st.st_size % np_dtype.itemsize:
            raise DataError(
                f"token file {self.path} has {st.st_size} bytes, not a multiple of {np_dtype.itemsize} ({dtype})"
            )
        self.size = st.st_size
        self.mtime_ns = st.st_mtime_ns
        self.num_tokens = st.st_size // np_dtype.itemsize
        if self.num_tokens < seq_len + 1:
            raise DataError(
                f"token file {self.path} has {self.num_tokens} tokens; one sample needs seq_len+1 = {seq_len + 1}"
            )
        self.num_samples = (self.num_tokens - 1) // seq_len
        self.tokens: np.memmap = np.memmap(self.path, dtype=np_dtype, mode="r", shape=(self.num_tokens,))
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)

    @property
    def identity(self) -> tuple[str, int, int, str, int]:
        """What names this file on this node: (real path, size, mtime_ns, dtype, seq_len)."""
        return (os.path.realpath(self.path), self.size, self.mtime_ns, self.dtype, self.seq_len)

    def windows(self, indices: npt.ArrayLike) -> np.ndarray:
        """Samples ``indices`` as an array ``[n, seq_len+1]`` of the file's dtype."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1:
            raise DataError("sample indices must be one-dimensional")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise DataError(f"sample index out of range [0, {self.num_samples})")
        return np.asarray(self.tokens[idx[:, None] * self.seq_len + self._offsets])

    def __repr__(self) -> str:
        return (
            f"TokenFile({str(self.path)!r}, seq_len={self.seq_len}, dtype={self.dtype!r}, "
            f"num_samples={self.num_samples})"
        )


# ----------------------------------------------------------------------- the order


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The order of epoch ``epoch``: a permutation of ``range(num_samples)`` (int64)
    drawn from ``Generator(PCG64(SeedSequence([seed, epoch])))``. Depends on nothing
    else (numpy does not promise the same stream across its versions, which is why
    the cache key names the numpy version)."""
    if seed < 0 or epoch < 0:
        raise DataError(f"seed and epoch must be >= 0, got seed={seed} epoch={epoch}")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(num_samples).astype(np.int64, copy=False)


class GlobalOrder:
    """The infinite sample order: epoch 0's permutation, then epoch 1's, and so on.

    Each epoch's permutation is computed once per node and shared through a file in
    the cache directory, ``order-<hash of (file identity, num_samples, seed)>-e<epoch>.npy``;
    a replacement process on the node maps it instead of recomputing. Writing epoch
    ``e`` deletes the files of epochs before ``e - 1``.
    ``cache=False`` disables the file cache (each process computes its own);
    ``cache_dir=None`` means :func:`default_cache_dir`.
    """

    def __init__(
        self,
        num_samples: int,
        seed: int,
        *,
        source: tuple[object, ...] = (),
        cache: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if num_samples < 1:
            raise DataError(f"num_samples must be >= 1, got {num_samples}")
        if seed < 0:
            raise DataError(f"seed must be >= 0, got {seed}")
        self.num_samples = num_samples
        self.seed = seed
        self.source = source
        self.cache_dir: Path | None = (
            None if not cache else (Path(cache_dir) if cache_dir is not None else default_cache_dir())
        )
        self._epochs: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.computed = 0  # epochs this instance computed (0 when all came from the cache)

    @property
    def key(self) -> str:
        """The cache key of this order (an epoch's file adds the epoch to it)."""
        return _digest("order", _FORMAT, np.__version__, self.source, self.num_samples, self.seed)

    def cache_path(self, epoch: int) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / f"order-{self.key}-e{epoch}.npy"

    def _prune(self, epoch: int) -> None:
        """Delete this order's cached epochs before ``epoch - 1`` (a process that
        still maps one keeps its pages; a late reader recomputes)."""
        assert self.cache_dir is not None
        for path in self.cache_dir.glob(f"order-{self.key}-e*.npy"):
            m = _ORDER_FILE.match(path.name)
            if m and int(m["epoch"]) < epoch - 1:
                path.unlink(missing_ok=True)

    def epoch(self, epoch: int) -> np.ndarray:
        """The (read-only) permutation of one epoch."""
        with self._lock:
            hit = self._epochs.get(epoch)
            if hit is not None:
                self._epochs.move_to_end(epoch)
                return hit
            order = self._load_or_compute(epoch)
            self._epochs[epoch] = order
            while len(self._epochs) > _ORDERS_IN_PROCESS:
                self._epochs.popitem(last=False)
            return order

    def _load_or_compute(self, epoch: int) -> np.ndarray:
        path = self.cache_path(epoch)
        if path is not None:
            cached = _load_cached(path, (self.num_samples,), np.dtype(np.int64))
            if cached is not None:
                return cached
        order = epoch_permutation(self.num_samples, self.seed, epoch)
        self.computed += 1
        if path is not None:
            try:
                _atomic_save(path, order)
                self._prune(epoch)
            except OSError:
                pass  # a full or read-only cache only costs the next process a recompute
        order.flags.writeable = False
        return order

    def indices(self, start: int, stop: int) -> np.ndarray:
        """Sample indices at global positions ``[start, stop)`` of the infinite order."""
        if start < 0 or stop < start:
            raise DataError(f"bad position range [{start}, {stop})")
        n = self.num_samples
        parts: list[np.ndarray] = []
        pos = start
        while pos < stop:
            epoch, off = divmod(pos, n)
            take = min(stop - pos, n - off)
            parts.append(np.asarray(self.epoch(epoch)[off : off + take]))
            pos += take
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


# --------------------------------------------------------------------- the position


@dataclass(frozen=True)
class DataPosition:
    """Where the data stream is: the next step to run and the global batch it uses.

    Samples consumed before ``step`` are ``step * global_batch`` (the global batch is
    held constant through resizes). ``fingerprint`` names the stream (token count,
    dtype, seq_len, num_samples, seed) so a joiner can refuse a position from other
    data. Small enough to send as a dict on the bus or as a 3-element int64 tensor
    over the communicator.
    """

    step: int
    global_batch: int
    fingerprint: int = 0

    def __post_init__(self) -> None:
        if self.step < 0 or self.global_batch < 1:
            raise DataError(f"bad data position step={self.step} global_batch={self.global_batch}")
        if not 0 <= self.fingerprint < 2**63:
            raise DataError(f"fingerprint must fit in 63 bits, got {self.fingerprint}")

    @property
    def consumed_samples(self) -> int:
        return self.step * self.global_batch

    def epoch(self, num_samples: int) -> int:
        """The epoch of the next sample to be read."""
        return self.consumed_samples // num_samples

    def advance(self, steps: int = 1) -> DataPosition:
        return DataPosition(self.step + steps, self.global_batch, self.fingerprint)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataPosition:
        extra = set(d) - {"step", "global_batch", "fingerprint"}
        if extra:
            raise DataError(f"unknown data position fields {sorted(extra)}")
        try:
            return cls(int(d["step"]), int(d["global_batch"]), int(d.get("fingerprint", 0)))
        except KeyError as exc:
            raise DataError(f"data position lacks {exc.args[0]!r}") from None

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([self.step, self.global_batch, self.fingerprint], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> DataPosition:
        if t.dtype != torch.int64 or tuple(t.shape) != (3,):
            raise DataError(f"a data position tensor is int64 [3], got {t.dtype} {tuple(t.shape)}")
        step, gb, fp = (int(v) for v in t.tolist())
        return cls(step, gb, fp)


# ------------------------------------------------------------------------ sharding


def shard_bounds(global_batch: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)`` of replica ``rank``'s shard within a global batch: contiguous,
    ordered by rank, sizes ``ceil(G/W)`` for the first ``G % W`` ranks and
    ``floor(G/W)`` for the rest."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"bad rank {rank} of world size {world_size}")
    if global_batch < world_size:
        raise DataError(f"global batch {global_batch} is smaller than world size {world_size}")
    base, extra = divmod(global_batch, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def split_sizes(n: int, micro_batch: int) -> list[int]:
    """Sizes of the micro-batches of a shard of ``n``: ``micro_batch`` each, the last
    one the rest."""
    if micro_batch < 1:
        raise DataError(f"micro_batch must be >= 1, got {micro_batch}")
    full, rest = divmod(n, micro_batch)
    return [micro_batch] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class Shard:
    """Replica ``rank``'s part of the global batch of ``step``: samples
    ``[lo, hi)`` of that batch as ``x``, ``y`` (int64 ``[n, seq_len]``)."""

    step: int
    global_batch: int
    world_size: int
    rank: int
    lo: int
    hi: int
    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return self.hi - self.lo

    def micro_batches(self, micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The shard split into consecutive ``(x, y)`` pieces of at most ``micro_batch`` rows (views)."""
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        at = 0
        for size in split_sizes(len(self), micro_batch):
            out.append((self.x[at : at + size], self.y[at : at + size]))
            at += size
        return out


def _to_xy(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.from_numpy(np.ascontiguousarray(windows, dtype=np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class DataStream:
    """What a rank reads: shards of global batches of a :class:`TokenFile` in the
    :class:`GlobalOrder` of ``seed``.

    ``prepared_cache=True`` turns on the prepared-batch cache: :meth:`prepare`
    writes the next steps' shards of a replica to the cache directory and
    :meth:`shard` reads a prepared shard when one is there.
    """

    def __init__(
        self,
        tokens: TokenFile,
        seed: int,
        *,
        cache: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        prepared_cache: bool = False,
    ) -> None:
        self.tokens = tokens
        self.seed = seed
        self.order = GlobalOrder(
            tokens.num_samples, seed, source=tokens.identity, cache=cache, cache_dir=cache_dir
        )
        if prepared_cache and self.order.cache_dir is None:
            raise DataError("the prepared-batch cache needs the file cache (cache=True)")
        self.prepared_cache = prepared_cache
        self.prepared_hits = 0

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        seq_len: int,
        seed: int,
        *,
        dtype: TokenDtype = "uint8",
        cache: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        prepared_cache: bool = False,
    ) -> DataStream:
        return cls(
            TokenFile(path, seq_len, dtype),
            seed,
            cache=cache,
            cache_dir=cache_dir,
            prepared_cache=prepared_cache,
        )

    @property
    def seq_len(self) -> int:
        return self.tokens.seq_len

    @property
    def fingerprint(self) -> int:
        t = self.tokens
        h = hashlib.sha256(
            repr(("stream", t.num_tokens, t.dtype, t.seq_len, t.num_samples, self.seed)).encode()
        )
        return int.from_bytes(h.digest()[:8], "big") >> 1

    def position(self, step: int, global_batch: int) -> DataPosition:
        return DataPosition(step, global_batch, self.fingerprint)

    def check(self, position: DataPosition) -> None:
        """Refuse a position taken on another data stream (fingerprint 0 is not checked)."""
        if position.fingerprint and position.fingerprint != self.fingerprint:
            raise DataError(
                f"data position fingerprint {position.fingerprint:#x} is not this stream's {self.fingerprint:#x}"
            )

    # -- reading

    def global_indices(self, step: int, global_batch: int) -> np.ndarray:
        """Sample indices of the whole global batch of ``step``."""
        if step < 0 or global_batch < 1:
            raise DataError(f"bad step {step} / global batch {global_batch}")
        return self.order.indices(step * global_batch, (step + 1) * global_batch)

    def global_batch(self, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole global batch of ``step`` as ``(x, y)``."""
        return _to_xy(self.tokens.windows(self.global_indices(step, global_batch)))

    def _windows(self, step: int, global_batch: int, lo: int, hi: int) -> np.ndarray:
        start = step * global_batch
        return self.tokens.windows(self.order.indices(start + lo, start + hi))

    def shard(self, step: int, global_batch: int, world_size: int, rank: int) -> Shard:
        """Replica ``rank`` of ``world_size``'s shard of the global batch of ``step``."""
        if step < 0:
            raise DataError(f"step must be >= 0, got {step}")
        lo, hi = shard_bounds(global_batch, world_size, rank)
        windows: np.ndarray | None = None
        if self.prepared_cache:
            windows = _load_cached(
                self._prepared_path(step, global_batch, world_size, rank),
                (hi - lo, self.seq_len + 1),
                self.tokens.tokens.dtype,
            )
            if windows is not None:
                self.prepared_hits += 1
        if windows is None:
            windows = self._windows(step, global_batch, lo, hi)
        x, y = _to_xy(windows)
        return Shard(step, global_batch, world_size, rank, lo, hi, x, y)

    def shard_at(self, position: DataPosition, world_size: int, rank: int) -> Shard:
        self.check(position)
        return self.shard(position.step, position.global_batch, world_size, rank)

    # -- the prepared-batch cache

    def _replica_key(self, global_batch: int, world_size: int, rank: int) -> str:
        return _digest(
            "batch", _FORMAT, np.__version__, self.tokens.identity, self.seed, global_batch, world_size, rank
        )

    def _prepared_path(self, step: int, global_batch: int, world_size: int, rank: int) -> Path:
        assert self.order.cache_dir is not None
        return self.order.cache_dir / f"batch-{self._replica_key(global_batch, world_size, rank)}-s{step}.npy"

    def prepare(self, step: int, count: int, global_batch: int, world_size: int, rank: int) -> list[Path]:
        """Write this replica's shards of steps ``[step, step+count)`` to the cache
        (skipping those already there) and delete its prepared shards of earlier
        steps. Returns the paths of the prepared steps."""
        if not self.prepared_cache:
            raise DataError("the prepared-batch cache is off for this stream")
        if count < 0:
            raise DataError(f"count must be >= 0, got {count}")
        lo, hi = shard_bounds(global_batch, world_size, rank)
        shape = (hi - lo, self.seq_len + 1)
        paths = []
        for s in range(step, step + count):
            path = self._prepared_path(s, global_batch, world_size, rank)
            if _load_cached(path, shape, self.tokens.tokens.dtype) is None:
                _atomic_save(path, self._windows(s, global_batch, lo, hi))
            paths.append(path)
        self.discard_prepared(global_batch, world_size, rank, before=step)
        return paths

    def discard_prepared(
        self, global_batch: int, world_size: int, rank: int, before: int | None = None
    ) -> int:
        """Delete this replica's prepared shards (only those of steps < ``before`` if
        given). Returns how many files went."""
        if self.order.cache_dir is None or not self.order.cache_dir.is_dir():
            return 0
        key = self._replica_key(global_batch, world_size, rank)
        gone = 0
        for path in self.order.cache_dir.glob(f"batch-{key}-s*.npy"):
            m = _PREPARED.match(path.name)
            if m and m["key"] == key and (before is None or int(m["step"]) < before):
                path.unlink(missing_ok=True)
                gone += 1
        return gone

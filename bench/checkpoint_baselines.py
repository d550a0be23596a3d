"""Baselines of the checkpoint benchmark (bench/checkpoint.py calls them).

What a training loop waits for when it saves its state without Phalanx, on the
same state dict (:func:`make_state`):

- :func:`shm_copy_s`: the floor, one plain copy of every tensor into a reused,
  already faulted-in buffer in /dev/shm;
- :func:`dcp_async_blocked_s`: ``torch.distributed.checkpoint.async_save`` to a local
  directory, with each stager configuration torch offers on CPU: how long the call
  keeps the caller (the upload runs on in a thread);
- :func:`direct_remote_save_s`: saving straight to S3 (``torch.save`` + an obstore
  upload, and synchronous DCP through fsspec/s3fs), e.g. to a phalanx.devstack.s3server.

Single process, no process group. Every function removes the files it wrote.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import shutil
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import obstore
import torch
import torch.distributed.checkpoint as dcp
from obstore.store import S3Store
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

ACCESS_KEY_ID = "testing"
SECRET_ACCESS_KEY = "testing"
REGION = "us-east-1"
_ALIGN = 64  # byte offset of each tensor in the shared-memory buffer


@contextmanager
def _quiet_dcp() -> Iterator[None]:
    """Without DCP's warnings that there is no process group and no CUDA to pin memory
    (both on purpose here). Held until the saves are done: they warn from their threads."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Ignoring pin_memory flag")
        yield


def make_state(total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A GPT-like state dict of float32 tensors summing to ``total_bytes`` (within 1%).

    16 tensors: an embedding (about a quarter of the bytes) and 3 blocks of
    qkv (3d x d), proj (d x d), fc1 (4d x d), fc2 (d x 4d) and a norm (d). The same
    ``total_bytes`` and ``seed`` give the same tensors.
    """
    n = max(total_bytes // 4, 64)  # float32 elements
    layers = 3
    d = max(1, int(math.sqrt(0.75 * n / (12 * layers))))
    vocab = max(1, (n - layers * (12 * d * d + d)) // d)
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    for i in range(layers):
        shapes |= {
            f"blocks.{i}.attn.qkv.weight": (3 * d, d),
            f"blocks.{i}.attn.proj.weight": (d, d),
            f"blocks.{i}.mlp.fc1.weight": (4 * d, d),
            f"blocks.{i}.mlp.fc2.weight": (d, 4 * d),
            f"blocks.{i}.norm.weight": (d,),
        }
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen, dtype=torch.float32) for name, shape in shapes.items()}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def shm_copy_s(state: dict[str, torch.Tensor], repeats: int = 3) -> list[float]:
    """Seconds per full copy of ``state`` into one reused /dev/shm buffer.

    The buffer (a file in /dev/shm, mmapped, seen as a uint8 tensor) is filled once
    untimed so that its pages are faulted in; then each repeat copies every tensor to
    its offset. The file is unlinked at the end.
    """
    offsets: list[tuple[torch.Tensor, int, int]] = []
    size = 0
    for t in state.values():
        src = _as_bytes(t)
        offsets.append((src, size, src.numel()))
        size += -(-src.numel() // _ALIGN) * _ALIGN
    path = f"/dev/shm/phalanx-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    times: list[float] = []
    try:
        os.ftruncate(fd, max(size, 1))
        mm = mmap.mmap(fd, max(size, 1))
        try:
            buf = torch.frombuffer(mm, dtype=torch.uint8)
            for rep in range(repeats + 1):  # the first fills the pages in, untimed
                t0 = time.perf_counter()
                for src, at, n in offsets:
                    buf[at : at + n].copy_(src)
                if rep:
                    times.append(time.perf_counter() - t0)
            del buf  # no view of the mapping may outlive it
        finally:
            mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return times


def _stager_configs() -> dict[str, StagingOptions | str | None]:
    """Config name -> the async_stager to give async_save.

    None: no stager, so the FileSystemWriter stages itself (BlockingAsyncStager: a
    fresh CPU copy per save, what ``async_save(state, storage_writer=writer)`` does);
    "writer_cached": the writer's ``cache_staged_state_dict=True`` (one reused copy,
    allocated with pin_memory=True); a StagingOptions: a DefaultStager with it, reused
    across the repeats (it keeps its staging copy: the first repeat allocates it).
    Non-blocking copies need an accelerator; pinned memory without CUDA is ignored
    with a warning (so no separate pinned config here).
    """
    return {
        "writer": None,
        "writer_cached": "writer_cached",
        "stager_sync": StagingOptions(False, False, False, False),
        "stager_sync_shm": StagingOptions(False, True, False, False),
        "stager_async": StagingOptions(False, False, True, False),
        "stager_async_shm": StagingOptions(False, True, True, False),
        "stager_default": StagingOptions(),  # pinned, shared, async, non-blocking
    }


def _time_async_save(
    state: dict[str, torch.Tensor], root: str, name: str, config: StagingOptions | str | None, repeats: int
) -> tuple[list[float], list[float]]:
    """(seconds each async_save call blocked, seconds from each call to staging done)."""
    stager: AsyncStager | None = DefaultStager(config) if isinstance(config, StagingOptions) else None
    writer = None
    if config == "writer_cached":
        writer = dcp.FileSystemWriter(root, sync_files=False, cache_staged_state_dict=True)
    blocked: list[float] = []
    staged: list[float] = []
    try:
        for rep in range(repeats):
            path = os.path.join(root, f"{name}-{rep}")
            w = writer or dcp.FileSystemWriter(path, sync_files=False)
            t0 = time.perf_counter()
            res = dcp.async_save(
                state, checkpoint_id=path, storage_writer=w, async_stager=stager, no_dist=True
            )
            blocked.append(time.perf_counter() - t0)
            if isinstance(res, AsyncSaveResponse):
                res.staging_completion.result()
                staged.append(time.perf_counter() - t0)
                res.upload_completion.result()
            else:
                res.result()
            shutil.rmtree(path, ignore_errors=True)
    finally:
        if stager is not None:
            stager.close()
    return blocked, staged


def dcp_async_blocked_s(state: dict[str, torch.Tensor], directory: str, repeats: int = 2) -> dict[str, Any]:
    """Seconds ``dcp.async_save`` keeps its caller, per stager configuration.

    Returns ``{config: [seconds per repeat], ..., "skipped": {config: error}}``.
    Only the call is timed (until async_save returns its Future or AsyncSaveResponse);
    the save is then waited for, untimed, before the next repeat. With asynchronous
    staging the call returns before the state is copied, and the caller must not
    change the tensors until the response's ``staging_completion`` is done: that time
    (from the call) is reported too, as ``"<config>+staged"``.

    Writes ``FileSystemWriter(..., sync_files=False)`` checkpoints (sync_files=True
    calls a machine-wide os.sync()) in a temporary directory under ``directory``,
    removed at the end. Configurations that raise on this machine (pinned memory
    and non-blocking copies without an accelerator) land in ``"skipped"``.
    """
    os.makedirs(directory, exist_ok=True)
    root = tempfile.mkdtemp(prefix="phalanx-dcp-", dir=directory)
    out: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    try:
        with _quiet_dcp():
            for name, config in _stager_configs().items():
                try:
                    blocked, staged = _time_async_save(state, root, name, config, repeats)
                except Exception as e:
                    skipped[name] = f"{type(e).__name__}: {e}".strip()
                    continue
                out[name] = blocked
                if staged:
                    out[f"{name}+staged"] = staged
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["skipped"] = skipped
    return out


def _s3_store(endpoint: str, bucket: str) -> S3Store:
    return S3Store(
        bucket,
        endpoint=endpoint,
        access_key_id=ACCESS_KEY_ID,
        secret_access_key=SECRET_ACCESS_KEY,
        region=REGION,
        client_options={"allow_http": True},
    )


def direct_remote_save_s(
    state: dict[str, torch.Tensor],
    endpoint: str,
    bucket: str,
    part_bytes: int = 16 << 20,
    concurrency: int = 8,
) -> dict[str, float]:
    """Seconds a synchronous save straight to S3 keeps the caller.

    - ``torch_save_s``: ``torch.save`` into memory, then one obstore ``put`` of the
      bytes (obstore's defaults: a multipart upload of 5 MiB parts, 12 at a time);
    - ``torch_save_parts_s``: the same with the object tier's parts (``part_bytes``,
      ``concurrency`` at a time), so that the tiers' upload settings are no advantage;
      its two halves are ``serialize_s`` and ``upload_s`` (the server's floor for
      these bytes: no save through it can be durable sooner);
    - ``dcp_sync_s``: ``dcp.save`` through fsspec's s3fs (``FsspecWriter`` on an
      ``s3://`` path, ``sync_files=False``); only when s3fs is importable.

    ``endpoint`` is an S3 server taking the "testing" credentials (phalanx.devstack.s3server);
    ``bucket`` must exist. The objects written are deleted at the end.
    """
    store = _s3_store(endpoint, bucket)
    prefix = f"phalanx-bench-{uuid.uuid4().hex[:8]}"
    out: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save(state, buf)
        view = buf.getbuffer()
        obstore.put(store, f"{prefix}/torch_save/state.pt", view)
        out["torch_save_s"] = time.perf_counter() - t0
        view.release()
        del buf

        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save(state, buf)
        view = buf.getbuffer()
        out["serialize_s"] = time.perf_counter() - t0
        pieces = (view[i : i + part_bytes] for i in range(0, len(view), part_bytes))
        obstore.put(
            store,
            f"{prefix}/torch_save_parts/state.pt",
            pieces,
            chunk_size=part_bytes,
            max_concurrency=concurrency,
        )
        out["torch_save_parts_s"] = time.perf_counter() - t0
        out["upload_s"] = out["torch_save_parts_s"] - out["serialize_s"]
        del pieces  # its slices of the buffer, before it is released
        view.release()
        del buf

        try:
            import s3fs  # noqa: F401  (FsspecWriter finds it through fsspec)
        except ImportError:
            return out
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(
            f"s3://{bucket}/{prefix}/dcp",
            sync_files=False,
            key=ACCESS_KEY_ID,
            secret=SECRET_ACCESS_KEY,
            endpoint_url=endpoint,
            client_kwargs={"region_name": REGION},
            skip_instance_cache=True,
        )
        t0 = time.perf_counter()
        with _quiet_dcp():
            dcp.save(state, storage_writer=writer, no_dist=True)
        out["dcp_sync_s"] = time.perf_counter() - t0
    finally:
        paths = [m["path"] for m in obstore.list(store, prefix).collect()]
        if paths:
            obstore.delete(store, paths)
    return out

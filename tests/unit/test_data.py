"""Deterministic data loading: windows, the global order, its shm cache, sharding,
data positions and the prepared-batch cache (phalanx.runtime.data)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from phalanx.runtime.data import (
    DataError,
    DataPosition,
    DataStream,
    GlobalOrder,
    TokenFile,
    epoch_permutation,
    shard_bounds,
    split_sizes,
)

SEQ = 16


@pytest.fixture
def raw(tmp_path: Path) -> bytes:
    data = np.random.default_rng(7).integers(0, 256, size=1000, dtype=np.uint8).tobytes()
    (tmp_path / "tokens.bin").write_bytes(data)
    return data


@pytest.fixture
def token_path(tmp_path: Path, raw: bytes) -> Path:
    return tmp_path / "tokens.bin"


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def stream(path: Path, cache_dir: Path, seed: int = 3, **kw: object) -> DataStream:
    return DataStream.open(path, SEQ, seed, cache_dir=cache_dir, **kw)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- TokenFile


def test_windows_are_shifted_non_overlapping_slices(token_path: Path, raw: bytes) -> None:
    tf = TokenFile(token_path, SEQ)
    assert tf.num_samples == (len(raw) - 1) // SEQ == 62
    w = tf.windows([0, 5, tf.num_samples - 1])
    assert w.shape == (3, SEQ + 1)
    for row, i in zip(w, [0, 5, tf.num_samples - 1], strict=True):
        assert row.tobytes() == raw[i * SEQ : i * SEQ + SEQ + 1]
    with pytest.raises(DataError, match="out of range"):
        tf.windows([tf.num_samples])


def test_uint16_tokens(tmp_path: Path) -> None:
    ids = np.arange(3 * SEQ + 1, dtype=np.uint16) * 1000
    path = tmp_path / "ids.bin"
    ids.tofile(path)
    s = DataStream.open(path, SEQ, 0, dtype="uint16", cache=False)
    assert s.tokens.num_samples == 3
    x, y = s.global_batch(0, 3)
    got = {tuple(row) for row in torch.cat([x, y[:, -1:]], dim=1).tolist()}
    want = {tuple(int(v) for v in ids[i * SEQ : i * SEQ + SEQ + 1]) for i in range(3)}
    assert got == want
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize(("size", "samples"), [(SEQ + 1, 1), (2 * SEQ, 1), (2 * SEQ + 1, 2), (3 * SEQ, 2)])
def test_every_window_fits_in_the_file(tmp_path: Path, size: int, samples: int) -> None:
    path = tmp_path / "small.bin"
    path.write_bytes(bytes(i % 256 for i in range(size)))
    tf = TokenFile(path, SEQ)
    assert tf.num_samples == samples
    last = tf.windows([samples - 1])[0]
    assert last.tolist() == [i % 256 for i in range((samples - 1) * SEQ, samples * SEQ + 1)]


@pytest.mark.parametrize(
    ("content", "dtype", "match"),
    [
        (None, "uint8", "does not exist"),
        (b"", "uint8", "is empty"),
        (b"x" * SEQ, "uint8", "one sample needs"),
        (b"x" * (2 * SEQ + 1), "uint16", "not a multiple of 2"),
        (b"x" * 100, "int32", "unsupported token dtype"),
    ],
)
def test_token_file_errors(tmp_path: Path, content: bytes | None, dtype: str, match: str) -> None:
    path = tmp_path / "bad.bin"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=match):
        TokenFile(path, SEQ, dtype)  # type: ignore[arg-type]


def test_directory_and_bad_seq_len_rejected(tmp_path: Path, token_path: Path) -> None:
    with pytest.raises(DataError, match="not a regular file"):
        TokenFile(tmp_path, SEQ)
    with pytest.raises(DataError, match="seq_len"):
        TokenFile(token_path, 0)


# --------------------------------------------------------------------- GlobalOrder


def test_order_is_a_function_of_seed_and_epoch() -> None:
    a = epoch_permutation(500, seed=1, epoch=0)
    assert sorted(a.tolist()) == list(range(500))
    assert np.array_equal(a, epoch_permutation(500, seed=1, epoch=0))
    assert not np.array_equal(a, epoch_permutation(500, seed=1, epoch=1))
    assert not np.array_equal(a, epoch_permutation(500, seed=2, epoch=0))
    o1 = GlobalOrder(500, 1, cache=False)
    o2 = GlobalOrder(500, 1, cache=False)
    assert np.array_equal(o1.indices(480, 1030), o2.indices(480, 1030))


def test_indices_span_epochs(cache_dir: Path) -> None:
    o = GlobalOrder(10, 5, cache_dir=cache_dir)
    want = np.concatenate([epoch_permutation(10, 5, e) for e in range(4)])
    assert np.array_equal(o.indices(0, 40), want)
    assert np.array_equal(o.indices(7, 33), want[7:33])
    assert o.indices(12, 12).size == 0
    with pytest.raises(DataError):
        o.indices(5, 4)


def test_shm_cache_hit_returns_identical_order(cache_dir: Path) -> None:
    first = GlobalOrder(300, 9, source=("x",), cache_dir=cache_dir)
    a = np.array(first.epoch(2))
    assert first.computed == 1
    path = first.cache_path(2)
    assert path is not None and path.is_file()
    assert not list(cache_dir.glob(".*.tmp"))  # the atomic write left no temporary behind

    second = GlobalOrder(300, 9, source=("x",), cache_dir=cache_dir)  # "a replacement process"
    b = second.epoch(2)
    assert second.computed == 0
    assert np.array_equal(a, b)
    assert not b.flags.writeable

    other = GlobalOrder(300, 9, source=("y",), cache_dir=cache_dir)  # another file: another key
    assert other.cache_path(2) != path


def test_old_epochs_are_pruned_from_the_cache(cache_dir: Path) -> None:
    o = GlobalOrder(20, 2, cache_dir=cache_dir)
    o.indices(0, 20 * 4)  # epochs 0..3
    paths = [o.cache_path(e) for e in range(4)]
    assert [p is not None and p.exists() for p in paths] == [False, False, True, True]
    other = GlobalOrder(20, 3, cache_dir=cache_dir)  # another seed: not touched
    other.epoch(0)
    o.epoch(7)
    assert other.cache_path(0).exists()  # type: ignore[union-attr]


def test_bad_cache_file_is_ignored_and_rewritten(cache_dir: Path) -> None:
    o = GlobalOrder(50, 1, cache_dir=cache_dir)
    path = o.cache_path(0)
    assert path is not None
    cache_dir.mkdir()
    np.save(path, np.arange(49, dtype=np.int64))  # wrong length
    fresh = GlobalOrder(50, 1, cache_dir=cache_dir)
    assert np.array_equal(fresh.epoch(0), epoch_permutation(50, 1, 0))
    assert fresh.computed == 1
    path.write_bytes(b"garbage")
    again = GlobalOrder(50, 1, cache_dir=cache_dir)
    assert np.array_equal(again.epoch(0), epoch_permutation(50, 1, 0))
    assert np.load(path).shape == (50,)


# ------------------------------------------------------------------------ sharding


def test_shard_bounds_sizes_and_order() -> None:
    for g in range(1, 30):
        for w in range(1, g + 1):
            bounds = [shard_bounds(g, w, r) for r in range(w)]
            assert bounds[0][0] == 0 and bounds[-1][1] == g
            assert all(bounds[r][1] == bounds[r + 1][0] for r in range(w - 1))
            sizes = [hi - lo for lo, hi in bounds]
            assert max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)
    with pytest.raises(DataError, match="smaller than world size"):
        shard_bounds(3, 4, 0)
    with pytest.raises(DataError, match="bad rank"):
        shard_bounds(8, 4, 4)


@pytest.mark.parametrize("global_batch", [7, 12, 13])
def test_union_of_shards_is_the_global_batch_for_any_world_size(
    token_path: Path, cache_dir: Path, global_batch: int
) -> None:
    s = stream(token_path, cache_dir)
    n = s.tokens.num_samples
    # steps chosen so that some batches straddle an epoch boundary
    steps = [0, 1, n // global_batch, n // global_batch + 1, 3 * n // global_batch]
    for step in steps:
        gx, gy = s.global_batch(step, global_batch)
        assert gx.shape == (global_batch, SEQ)
        for w in range(1, 6):
            shards = [s.shard(step, global_batch, w, r) for r in range(w)]
            assert torch.equal(torch.cat([sh.x for sh in shards]), gx)
            assert torch.equal(torch.cat([sh.y for sh in shards]), gy)
            sizes = [len(sh) for sh in shards]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_global_batches_walk_the_epoch_orders(token_path: Path, cache_dir: Path, raw: bytes) -> None:
    s = stream(token_path, cache_dir)
    n, g = s.tokens.num_samples, 5
    order = np.concatenate([epoch_permutation(n, 3, e) for e in range(3)])
    for step in range(0, 2 * n // g, 7):
        x, y = s.global_batch(step, g)
        for row_x, row_y, i in zip(x, y, order[step * g : (step + 1) * g], strict=True):
            window = raw[i * SEQ : i * SEQ + SEQ + 1]
            assert bytes(row_x.tolist()) == window[:-1]
            assert bytes(row_y.tolist()) == window[1:]


def test_reads_do_not_depend_on_history_or_restarts(token_path: Path, tmp_path: Path) -> None:
    long_lived = stream(token_path, tmp_path / "c1")
    seen = [long_lived.shard(step, 9, 3, 1) for step in range(20)]
    restarted = stream(token_path, tmp_path / "c2")  # fresh process, empty cache, jumps to step 17
    sh = restarted.shard(17, 9, 3, 1)
    assert torch.equal(sh.x, seen[17].x) and torch.equal(sh.y, seen[17].y)
    uncached = stream(token_path, tmp_path / "unused", cache=False)
    assert torch.equal(uncached.shard(17, 9, 3, 1).x, sh.x)
    assert not (tmp_path / "unused").exists()
    assert not torch.equal(stream(token_path, tmp_path / "c3", seed=4).shard(17, 9, 3, 1).x, sh.x)


def test_micro_batches() -> None:
    assert split_sizes(10, 3) == [3, 3, 3, 1]
    assert split_sizes(6, 3) == [3, 3]
    assert split_sizes(2, 5) == [2]
    with pytest.raises(DataError):
        split_sizes(4, 0)


def test_shard_micro_batches_cover_the_shard(token_path: Path, cache_dir: Path) -> None:
    sh = stream(token_path, cache_dir).shard(4, 13, 2, 0)
    assert len(sh) == 7 and sh.x.shape == sh.y.shape == (7, SEQ)
    assert sh.x.is_contiguous() and sh.y.is_contiguous() and sh.x.dtype == torch.int64
    micro = sh.micro_batches(3)
    assert [m[0].shape[0] for m in micro] == [3, 3, 1]
    assert torch.equal(torch.cat([m[0] for m in micro]), sh.x)
    assert torch.equal(torch.cat([m[1] for m in micro]), sh.y)


# -------------------------------------------------------------------- DataPosition


def test_data_position_round_trips(token_path: Path, cache_dir: Path) -> None:
    s = stream(token_path, cache_dir)
    pos = s.position(41, 12)
    assert pos.consumed_samples == 492
    assert pos.epoch(s.tokens.num_samples) == 492 // s.tokens.num_samples
    assert DataPosition.from_dict(pos.to_dict()) == pos
    t = pos.to_tensor()
    assert t.dtype == torch.int64 and t.shape == (3,)
    assert DataPosition.from_tensor(t) == pos
    assert pos.advance(2).step == 43
    assert torch.equal(s.shard_at(pos, 3, 2).x, s.shard(41, 12, 3, 2).x)


def test_data_position_rejects_bad_input(token_path: Path, cache_dir: Path) -> None:
    s = stream(token_path, cache_dir)
    foreign = stream(token_path, cache_dir, seed=4).position(1, 12)
    with pytest.raises(DataError, match="fingerprint"):
        s.shard_at(foreign, 2, 0)
    s.check(DataPosition(1, 12))  # fingerprint 0: not checked
    with pytest.raises(DataError, match="unknown"):
        DataPosition.from_dict({"step": 1, "global_batch": 2, "extra": 3})
    with pytest.raises(DataError, match="lacks"):
        DataPosition.from_dict({"step": 1})
    with pytest.raises(DataError):
        DataPosition(-1, 4)
    with pytest.raises(DataError):
        DataPosition.from_tensor(torch.tensor([1, 2], dtype=torch.int64))


# ------------------------------------------------------------ prepared-batch cache


def test_prepared_batches_are_read_by_a_replacement(token_path: Path, cache_dir: Path) -> None:
    writer = stream(token_path, cache_dir, prepared_cache=True)
    paths = writer.prepare(10, 3, 13, 4, 1)
    assert [p.is_file() for p in paths] == [True] * 3

    replacement = stream(token_path, cache_dir, prepared_cache=True)
    plain = stream(token_path, cache_dir)
    for step in (10, 11, 12):
        got = replacement.shard(step, 13, 4, 1)
        want = plain.shard(step, 13, 4, 1)
        assert torch.equal(got.x, want.x) and torch.equal(got.y, want.y)
    assert replacement.prepared_hits == 3
    replacement.shard(13, 13, 4, 1)  # not prepared: gathered
    replacement.shard(10, 13, 4, 2)  # another replica: gathered
    assert replacement.prepared_hits == 3

    writer.prepare(12, 2, 13, 4, 1)  # moves on: steps 10 and 11 are dropped
    assert [p.exists() for p in paths] == [False, False, True]
    assert writer.discard_prepared(13, 4, 1) == 2


def test_prepared_cache_needs_the_file_cache(token_path: Path) -> None:
    with pytest.raises(DataError, match="cache=True"):
        DataStream.open(token_path, SEQ, 0, cache=False, prepared_cache=True)
    with pytest.raises(DataError, match="is off"):
        DataStream.open(token_path, SEQ, 0, cache=False).prepare(0, 1, 4, 1, 0)


# ---------------------------------------------------------- the example corpus


def test_corpus_is_deterministic_capped_and_idempotent(tmp_path: Path) -> None:
    from examples.corpus import build_corpus, sidecar_path

    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "site-packages").mkdir()
    (src / "b.py").write_text("print('b')\n")
    (src / "a.py").write_text("x = 1")  # no final newline
    (src / "pkg" / "c.py").write_text("y = 2\n")
    (src / "site-packages" / "z.py").write_text("skipped\n")
    (src / "notes.txt").write_text("skipped\n")
    want = b"# ---- a.py ----\nx = 1\n# ---- b.py ----\nprint('b')\n# ---- pkg/c.py ----\ny = 2\n"

    out = tmp_path / "data" / "corpus.bin"
    meta = build_corpus(out, max_bytes=1000, root=src)
    assert meta["built"] and meta["sources"] == 3 and meta["bytes"] == len(want)
    assert out.read_bytes() == want
    again = build_corpus(out, max_bytes=1000, root=src)
    assert not again["built"] and again["sha256"] == meta["sha256"]

    capped = build_corpus(tmp_path / "capped.bin", max_bytes=30, root=src)
    assert (tmp_path / "capped.bin").read_bytes() == want[:30] and capped["sources"] == 2

    out.write_bytes(b"tampered")  # the sidecar no longer describes the file: rebuilt
    assert build_corpus(out, max_bytes=1000, root=src)["built"]
    assert out.read_bytes() == want
    assert sidecar_path(out).is_file()
    assert TokenFile(out, 8).num_samples == (len(want) - 1) // 8

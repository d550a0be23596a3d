"""State packing and transfer (phalanx.runtime.state): pack/unpack round trips, a
model+AdamW hand-over, the CRC check, send_state/recv_state over a real 2-rank
gloo communicator (ranks as threads over a loopback store), and refusal of
malformed metadata and headers before anything they size is allocated; the host
flag of each tensor, both checksum kinds (CRC32 and the device-side WSUM31, both
testable on the CPU), and (skipped without GPUs) packing on CUDA and transfer over
NCCL."""

from __future__ import annotations

import itertools
import pickle
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch
from torch import nn

from phalanx.checkpoint import packing
from phalanx.checkpoint.packing import StateTransferError, checksum, pack, unpack
from phalanx.runtime import state as state_mod
from phalanx.runtime.comm import Group, arrival_barrier
from phalanx.runtime.state import recv_state, send_state
from phalanx.runtime.storeserver import ThreadedStore
from tests.stores import hosted, member

JOIN_S = 60.0
_prefixes = itertools.count()


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Same structure and container types (any dict for a dict), tensors bitwise equal
    with the same dtype and shape."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        assert a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def nested_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "f32": torch.tensor([1.5, -0.0, float("inf"), float("nan")], dtype=torch.float32),
        "nested": {
            "i64": torch.arange(-3, 5, dtype=torch.int64).reshape(2, 4),
            "list": [torch.randint(0, 256, (16,), dtype=torch.uint8, generator=g), 7, "s", None],
            "tuple": (torch.tensor([True, False] * 4), 2.5, (torch.zeros(2, 0, dtype=torch.float32),)),
        },
        "bf16": torch.randn(4, 2, generator=g).to(torch.bfloat16),
        "scalar_t": torch.tensor(42, dtype=torch.int64),
        "empty_i64": torch.empty(0, dtype=torch.int64),
        "step": 11,
        "lr": 3e-4,
        "flag": False,
        "name": "w3",
        "no_tensors": {"a": [1, (2, 3)], "b": ()},
    }


# -- pack / unpack -------------------------------------------------------------------------------


def test_pack_unpack_round_trip_nested_dtypes() -> None:
    obj = nested_state()
    meta, buf = pack(obj)
    assert isinstance(meta, bytes)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    tensors = [
        obj["f32"],
        obj["nested"]["i64"],
        obj["nested"]["list"][0],
        obj["nested"]["tuple"][0],
        obj["bf16"],
        obj["scalar_t"],
    ]
    assert buf.numel() >= sum(t.numel() * t.element_size() for t in tensors)
    assert_same(unpack(meta, buf), obj)


def test_pack_without_tensors() -> None:
    obj = {"step": 3, "xs": [1, 2], "t": (None, "a")}
    meta, buf = pack(obj)
    assert buf.numel() == 0
    assert_same(unpack(meta, buf), obj)


def test_pack_handles_non_contiguous_and_grad_tensors() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    leaf = torch.ones(3, requires_grad=True)
    meta, buf = pack({"t": base.t(), "e": torch.tensor([1.0, 2.0]).expand(3, 2), "g": leaf})
    out = unpack(meta, buf)
    assert torch.equal(out["t"], base.t())
    assert torch.equal(out["e"], torch.tensor([[1.0, 2.0]] * 3))
    assert torch.equal(out["g"], torch.ones(3)) and not out["g"].requires_grad


def test_pack_is_a_snapshot() -> None:
    t = torch.zeros(4)
    meta, buf = pack({"t": t})
    t.add_(1)
    assert torch.equal(unpack(meta, buf)["t"], torch.zeros(4))


@pytest.mark.parametrize("delta", [-1, 1])
def test_unpack_wrong_buffer_size_raises(delta: int) -> None:
    meta, buf = pack(nested_state())
    wrong = torch.zeros(buf.numel() + delta, dtype=torch.uint8)
    wrong[: min(buf.numel(), wrong.numel())] = buf[: wrong.numel()]
    with pytest.raises(StateTransferError, match="bytes"):
        unpack(meta, wrong)


@pytest.mark.parametrize("case", ["odd_bool_then_float32", "odd_bf16_then_float32", "linear_batchnorm"])
def test_unpack_at_any_preceding_size(case: str) -> None:
    """Regression: unpack views each tensor in place, which needs its offset aligned to the
    element size whatever precedes it (HEAD dd66bb2 packed tightly and raised here)."""
    obj: Any
    if case == "odd_bool_then_float32":
        obj = {"mask": torch.tensor([True, False, True]), "w": torch.arange(4, dtype=torch.float32)}
    elif case == "odd_bf16_then_float32":  # a bf16 model's odd numel, then AdamW's float32 step
        obj = {"model": {"w": torch.ones(3, dtype=torch.bfloat16)}, "opt": {"step": torch.tensor(1.0)}}
    else:  # 21 float32 values (84 bytes) precede BatchNorm's int64 num_batches_tracked
        torch.manual_seed(0)
        obj = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)).state_dict()
    meta, buf = pack(obj)
    assert_same(unpack(meta, buf), obj)


def test_checksum_detects_a_flipped_byte() -> None:
    _, buf = pack(nested_state())
    crc = checksum(buf)
    assert crc == zlib.crc32(bytes(buf.tolist()))
    assert checksum(buf.clone()) == crc
    for i in (0, buf.numel() // 2, buf.numel() - 1):
        bad = buf.clone()
        bad[i] ^= 0x01
        assert checksum(bad) != crc, i


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)


def test_model_and_adamw_hand_over_bitwise() -> None:
    torch.manual_seed(0)
    src = _model()
    src_opt = _adamw(src)
    _step(src, src_opt, seed=1)
    sent = {"model": src.state_dict(), "optimizer": src_opt.state_dict(), "step": 1}
    meta, buf = pack(sent)

    torch.manual_seed(99)  # a joiner starts from different weights
    dst = _model()
    dst_opt = _adamw(dst)
    got = unpack(meta, buf)
    assert_same(got, sent)
    dst.load_state_dict(got["model"])
    dst_opt.load_state_dict(got["optimizer"])
    for (n, p), q in zip(src.named_parameters(), dst.parameters(), strict=True):
        assert torch.equal(p, q), n

    _step(src, src_opt, seed=2)
    _step(dst, dst_opt, seed=2)
    for (n, p), q in zip(src.named_parameters(), dst.parameters(), strict=True):
        assert p.view(-1).view(torch.int32).tolist() == q.view(-1).view(torch.int32).tolist(), n
    assert_same(dst_opt.state_dict(), src_opt.state_dict())


# -- send_state / recv_state over gloo -----------------------------------------------------------


@pytest.fixture(scope="module")
def store() -> Iterator[ThreadedStore]:
    s = hosted("test-state", "test-state-nccl")
    yield s
    s.close()


def run_pair(store: ThreadedStore, fn: Callable[[Group], Any]) -> list[Any]:
    """Build a fresh 2-rank communicator (each rank its own store client) and run ``fn`` per rank."""
    prefix = f"test-state/{next(_prefixes)}"
    results: list[Any] = [None, None]

    def body(r: int) -> None:
        try:
            client = member(store, "test-state")
            arrival_barrier(client, prefix, r, 2, lambda: False, timeout_s=JOIN_S)
            comm = Group(client, prefix, r, 2, timeout_s=JOIN_S)
            try:
                results[r] = fn(comm)
            finally:
                comm.destroy()
        except BaseException as exc:
            results[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a rank is still blocked"
    return results


def test_send_recv_state_round_trip(store: ThreadedStore) -> None:
    sent = nested_state()
    meta, buf = pack(sent)

    def rank(comm: Group) -> Any:
        if comm.rank == 0:
            send_state(comm, meta, buf, checksum(buf), dst=1)
            return "sent"
        return recv_state(comm, src=0)

    res = run_pair(store, rank)
    assert res[0] == "sent"
    got, nbytes = res[1]
    assert nbytes == buf.numel()
    assert_same(got, sent)


def test_send_recv_state_without_tensors(store: ThreadedStore) -> None:
    sent = {"step": 5, "data": {"epoch": 0}}
    meta, buf = pack(sent)

    def rank(comm: Group) -> Any:
        if comm.rank == 0:
            return send_state(comm, meta, buf, checksum(buf), dst=1)
        return recv_state(comm, src=0)

    res = run_pair(store, rank)
    assert res == [None, (sent, 0)]


def test_recv_state_rejects_a_wrong_crc_in_the_header(store: ThreadedStore) -> None:
    meta, buf = pack(nested_state())
    bad_crc = checksum(buf) ^ 0x10

    def rank(comm: Group) -> Any:
        if comm.rank == 0:
            return send_state(comm, meta, buf, bad_crc, dst=1)
        return recv_state(comm, src=0)

    res = run_pair(store, rank)
    assert res[0] is None
    assert isinstance(res[1], StateTransferError), res[1]
    assert "checksum mismatch from rank 0" in str(res[1])


def test_recv_state_rejects_a_corrupted_payload(store: ThreadedStore) -> None:
    """Header and meta are right; one byte of the buffer flips on the wire."""
    meta, buf = pack(nested_state())
    crc = checksum(buf)
    bad = buf.clone()
    bad[buf.numel() // 3] ^= 0x80

    def rank(comm: Group) -> Any:
        if comm.rank == 0:
            header = state_mod._encode_header(len(meta), buf.numel(), zlib.crc32(meta), crc)
            comm.send(header, 1, state_mod._TAG_HEADER)
            comm.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), 1, state_mod._TAG_META)
            comm.send(bad, 1, state_mod._TAG_BUF)
            return None
        return recv_state(comm, src=0)

    res = run_pair(store, rank)
    assert res[0] is None
    assert isinstance(res[1], StateTransferError), res[1]


# -- what real training state holds, kept exactly ------------------------------------------------


def assert_identical(a: Any, b: Any, path: str = "") -> None:
    """Like :func:`assert_same` but container types must match exactly (an OrderedDict
    stays one, with the same ``_metadata``; a tuple stays a tuple; int keys stay ints)."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        assert [type(k) for k in a] == [type(k) for k in b], path
        for k in a:
            assert_identical(a[k], b[k], f"{path}.{k}")
        if hasattr(a, "_metadata"):
            assert_identical(a._metadata, b._metadata, f"{path}._metadata")
        else:
            assert not hasattr(b, "_metadata"), path
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, (path, a, b)


def trainer_state(opt_cls: type[torch.optim.Optimizer] = torch.optim.AdamW) -> dict[str, Any]:
    """What Trainer.state_dict sends: step, model, optimizer, RNG, data position."""
    from phalanx.runtime.data import DataPosition

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.LayerNorm(8), nn.Linear(8, 3))
    opt = (
        _adamw(model)
        if opt_cls is torch.optim.AdamW
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    _step(model, opt, seed=1)
    return {
        "step": 1,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "gen": torch.Generator().manual_seed(5).get_state()},
        "data": DataPosition(1, 32, 2**63 - 1).to_dict(),
    }


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_trainer_state_round_trips_exactly(opt_cls: type[torch.optim.Optimizer]) -> None:
    sent = trainer_state(opt_cls)
    meta, buf = pack(sent)
    got = unpack(meta, buf)
    assert_identical(got, sent)
    assert type(got["model"]) is OrderedDict and got["model"]._metadata == sent["model"]._metadata
    assert all(type(k) is int for k in got["optimizer"]["state"])
    if opt_cls is torch.optim.AdamW:
        assert got["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.95)
        assert type(got["optimizer"]["param_groups"][0]["betas"]) is tuple
    torch.set_rng_state(got["rng"]["torch"].clone())
    assert torch.equal(torch.get_rng_state(), sent["rng"]["torch"])


def test_unpack_returns_views_into_the_buffer() -> None:
    meta, buf = pack({"a": torch.ones(3, dtype=torch.bool), "w": torch.arange(5.0)})
    got = unpack(meta, buf)
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    assert all(lo <= t.data_ptr() < hi and t.data_ptr() % 16 == 0 for t in got.values())


def test_unpack_from_an_unaligned_buffer() -> None:
    meta, buf = pack({"w": torch.arange(5.0), "i": torch.arange(3)})
    shifted = torch.zeros(buf.numel() + 1, dtype=torch.uint8)
    shifted[1:] = buf
    assert_identical(unpack(meta, shifted[1:]), unpack(meta, buf))


def test_dtype_device_size_and_scalars_round_trip() -> None:
    sent = {
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "scalars": [None, True, -(2**63), 2**64 - 1, float("nan"), -0.0, "é", b"\x00\xff"],
        "int_keys": {3: "a", -1: "b", "k": 0},
        "nested": ((), [()], {}),
    }
    meta, buf = pack(sent)
    got = unpack(meta, buf)
    assert_identical(got, sent)
    assert type(got["size"]) is torch.Size


class _Thing:
    pass


@pytest.mark.parametrize(
    ("obj", "where"),
    [
        ({"optimizer": {"state": {3: {"step": _Thing()}}}}, "optimizer.state.3.step"),
        ({"a": [1, {2}]}, "a.1"),
        ({"a": {(1, 2): 0}}, "'a'"),
        ({"big": 2**64}, "big"),
        ({"np": [__import__("numpy").int64(3)]}, "np.0"),
        ({"f": lambda: 0}, "f"),
        ({"q": torch.zeros(2).to_sparse()}, "q"),
        ({"c": torch.zeros(2, dtype=torch.bits8)}, "c"),
    ],
)
def test_pack_refuses_what_it_cannot_represent(obj: Any, where: str) -> None:
    with pytest.raises(TypeError, match=f"cannot pack .*{where}"):
        pack(obj)


def test_pack_refuses_excessive_depth_and_cycles() -> None:
    deep: list[Any] = []
    for _ in range(packing.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(StateTransferError, match="deeper"):
        pack(deep)
    cyc: list[Any] = []
    cyc.append(cyc)
    with pytest.raises(StateTransferError, match="deeper"):
        pack({"x": cyc})


# -- unpack refuses malformed metadata -----------------------------------------------------------


def tampered(change: Callable[[dict[str, Any]], Any]) -> tuple[bytes, torch.Tensor]:
    """A valid packed state whose decoded metadata ``change`` edits in place."""
    meta, buf = pack({"a": torch.arange(6, dtype=torch.int64).reshape(2, 3), "b": torch.ones(3)})
    doc = msgpack.unpackb(meta)
    change(doc)
    return msgpack.packb(doc, use_bin_type=True), buf


def _set(doc: dict[str, Any], table_i: int, field: int, value: Any) -> None:
    doc["tensors"][table_i][field] = value


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d.update(v=1), "unsupported state format version 1"),  # the format before "host"
        (lambda d: d.update(v=3), "unsupported state format version 3"),
        (lambda d: d.update(extra=1), "not a state description"),
        (lambda d: _set(d, 0, 0, "object"), "dtype 'object' is not allowed"),
        (lambda d: _set(d, 0, 0, "qint8"), "dtype 'qint8' is not allowed"),
        (lambda d: _set(d, 0, 1, [2, 4]), "needs 64"),
        (lambda d: _set(d, 0, 1, [-2, -3]), "bad shape"),
        (lambda d: _set(d, 0, 3, 40), "40 bytes for shape"),
        (lambda d: _set(d, 1, 2, 1 << 40), "outside the 64-byte buffer"),
        (lambda d: _set(d, 1, 3, 1 << 40), "outside the 64-byte buffer"),
        (lambda d: _set(d, 1, 2, -16), "bad span"),
        (lambda d: _set(d, 1, 3, -4), "bad span"),
        (lambda d: _set(d, 1, 2, 50), "not 16-byte aligned"),
        (lambda d: _set(d, 1, 2, 0), "expected 48"),
        (lambda d: d["tensors"].pop(), "tensors end at byte 48"),
        (lambda d: _set(d, 0, 2, True), "bad span"),
        (lambda d: d["tree"][2].__setitem__(1, ["tensor", 2]), "no tensor 2 among 2"),
        (lambda d: d["tree"][2].__setitem__(1, ["tensor", -1]), "no tensor -1"),
        (lambda d: d["tree"][2].__setitem__(1, ["pickle", "x"]), "unknown state node tag"),
        (lambda d: d["tree"][2].__setitem__(1, {"a": 1}), "malformed state node at 'b'"),
        (lambda d: d["tree"][2].__setitem__(1, ["dtype", "object"]), "dtype not allowed"),
        (lambda d: d["tree"][2].__setitem__(1, ["device", "nowhere:7"]), "unknown device"),
        (lambda d: d["tree"].__setitem__(1, ["a", "a"]), "duplicate key 'a'"),
        (lambda d: d["tree"].__setitem__(1, [["a"], "b"]), "key of type list"),
        (lambda d: d["tree"].__setitem__(1, ["a"]), "1 keys for 2 values"),
    ],
)
def test_unpack_refuses_malformed_metadata(change: Callable[[dict[str, Any]], Any], match: str) -> None:
    meta, buf = tampered(change)
    with pytest.raises(StateTransferError, match=match):
        unpack(meta, buf)


def test_unpack_refuses_excessive_depth() -> None:
    node: Any = 1
    for _ in range(packing.MAX_DEPTH + 1):
        node = ["list", [node]]
    meta = msgpack.packb({"v": packing.VERSION, "size": 0, "tensors": [], "tree": node})
    with pytest.raises(StateTransferError, match="deeper than"):
        unpack(meta, torch.empty(0, dtype=torch.uint8))


def test_unpack_refuses_too_many_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    meta, buf = pack([torch.ones(1)] * 3)
    monkeypatch.setattr(packing, "MAX_TENSORS", 2)
    with pytest.raises(StateTransferError, match="at most 2"):
        unpack(meta, buf)
    with pytest.raises(StateTransferError, match="more than 2 tensors"):
        pack([torch.ones(1)] * 3)


def test_unpack_refuses_oversize_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    meta, buf = pack({"w": torch.ones(2), "names": ["x" * 100] * 10})
    monkeypatch.setattr(packing, "MAX_META_BYTES", len(meta) - 1)
    with pytest.raises(StateTransferError, match="over"):
        unpack(meta, buf)


@pytest.mark.parametrize(
    "meta",
    [
        pickle.dumps({"v": 1, "size": 0, "tensors": [], "tree": None}),
        pickle.dumps((None, [], 0), protocol=2),
        b"",
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb({"v": 1, "size": 0, "tensors": [], "tree": msgpack.ExtType(5, b"x")}),
    ],
)
def test_unpack_refuses_non_msgpack_or_foreign_metadata(meta: bytes) -> None:
    with pytest.raises(StateTransferError, match=r"msgpack|not a state description"):
        unpack(meta, torch.empty(0, dtype=torch.uint8))


# -- the header: checked before anything it sizes is allocated -----------------------------------


def header_bytes(**kw: Any) -> bytes:
    fields = {
        "magic": b"PHXS",
        "version": packing.VERSION,
        "flags": 0,
        "meta_len": 10,
        "buf_len": 32,
        "mcrc": 0,
        "bcrc": 0,
    }
    fields.update(kw)
    return state_mod._HEADER.pack(*fields.values())


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"magic": b"\x80\x05\x95\x00"}, "not a state header"),
        ({"version": 1}, "unsupported state format version 1"),
        ({"version": 3}, "unsupported state format version 3"),
        ({"flags": 2}, "flags 0x2"),
        ({"flags": 0x8001}, "flags 0x8001"),
        ({"meta_len": (64 << 20) + 1}, "metadata length 67108865"),
        ({"meta_len": 0}, "metadata length 0"),
        ({"meta_len": -1}, "metadata length -1"),
        ({"buf_len": 4096 + 16}, "buffer length 4112 .* outside \\[0, 4096\\]"),
        ({"buf_len": 1 << 62}, "buffer length"),
        ({"buf_len": -16}, "buffer length -16"),
        ({"buf_len": 33}, "not a multiple of 16"),
    ],
)
def test_parse_header_refuses(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(StateTransferError, match=match):
        state_mod._parse_header(header_bytes(**kw), 4096, src=0)


def test_parse_header_accepts_a_good_one_and_the_wire_size_is_fixed() -> None:
    assert state_mod._HEADER.size == 32
    assert state_mod._parse_header(header_bytes(), 4096, src=0) == (10, 32, 0, 0, "crc32")
    assert state_mod._parse_header(header_bytes(flags=1), 4096, src=0) == (10, 32, 0, 0, "wsum31")


def test_buffer_limit_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(state_mod.MAX_BUFFER_BYTES_ENV, raising=False)
    assert state_mod.max_buffer_bytes() == 64 << 30
    monkeypatch.setenv(state_mod.MAX_BUFFER_BYTES_ENV, "1024")
    assert state_mod.max_buffer_bytes() == 1024
    for bad in ("lots", "-1"):
        monkeypatch.setenv(state_mod.MAX_BUFFER_BYTES_ENV, bad)
        with pytest.raises(ValueError, match=state_mod.MAX_BUFFER_BYTES_ENV):
            state_mod.max_buffer_bytes()


class FakeComm:
    """Plays back queued messages and records each recv's tag and size."""

    device = torch.device("cpu")

    def __init__(self, messages: list[bytes]) -> None:
        self.messages = list(messages)
        self.recvs: list[tuple[int, int]] = []

    def recv(self, t: torch.Tensor, src: int, tag: int = 0, timeout_s: float | None = None) -> None:
        self.recvs.append((tag, t.numel()))
        data = self.messages.pop(0)
        assert len(data) == t.numel()
        t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else t)


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Byte sizes of every torch.empty / torch.zeros call while the test runs."""
    sizes: list[int] = []
    for name in ("empty", "zeros"):
        real = getattr(torch, name)

        def spy(*args: Any, _real: Any = real, **kw: Any) -> torch.Tensor:
            t = _real(*args, **kw)
            sizes.append(t.numel() * t.element_size())
            return t

        monkeypatch.setattr(torch, name, spy)
    return sizes


@pytest.mark.parametrize(
    "kw",
    [{"buf_len": 1 << 62}, {"buf_len": -16}, {"meta_len": 1 << 40}, {"meta_len": -1}, {"magic": b"XXXX"}],
)
def test_recv_state_refuses_a_bad_header_before_allocating(
    kw: dict[str, Any], allocations: list[int]
) -> None:
    comm = FakeComm([header_bytes(**kw)])
    with pytest.raises(StateTransferError):
        recv_state(comm, src=0)  # type: ignore[arg-type]
    assert comm.recvs == [(state_mod._TAG_HEADER, 32)]
    assert allocations == [32]


def test_recv_state_honours_max_bytes(allocations: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    meta, buf = pack({"w": torch.ones(64)})
    allocations.clear()
    wire = [bytes(state_mod._encode_header(len(meta), buf.numel(), zlib.crc32(meta), checksum(buf)).tolist())]
    with pytest.raises(StateTransferError, match="outside \\[0, 255\\]"):
        recv_state(FakeComm(wire), src=0, max_bytes=255)  # type: ignore[arg-type]
    monkeypatch.setenv(state_mod.MAX_BUFFER_BYTES_ENV, "255")
    with pytest.raises(StateTransferError, match=state_mod.MAX_BUFFER_BYTES_ENV):
        recv_state(FakeComm(wire), src=0)  # type: ignore[arg-type]
    assert allocations == [32, 32]
    got, n = recv_state(FakeComm([*wire, meta, bytes(buf.tolist())]), src=0, max_bytes=256)  # type: ignore[arg-type]
    assert n == 256 and torch.equal(got["w"], torch.ones(64))


def test_recv_state_checks_metadata_before_allocating_the_buffer(allocations: list[int]) -> None:
    """A header promising a big buffer, with metadata that does not describe it: the
    metadata is read (its size is bounded) and refused; the buffer is never allocated."""
    meta, _ = pack({"w": torch.ones(4)})
    allocations.clear()
    big = 1 << 36
    comm = FakeComm([header_bytes(meta_len=len(meta), buf_len=big, mcrc=zlib.crc32(meta)), meta])
    with pytest.raises(StateTransferError, match=f"buffer holds {big} bytes"):
        recv_state(comm, src=0)  # type: ignore[arg-type]
    assert comm.recvs == [(state_mod._TAG_HEADER, 32), (state_mod._TAG_META, len(meta))]
    assert allocations == [32, len(meta)]


def test_recv_state_refuses_corrupted_metadata(allocations: list[int]) -> None:
    meta, buf = pack({"w": torch.ones(4)})
    bad = bytearray(meta)
    bad[-1] ^= 0x01
    allocations.clear()
    head = header_bytes(meta_len=len(meta), buf_len=buf.numel(), mcrc=zlib.crc32(meta), bcrc=checksum(buf))
    comm = FakeComm([head, bytes(bad)])
    with pytest.raises(StateTransferError, match="metadata checksum mismatch from rank 0"):
        recv_state(comm, src=0)  # type: ignore[arg-type]
    assert allocations == [32, len(meta)]


# -- malformed input over a real gloo communicator -----------------------------------------------


def test_send_recv_trainer_state_over_gloo(store: ThreadedStore) -> None:
    sent = trainer_state()
    meta, buf = pack(sent)

    def rank(comm: Group) -> Any:
        if comm.rank == 0:
            return send_state(comm, meta, buf, checksum(buf), dst=1)
        return recv_state(comm, src=0)

    res = run_pair(store, rank)
    assert res[0] is None
    got, nbytes = res[1]
    assert nbytes == buf.numel()
    assert_identical(got, sent)


@pytest.mark.parametrize(
    "kw", [{"buf_len": 1 << 62}, {"buf_len": -16}, {"meta_len": 1 << 40}, {"magic": b"\x80\x05\x95\x00"}]
)
def test_recv_state_over_gloo_refuses_a_malformed_header_before_allocating(
    store: ThreadedStore, kw: dict[str, Any], allocations: list[int]
) -> None:
    received: list[int] = []

    def rank(comm: Group) -> Any:
        if comm.rank == 0:
            comm.send(
                torch.frombuffer(bytearray(header_bytes(**kw)), dtype=torch.uint8), 1, state_mod._TAG_HEADER
            )
            return None
        real_recv = comm.recv

        def recv(t: torch.Tensor, src: int, tag: int = 0, timeout_s: float | None = None) -> None:
            received.append(tag)
            real_recv(t, src, tag, timeout_s)

        comm.recv = recv  # type: ignore[method-assign]
        return recv_state(comm, src=0)

    res = run_pair(store, rank)
    assert res[0] is None
    assert isinstance(res[1], StateTransferError), res[1]
    assert received == [state_mod._TAG_HEADER]
    assert max(allocations, default=0) < 1 << 20, allocations


def test_recv_state_over_gloo_refuses_a_pickle_payload(store: ThreadedStore) -> None:
    """Header and CRC are right, but the metadata is a pickle: refused, never loaded, and
    the buffer it announces is never received."""
    evil = pickle.dumps((None, [], 16))
    head = header_bytes(meta_len=len(evil), buf_len=16, mcrc=zlib.crc32(evil))
    received: list[int] = []

    def rank(comm: Group) -> Any:
        if comm.rank == 0:
            comm.send(torch.frombuffer(bytearray(head), dtype=torch.uint8), 1, state_mod._TAG_HEADER)
            comm.send(torch.frombuffer(bytearray(evil), dtype=torch.uint8), 1, state_mod._TAG_META)
            return None
        real_recv = comm.recv

        def recv(t: torch.Tensor, src: int, tag: int = 0, timeout_s: float | None = None) -> None:
            received.append(tag)
            real_recv(t, src, tag, timeout_s)

        comm.recv = recv  # type: ignore[method-assign]
        return recv_state(comm, src=0)

    res = run_pair(store, rank)
    assert res[0] is None
    assert isinstance(res[1], StateTransferError) and "msgpack" in str(res[1]), res[1]
    assert received == [state_mod._TAG_HEADER, state_mod._TAG_META]


# -- devices: the host flag, the checksum kinds, the device path ---------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def wsum31_reference(data: bytes) -> int:
    """The documented WSUM31 formula, in plain Python."""
    p = (1 << 31) - 1
    padded = data + b"\0" * (-len(data) % 4)
    words = [int.from_bytes(padded[i : i + 4], "little") for i in range(0, len(padded), 4)]
    return sum(x * (i % (1 << 30) + 1) for i, x in enumerate(words)) % p


def test_metadata_marks_cpu_tensors_as_host() -> None:
    meta, buf = pack({"a": torch.ones(3), "b": [torch.arange(2)], "n": 1})
    doc = msgpack.unpackb(meta)
    assert doc["v"] == packing.VERSION == 2
    assert [e[4] for e in doc["tensors"]] == [True, True]
    meta2, buf2 = pack({"a": torch.ones(3), "b": [torch.arange(2)], "n": 1}, torch.device("cpu"))
    assert meta2 == meta and torch.equal(buf2, buf)


def test_device_tensors_of_a_cpu_buffer_come_back_as_views() -> None:
    """A tensor that was on a device at the sender (host false) is a view into the
    receiver's buffer wherever that is -- here on the CPU."""
    meta, buf = tampered(lambda d: [e.__setitem__(4, False) for e in d["tensors"]])
    got = unpack(meta, buf)
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    assert all(lo <= t.data_ptr() < hi for t in got.values())
    assert torch.equal(got["a"], torch.arange(6).reshape(2, 3)) and got["a"].device.type == "cpu"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: _set(d, 0, 4, 1), "host flag 1 is not a bool"),
        (lambda d: _set(d, 1, 4, None), "host flag None is not a bool"),
        (lambda d: d["tensors"][0].pop(), "entry is not"),
        (lambda d: d["tensors"][0].append(True), "entry is not"),
    ],
)
def test_unpack_refuses_a_bad_host_flag(change: Callable[[dict[str, Any]], Any], match: str) -> None:
    meta, buf = tampered(change)
    with pytest.raises(StateTransferError, match=match):
        unpack(meta, buf)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 16, 17, 255, 1024, 4099])
def test_wsum31_matches_the_documented_formula(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    assert checksum(buf, kind=packing.WSUM31) == wsum31_reference(bytes(buf.tolist()))
    assert checksum(buf, kind=packing.CRC32) == zlib.crc32(bytes(buf.tolist())) == checksum(buf)


def test_wsum31_over_many_chunks_and_unaligned_views(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packing, "_WSUM_CHUNK", 4)  # 4 words a step: many steps, same sum
    g = torch.Generator().manual_seed(1)
    big = torch.randint(0, 256, (1001,), dtype=torch.uint8, generator=g)
    big[:64] = 255  # words of 0xFFFFFFFF: the largest products
    for view in (big, big[1:], big[3:998]):
        assert checksum(view, kind="wsum31") == wsum31_reference(bytes(view.tolist()))


@pytest.mark.parametrize("kind", ["crc32", "wsum31"])
def test_both_checksums_catch_every_flipped_byte(kind: str) -> None:
    _, buf = pack(nested_state())
    good = checksum(buf, kind=kind)
    assert checksum(buf.clone(), kind=kind) == good
    for i in range(buf.numel()):
        for bit in (0x01, 0x80):
            bad = buf.clone()
            bad[i] ^= bit
            assert checksum(bad, kind=kind) != good, (i, bit)


def test_wsum31_depends_on_word_order() -> None:
    buf = torch.arange(64, dtype=torch.uint8)
    swapped = buf.view(torch.int32).flip(0).contiguous().view(torch.uint8)
    assert checksum(buf, kind="wsum31") != checksum(swapped, kind="wsum31")


def test_checksum_kinds_and_defaults() -> None:
    assert packing.default_checksum_kind(torch.device("cpu")) == "crc32"
    assert packing.default_checksum_kind(torch.device("cuda", 0)) == "wsum31"
    with pytest.raises(ValueError, match="unknown checksum kind"):
        checksum(torch.zeros(4, dtype=torch.uint8), kind="md5")
    with pytest.raises(ValueError, match="unknown checksum kind"):
        state_mod._encode_header(1, 16, 0, 0, "md5")


def test_header_flags_name_the_checksum_kind() -> None:
    for kind, flags in (("crc32", 0), ("wsum31", 1)):
        raw = bytes(state_mod._encode_header(10, 32, 7, 9, kind).tolist())
        assert state_mod._HEADER.unpack(raw)[2] == flags
        assert state_mod._parse_header(raw, 4096, src=0) == (10, 32, 7, 9, kind)


@pytest.mark.parametrize("kind", ["crc32", "wsum31"])
def test_send_recv_state_with_either_checksum_over_gloo(store: ThreadedStore, kind: str) -> None:
    sent = trainer_state()
    meta, buf = pack(sent)

    def rank(comm: Group) -> Any:
        if comm.rank == 0:
            return send_state(comm, meta, buf, checksum(buf, kind), 1, kind=kind)
        return recv_state(comm, src=0)

    res = run_pair(store, rank)
    assert res[0] is None
    got, nbytes = res[1]
    assert nbytes == buf.numel()
    assert_identical(got, sent)


def test_recv_state_verifies_with_the_kind_the_header_names(store: ThreadedStore) -> None:
    """A WSUM31 checksum sent as if it were a CRC32 (flags 0) is refused: the
    receiver verifies with the kind the header names, not the one it would pick."""
    meta, buf = pack(nested_state())

    def rank(comm: Group) -> Any:
        if comm.rank == 0:
            return send_state(comm, meta, buf, checksum(buf, "wsum31"), 1, kind="crc32")
        return recv_state(comm, src=0)

    res = run_pair(store, rank)
    assert isinstance(res[1], StateTransferError) and "checksum mismatch" in str(res[1]), res[1]


def test_recv_state_wsum31_catches_a_corrupted_payload() -> None:
    meta, buf = pack({"w": torch.arange(64, dtype=torch.float32)})
    crc = checksum(buf, "wsum31")
    bad = buf.clone()
    bad[77] ^= 0x04
    head = bytes(state_mod._encode_header(len(meta), buf.numel(), zlib.crc32(meta), crc, "wsum31").tolist())
    with pytest.raises(StateTransferError, match="checksum mismatch from rank 0"):
        recv_state(FakeComm([head, meta, bytes(bad.tolist())]), src=0)  # type: ignore[arg-type]
    got, _ = recv_state(FakeComm([head, meta, bytes(buf.tolist())]), src=0)  # type: ignore[arg-type]
    assert torch.equal(got["w"], torch.arange(64, dtype=torch.float32))


# -- real CUDA (skipped without GPUs) ------------------------------------------------------------


def cuda_state(device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Linear(8, 3)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # step: a CPU tensor per parameter
    x = torch.randn(4, 5, device=device)
    model(x).square().mean().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device)},
        "odd": torch.ones(3, dtype=torch.bfloat16, device=device),
        "step": 1,
    }


def assert_devices(got: Any, sent: Any, device: torch.device) -> None:
    if isinstance(sent, torch.Tensor):
        want = torch.device("cpu") if sent.device.type == "cpu" else device
        assert got.device == want, (got.device, want)
        assert torch.equal(got.cpu().reshape(-1).view(torch.uint8), sent.cpu().reshape(-1).view(torch.uint8))
    elif isinstance(sent, dict):
        for k in sent:
            assert_devices(got[k], sent[k], device)
    elif isinstance(sent, list | tuple):
        for a, b in zip(got, sent, strict=True):
            assert_devices(a, b, device)


@needs_cuda
def test_pack_on_cuda_keeps_device_types_bitwise() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    sent = cuda_state(dev)
    meta, buf = pack(sent, dev)
    assert buf.device == dev
    assert checksum(buf) == checksum(buf, "wsum31") == checksum(buf.cpu(), "wsum31")
    got = unpack(meta, buf)
    assert_devices(got, sent, dev)
    assert all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in got["rng"].values())
    meta_cpu, buf_cpu = pack(sent)  # the CPU-staged path holds the same bytes
    assert torch.equal(buf_cpu, buf.cpu())
    assert_devices(unpack(meta_cpu, buf_cpu), sent, torch.device("cpu"))


@needs_2_gpus
def test_send_recv_state_over_nccl(store: ThreadedStore) -> None:
    sent = cuda_state(torch.device("cuda", 0))
    prefix = f"test-state-nccl/{next(_prefixes)}"
    results: list[Any] = [None, None]

    def body(r: int) -> None:
        try:
            torch.cuda.set_device(r)
            dev = torch.device("cuda", r)
            client = member(store, "test-state-nccl")
            arrival_barrier(client, prefix, r, 2, lambda: False, timeout_s=JOIN_S)
            comm = Group(client, prefix, r, 2, timeout_s=JOIN_S, device=dev)
            try:
                if r == 0:
                    meta, buf = pack(sent, dev)
                    send_state(comm, meta, buf, checksum(buf), 1)
                else:
                    results[1] = recv_state(comm, src=0)
            finally:
                comm.destroy()
        except BaseException as exc:
            results[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert results[0] is None, results[0]
    got, _ = results[1]
    assert_devices(got, sent, torch.device("cuda", 1))

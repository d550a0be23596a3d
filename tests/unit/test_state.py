"""State packing and transfer (phalanx.runtime.state): pack/unpack round trips, a
model+AdamW hand-over, the CRC check, and send_state/recv_state over a real
2-rank gloo communicator (ranks as threads over a loopback TCPStore)."""

from __future__ import annotations

import itertools
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from phalanx.runtime import state as state_mod
from phalanx.runtime.comm import Communicator, arrival_barrier, connect_store, host_store
from phalanx.runtime.state import StateTransferError, checksum, pack, recv_state, send_state, unpack

JOIN_S = 60.0
_prefixes = itertools.count()


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Same structure and container types (any dict for a dict: pack makes an OrderedDict
    a plain dict), tensors bitwise equal with the same dtype and shape."""
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
def store() -> Iterator[dist.TCPStore]:
    yield host_store()


def run_pair(store: dist.TCPStore, fn: Callable[[Communicator], Any]) -> list[Any]:
    """Build a fresh 2-rank communicator (each rank its own store client) and run ``fn`` per rank."""
    prefix = f"test-state/{next(_prefixes)}"
    results: list[Any] = [None, None]

    def body(r: int) -> None:
        try:
            client = connect_store(f"127.0.0.1:{store.port}")
            arrival_barrier(client, prefix, r, 2, lambda: False, timeout_s=JOIN_S)
            comm = Communicator(client, prefix, r, 2, timeout_s=JOIN_S)
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


def test_send_recv_state_round_trip(store: dist.TCPStore) -> None:
    sent = nested_state()
    meta, buf = pack(sent)

    def rank(comm: Communicator) -> Any:
        if comm.rank == 0:
            send_state(comm, meta, buf, checksum(buf), dst=1)
            return "sent"
        return recv_state(comm, src=0)

    res = run_pair(store, rank)
    assert res[0] == "sent"
    got, nbytes = res[1]
    assert nbytes == buf.numel()
    assert_same(got, sent)


def test_send_recv_state_without_tensors(store: dist.TCPStore) -> None:
    sent = {"step": 5, "data": {"epoch": 0}}
    meta, buf = pack(sent)

    def rank(comm: Communicator) -> Any:
        if comm.rank == 0:
            return send_state(comm, meta, buf, checksum(buf), dst=1)
        return recv_state(comm, src=0)

    res = run_pair(store, rank)
    assert res == [None, (sent, 0)]


def test_recv_state_rejects_a_wrong_crc_in_the_header(store: dist.TCPStore) -> None:
    meta, buf = pack(nested_state())
    bad_crc = checksum(buf) ^ 0x10

    def rank(comm: Communicator) -> Any:
        if comm.rank == 0:
            return send_state(comm, meta, buf, bad_crc, dst=1)
        return recv_state(comm, src=0)

    res = run_pair(store, rank)
    assert res[0] is None
    assert isinstance(res[1], StateTransferError), res[1]
    assert "checksum mismatch from rank 0" in str(res[1])


def test_recv_state_rejects_a_corrupted_payload(store: dist.TCPStore) -> None:
    """Header and meta are right; one byte of the buffer flips on the wire."""
    meta, buf = pack(nested_state())
    crc = checksum(buf)
    bad = buf.clone()
    bad[buf.numel() // 3] ^= 0x80

    def rank(comm: Communicator) -> Any:
        if comm.rank == 0:
            comm.send(
                torch.tensor([len(meta), buf.numel(), crc], dtype=torch.int64), 1, state_mod._TAG_HEADER
            )
            comm.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), 1, state_mod._TAG_META)
            comm.send(bad, 1, state_mod._TAG_BUF)
            return None
        return recv_state(comm, src=0)

    res = run_pair(store, rank)
    assert res[0] is None
    assert isinstance(res[1], StateTransferError), res[1]

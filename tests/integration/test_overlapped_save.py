"""Overlapped saves (phalanx.checkpoint.overlap): the slot holds the bytes of the state at
``save_async`` time while the next forward, backward and optimizer step run -- the
optimizer's step fenced by ``Checkpointer.guard`` -- on a real shared-memory slot."""

from __future__ import annotations

import copy
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx.checkpoint.overlap as overlap
from phalanx.checkpoint import Checkpointer
from phalanx.checkpoint.packing import unpack
from phalanx.checkpoint.slots import SlotFile, SlotState, Written


@pytest.fixture
def shm() -> Iterator[Path]:
    root = Path(f"/dev/shm/phalanx-test-overlap-{uuid.uuid4().hex[:8]}")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def model_and_optimizer(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.BatchNorm1d(512))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(64, 512)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def slot_state(written: Written) -> Any:
    f = SlotFile(written.path)
    try:
        h = f.header()
        assert h.state is SlotState.READY and h.step == written.step and h.seq == written.seq
        return copy.deepcopy(unpack(h.meta, f.tensor()[h.data_offset : h.data_offset + h.data_len].clone()))
    finally:
        f.close()


def assert_same(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8))
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_same(a, b)
    else:
        assert got == want


def state_of(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}


def test_each_overlapped_save_holds_the_state_of_its_step_while_training_goes_on(shm: Path) -> None:
    model, opt = model_and_optimizer()
    train_step(model, opt)  # Adam's moments exist: they are state too
    ckpt = Checkpointer("j1", node="n1", worker="w0", root=shm, slots=8)
    ckpt.guard(opt)
    saved: list[tuple[overlap.PendingSave, dict[str, Any]]] = []
    try:
        for step in range(1, 6):
            want = copy.deepcopy(state_of(model, opt, step))  # a synchronous copy, for comparison
            pending = ckpt.save_async(state_of(model, opt, step), step)
            assert pending is not None
            saved.append((pending, want))
            train_step(model, opt)  # the forward writes BatchNorm's buffers; the step, fenced, the rest
        for pending, want in saved:
            written = pending.result(timeout_s=60)
            assert written is not None and pending.error is None
            assert_same(slot_state(written), want)
        # the state did change under the saves: the comparison means something
        assert not torch.equal(model[0].weight, saved[0][1]["model"]["0.weight"])
    finally:
        ckpt.close()


def test_the_fence_copies_what_the_copier_has_not_started_before_the_optimizer_changes_it(
    shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copier thread is held back: without the fence the optimizer's step would
    change every tensor before a byte of it was copied, and the slot would hold the
    next step's weights. With it, the training thread copies every piece itself."""
    monkeypatch.setattr(overlap, "PIECE", 64 << 10)  # many pieces
    hold = threading.Event()
    run = overlap.Copier._run

    def held_run(self: overlap.Copier) -> None:
        hold.wait(30)
        run(self)

    monkeypatch.setattr(overlap.Copier, "_run", held_run)
    model, opt = model_and_optimizer(1)
    train_step(model, opt)
    ckpt = Checkpointer("j1", node="n1", worker="w0", root=shm)
    ckpt.guard(opt)
    try:
        want = copy.deepcopy(state_of(model, opt, 7))
        pending = ckpt.save_async(state_of(model, opt, 7), 7)
        assert pending is not None and len(pending.pieces) > 10
        train_step(model, opt)
        assert pending.fenced_s > 0  # the step waited for, and did, the copy
        hold.set()
        written = pending.result(timeout_s=60)
        assert written is not None
        assert_same(slot_state(written), want)
    finally:
        hold.set()
        ckpt.close()


def test_a_save_after_an_unfinished_one_waits_for_it_and_takes_another_slot(shm: Path) -> None:
    model, opt = model_and_optimizer(2)
    ckpt = Checkpointer("j1", node="n1", worker="w0", root=shm, slots=3)
    try:
        first = ckpt.save_async(state_of(model, opt, 1), 1)
        second = ckpt.save_async(state_of(model, opt, 2), 2)  # no fence in between: settled here
        assert first is not None and second is not None and first.done
        a, b = first.result(60), second.result(60)
        assert a is not None and b is not None and a.path != b.path
        assert ckpt.save(state_of(model, opt, 3), 3) is not None  # the synchronous save, beside it
        assert ckpt.save_async(state_of(model, opt, 4), 4) is None  # all three slots READY: skipped
        assert ckpt.skipped == 1
    finally:
        ckpt.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_device_state_is_copied_by_a_side_stream_into_the_pinned_slot(shm: Path) -> None:
    torch.manual_seed(3)
    model = nn.Linear(2048, 2048).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer("j1", node="n1", worker="w0", root=shm)
    ckpt.guard(opt)
    try:
        want = {k: v.cpu() for k, v in model.state_dict().items()}
        pending = ckpt.save_async(model.state_dict(), 1)
        assert pending is not None
        model(torch.randn(256, 2048, device="cuda")).sum().backward()
        opt.step()  # queued behind the copy on the current stream
        written = pending.result(60)
        assert written is not None
        got = slot_state(written)
        for k in want:
            assert torch.equal(got[k].cpu(), want[k])
    finally:
        ckpt.close()

"""``job.checkpoint(every=N)`` of a ``job.ddp()`` user loop, and the rotation it shares
with the Trainer (phalanx.runtime.snapshots): accepted on a DDP job, a bad ``every``
refused, the Checkpointer handed to the Session (its last resort loads it), one member
a step saving in turn, a skipped save neither raising nor waiting, and a loaded
checkpoint's bucket layout going on to the members rank 0 sends it to."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx.runtime.loop as loop_module
from phalanx.checkpoint.client import Checkpointer
from phalanx.runtime.loop import UserLoop
from phalanx.runtime.rng import rng_state
from phalanx.runtime.sampler import ElasticSampler
from phalanx.runtime.snapshots import RotatingSnapshots

DATA = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))


def ddp_loop() -> UserLoop:
    lp = UserLoop(SimpleNamespace(job="j1", worker="w0"))  # type: ignore[arg-type]
    lp.track(model=lp.ddp(nn.Linear(3, 1)))
    return lp


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3", True])
def test_a_bad_every_is_refused(bad: Any) -> None:
    lp = ddp_loop()
    with pytest.raises(ValueError, match=r"checkpoint\(every=\.\.\.\) needs an int >= 1"):
        lp.checkpoint(bad)
    assert lp._every == 0
    with pytest.raises(ValueError, match="int N >= 1"):
        RotatingSnapshots(Checkpointer("j1", root=Path("/nonexistent")), bad, SimpleNamespace())


def test_without_every_the_node_policy_gives_the_interval_and_a_bad_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lp = ddp_loop()
    monkeypatch.delenv("PHALANX_CKPT_TIERS", raising=False)
    with pytest.raises(ValueError, match="needs memory's every in PHALANX_CKPT_TIERS"):
        lp.checkpoint()
    monkeypatch.setenv("PHALANX_CKPT_TIERS", "memory:every=50; disk:every=200")
    lp.checkpoint()
    assert lp._every == 50
    lp.checkpoint(100)  # divides disk's 200
    RotatingSnapshots(
        Checkpointer("j1", root=Path("/nonexistent")), 100, SimpleNamespace()
    )  # shared, object: every one
    with pytest.raises(ValueError, match="disk take every 200th step: it would get one every 600"):
        RotatingSnapshots(Checkpointer("j1", root=Path("/nonexistent")), 30, SimpleNamespace())


class Started(Exception):
    pass


def test_a_ddp_job_checkpoints_into_the_job_s_store_and_resumes_through_the_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: dict[str, Any] = {}

    class FakeSession:
        def __init__(self, job: Any, state: Any, **kwargs: Any) -> None:
            made.update(kwargs, state=state)

        def start(self, restore: Any) -> None:
            raise Started

    monkeypatch.setattr(loop_module, "Session", FakeSession)
    lp = ddp_loop()
    lp.checkpoint(every=3)  # a DDP job: accepted (it used to be a TypeError at job.steps)
    with pytest.raises(Started):
        next(lp.steps(DataLoader(DATA, batch_size=2, sampler=ElasticSampler(DATA)), 5))
    assert lp.snapshots is not None and lp.snapshots.every == 3
    store = made["checkpoints"]
    assert isinstance(store, Checkpointer) and store.job == "j1"  # the Session's last resort
    assert store is lp.snapshots.checkpoints and made["state"] is lp

    plain = ddp_loop()  # without job.checkpoint: no store, no last resort
    with pytest.raises(Started):
        next(plain.steps(DataLoader(DATA, batch_size=2, sampler=ElasticSampler(DATA)), 5))
    assert plain.snapshots is None and made["checkpoints"] is None


class Recording:
    def __init__(self, written: object) -> None:
        self.saved: list[tuple[Any, int]] = []
        self.written = written

    def save_async(self, state: Any, step: int) -> object:
        self.saved.append((state, step))
        return self.written


def test_one_member_saves_each_time_and_a_different_one_the_next() -> None:
    every, world = 2, 3
    snaps = RotatingSnapshots(Checkpointer("j1"), every, SimpleNamespace(info=lambda *a, **k: None))
    savers = {step: [r for r in range(world) if snaps.due(step, r, world)] for step in range(0, 13)}
    assert savers == {
        0: [], 1: [], 2: [1], 3: [], 4: [2], 5: [], 6: [0], 7: [], 8: [1], 9: [], 10: [2], 11: [], 12: [0]
    }  # fmt: skip

    written = SimpleNamespace(claim=SimpleNamespace(size=10))  # a PendingSave, as far as it is read
    store = Recording(written)
    snaps.checkpoints = store  # type: ignore[assignment]
    asked: list[int] = []

    def state() -> dict[str, Any]:
        asked.append(1)
        return {"w": torch.ones(2)}

    for rank in range(world):
        got = snaps.after_step(SimpleNamespace(step=4, rank=rank, world_size=world), state)
        assert got is (written if rank == 2 else None)
    assert len(asked) == 1, "the state is taken only where it is saved"
    ((saved, step),) = store.saved
    assert (
        step == 4 and set(saved) == {"step", "state"} and saved["step"] == 4
    )  # Session's last resort reads these


def test_a_skipped_save_neither_raises_nor_waits(tmp_path: Path) -> None:
    # No keeper frees the one slot: the second save finds it held and is skipped.
    store = Checkpointer("j1", node="n1", worker="w0", root=tmp_path, slots=1)
    snaps = RotatingSnapshots(store, 1, SimpleNamespace(info=lambda *a, **k: None))
    state = {"w": torch.zeros(1000)}
    assert snaps.save(state, 1) is not None
    t0 = time.perf_counter()
    assert snaps.save(state, 2) is None
    assert time.perf_counter() - t0 < 1.0 and store.skipped == 1
    store.close()


def test_a_loaded_checkpoint_s_layout_goes_to_the_members_rank_0_sends_it_to() -> None:
    lp = ddp_loop()
    assert lp.state_dict()["ddp"] == {"layout": None}
    # The Session's last resort on rank 0: load, then send state_dict() before _restore.
    lp.load_state_dict(
        {
            "tracked": {"model": lp.tracked["model"].state_dict()},
            "rng": rng_state(),
            "ddp": {"layout": [[1], [0]]},
            "lr_scale": 0.5,
        },
        fresh=False,
    )
    sent = lp.state_dict()
    assert sent["ddp"] == {"layout": [[1], [0]]} and sent["lr_scale"] == 0.5

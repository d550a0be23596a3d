"""One step of phalanx.runtime.loop's DDP integration, ranks as threads over real gloo
(a loopback TCPStore, real Communicators, real DDP reducers): the resize vote rides
with the step's gradient all-reduces (no collective after the step), micro-batches
reduce once, buffers come from the generation's rank 0, a failed step leaves a
GradScaler as it was, and the LR rule rescales what the schedules are computed from.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from phalanx.contract import Member, Plan
from phalanx.runtime.bounds import Bounds
from phalanx.runtime.comm import CommError, Communicator
from phalanx.runtime.loop import MicroBatches, UserLoop, _roll_back, rescale_lrs, snapshot
from phalanx.runtime.sampler import ElasticSampler
from tests.stores import SECRET, hosted
from tests.unit.test_buckets import run_ranks

JOIN_S = 60.0
_plans = itertools.count()
_init_lock = threading.Lock()


class FakeSession:
    """What the loop's hooks ask of a Session, for one generation of ``world`` ranks."""

    def __init__(self, rank: int, world: int, vote: float = 0.0) -> None:
        self.rank, self.world_size, self.step, self.vote = rank, world, 0, vote
        self.device = torch.device("cpu")
        self.separate_collectives = 0
        self.bounds = Bounds(
            floor_s=2.0, factor=4.0, initial_s=JOIN_S, backstop_s=JOIN_S, rendezvous_s=JOIN_S
        )

    def collective_bound_s(self) -> float:
        return JOIN_S

    def strike(self, bound_s: float, point: str = "step") -> bool:
        return False

    def enter_collective(self, bound_s: float) -> None:
        pass

    def record_collective(self, ms: float) -> None:
        pass

    def resize_vote(self) -> float:
        return self.vote

    def allreduce_(self, t: torch.Tensor) -> None:
        self.separate_collectives += 1


def model() -> nn.Module:
    """The same weights in every rank (threads share the global RNG: one at a time)."""
    with _init_lock:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


class Shifted(nn.Module):
    """A module with buffers that forward reads and never writes."""

    shift: torch.Tensor
    count: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.inner = model()
        self.register_buffer("shift", torch.zeros(4))
        self.register_buffer("count", torch.zeros(2, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + self.shift


def batch(rank: int, n: int = 5, seed: int = 100) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed + rank))


def ranks(n: int, fn: Callable[[int, Communicator], Any]) -> list[Any]:
    """``fn(rank, comm)`` in ``n`` threads, each with a Communicator of one generation."""
    store = hosted(SECRET)
    plan = Plan(
        job="j1",
        generation=1,
        members=[Member(worker=f"w{r}", rank=r) for r in range(n)],
        reason="test",
        store_prefix=f"test-loop-step/{next(_plans)}",
        store_secret=SECRET,
        store_addr=f"127.0.0.1:{store.port}",
    )

    comms: list[Communicator] = []

    def body(r: int) -> Any:
        comm = Communicator(f"w{r}", plan.store_addr, backstop_s=JOIN_S)
        comms.append(comm)
        comm.configure(plan, cancelled=lambda: False, arrival_s=JOIN_S, connect_s=JOIN_S)
        return fn(r, comm)

    try:  # released once every rank is done: one done may still be sending to a peer
        results = run_ranks(n, body)
    finally:
        for comm in comms:
            comm.release()
    for res in results:
        if isinstance(res, BaseException):
            raise res
    return results


class Counting:
    """A Communicator's all-reduces, counted (by length) as the loop starts them."""

    def __init__(self, comm: Communicator) -> None:
        self.sizes: list[int] = []
        original = comm.allreduce_work

        def counted(t: torch.Tensor, timeout_s: float | None = None) -> Any:
            self.sizes.append(t.numel())
            return original(t, timeout_s)

        comm.allreduce_work = counted  # type: ignore[method-assign]


def user_loop(comm: Communicator, session: FakeSession) -> UserLoop:
    job = SimpleNamespace(worker=f"w{session.rank}", comm=comm, status=SimpleNamespace(enter=lambda p: None))
    loop = UserLoop(job)  # type: ignore[arg-type]
    loop.session = session  # type: ignore[assignment]
    return loop


def grads(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("votes", [(0.0, 0.0, 0.0), (0.0, 1.0, 0.0)], ids=["no-resize", "one-voter"])
def test_the_resize_vote_goes_with_the_gradients_and_leaves_them_as_plain_ddp_s(
    votes: tuple[float, ...],
) -> None:
    def rank(r: int, comm: Communicator) -> tuple[bool, dict[str, torch.Tensor], list[int], int]:
        session = FakeSession(r, 3, votes[r])
        loop = user_loop(comm, session)
        ddp = loop.ddp(model())
        counting = Counting(comm)
        loop._prepare_step(session)  # type: ignore[arg-type]
        ddp(batch(r)).sum().backward()
        switch, late = loop._vote.outcome(session, None)  # type: ignore[arg-type]
        assert late is None and loop.step_ok
        return switch, grads(ddp.module), counting.sizes, session.separate_collectives

    results = ranks(3, rank)
    nparams = sum(p.numel() for p in model().parameters())
    for switch, _, sizes, separate in results:
        assert switch is (max(votes) > 0)
        assert sizes == [1, nparams]  # the vote first, then DDP's one first-iteration bucket
        assert separate == 0  # nothing after the step
    # DDP's reduction (each bucket x 1/world, then SUM): the same bits on every rank
    want: dict[str, torch.Tensor] = {}
    for r in range(3):
        m = model()
        m(batch(r)).sum().backward()
        for n, g in grads(m).items():
            want[n] = want.get(n, 0) + g.double() / 3
    for n, g in want.items():
        assert all(torch.equal(res[1][n], results[0][1][n]) for res in results), n
        torch.testing.assert_close(results[0][1][n].double(), g, rtol=1e-6, atol=1e-7)


def test_micro_batches_reduce_once_the_sum_of_their_gradients() -> None:
    def rank(r: int, comm: Communicator) -> tuple[dict[str, torch.Tensor], list[int]]:
        session = FakeSession(r, 2)
        loop = user_loop(comm, session)
        ddp = loop.ddp(model())
        counting = Counting(comm)
        loop._prepare_step(session)  # type: ignore[arg-type]
        micro = MicroBatches(loop, [batch(r, seed=1), batch(r, seed=2), batch(r, seed=3)])
        for x in micro:
            (ddp(x).sum() / len(micro)).backward()
        assert loop._vote.outcome(session, None)[1] is None  # type: ignore[arg-type]
        return grads(ddp.module), counting.sizes

    results = ranks(2, rank)
    nparams = sum(p.numel() for p in model().parameters())
    assert all(sizes == [1, nparams] for _, sizes in results)  # one vote, one bucket: the last backward
    want: dict[str, torch.Tensor] = {}
    for r in range(2):
        m = model()
        for seed in (1, 2, 3):
            (m(batch(r, seed=seed)).sum() / 3).backward()
        for n, g in grads(m).items():
            want[n] = want.get(n, 0) + g.double() / 2
    for n, g in want.items():
        torch.testing.assert_close(results[0][0][n].double(), g, rtol=1e-6, atol=1e-7)
        assert torch.equal(results[0][0][n], results[1][0][n])


@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_come_from_the_generation_s_rank_0_each_forward(broadcast: bool) -> None:
    def rank(r: int, comm: Communicator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        session = FakeSession(r, 3)
        loop = user_loop(comm, session)
        module = Shifted()
        module.shift.fill_(float(r))
        module.count.fill_(10 + r)
        ddp = loop.ddp(module, broadcast_buffers=broadcast)
        loop._prepare_step(session)  # type: ignore[arg-type]
        out = ddp(batch(0))
        out.sum().backward()
        assert loop._vote.outcome(session, None)[1] is None  # type: ignore[arg-type]
        return module.shift.clone(), module.count.clone(), out.detach()

    results = ranks(3, rank)
    for r, (shift, count, out) in enumerate(results):
        src = 0 if broadcast else r
        assert torch.equal(shift, torch.full((4,), float(src)))
        assert torch.equal(count, torch.full((2,), 10 + src, dtype=torch.int64))
        assert torch.equal(out, results[src][2])
    if not broadcast:
        assert not torch.equal(results[1][2], results[0][2])


def test_no_broadcast_outside_a_step() -> None:
    loop = user_loop(Communicator("w0", "127.0.0.1:1"), FakeSession(0, 3))  # never configured
    module = Shifted()
    module.shift.fill_(5.0)
    ddp = loop.ddp(module)
    with torch.no_grad():
        ddp(batch(0))
    assert torch.equal(module.shift, torch.full((4,), 5.0)) and loop.step_ok


def scaled_step(loop: UserLoop | None, m: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> None:
    """A GradScaler step as a script writes it: scale, backward, unscale_, clip, step, update."""
    opt.zero_grad()
    scaler.scale(m(batch(0)).pow(2).mean()).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()


def test_a_failed_step_leaves_the_grad_scaler_and_the_optimizer_as_they_were() -> None:
    def setup() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        return m, opt, torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)

    twin = setup()
    scaled_step(None, *twin)
    assert twin[2].get_scale() == 2.0**9  # a step that went through grows the scale

    m, opt, scaler = setup()
    loop = user_loop(Communicator("w0", "127.0.0.1:1"), FakeSession(0, 1))
    loop.tracked = {"model": m, "optimizer": opt, "scaler": scaler}
    loop._prepare_tracking(ElasticSampler(range(4)))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    saved = snapshot(loop.tracked)
    loop._failed = CommError("a peer died in this step")
    scaled_step(loop, m, opt, scaler)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
    assert scaler.get_scale() == 2.0**8 and not opt.state
    _roll_back(saved)
    loop._failed = None
    scaled_step(loop, m, opt, scaler)  # redone: unscale_ again is allowed, and the step counts once
    assert scaler.get_scale() == twin[2].get_scale()
    assert all(torch.equal(m.state_dict()[k], v) for k, v in twin[0].state_dict().items())


def test_the_lr_rule_rescales_a_schedule_without_changing_its_shape() -> None:
    def schedule(scale: float | None) -> list[float]:
        opt = torch.optim.AdamW(model().parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=20)
        lrs = []
        for step in range(20):
            if step == 5 and scale is not None:
                rescale_lrs([opt, sched], scale)
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return lrs

    plain, scaled = schedule(None), schedule(0.5)
    assert scaled[:5] == plain[:5]
    for a, b in zip(scaled[5:], plain[5:], strict=True):
        assert a == pytest.approx(0.5 * b, rel=1e-12)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(torch.optim.SGD(model().parameters(), lr=1.0), 10)
    rescale_lrs([cosine.optimizer, cosine], 0.25)
    assert cosine.base_lrs == [0.25] and cosine.optimizer.param_groups[0]["initial_lr"] == 0.25

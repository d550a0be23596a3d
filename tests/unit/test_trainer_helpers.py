"""Trainer helpers (phalanx.runtime.trainer): per-step, per-rank seeds and the flat
gradient buffer whose views autograd accumulates into in place."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from phalanx.runtime.trainer import VOTE, Trainer, _flat_grads, step_seed


def test_step_seed_is_deterministic_and_a_valid_torch_seed() -> None:
    for seed, step, rank in [(0, 0, 0), (1, 2, 3), (2**31, 10**6, 1023), (2**62, 2**40, 7)]:
        s = step_seed(seed, step, rank)
        assert s == step_seed(seed, step, rank)
        assert 0 <= s < 2**63 - 1
        torch.manual_seed(s)  # accepted


def test_step_seed_distinct_over_seeds_steps_and_ranks() -> None:
    grid = list(itertools.product(range(3), range(2001), range(32)))
    seeds = {step_seed(*k) for k in grid}
    assert len(seeds) == len(grid)


def test_step_seed_drives_distinct_but_reproducible_streams() -> None:
    def draw(seed: int, step: int, rank: int) -> torch.Tensor:
        torch.manual_seed(step_seed(seed, step, rank))
        return torch.rand(8)

    assert torch.equal(draw(0, 5, 1), draw(0, 5, 1))
    assert not torch.equal(draw(0, 5, 1), draw(0, 5, 2))
    assert not torch.equal(draw(0, 5, 1), draw(0, 6, 1))
    assert not torch.equal(draw(0, 5, 1), draw(1, 5, 1))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2, bias=False), nn.LayerNorm(2))


def test_flat_grads_layout() -> None:
    params = list(_model().parameters())
    flat, views = _flat_grads(params)
    assert flat.dtype == params[0].dtype and flat.dim() == 1
    # every gradient, then the two slots the all-reduce carries besides: VOTE and LOSS
    assert flat.numel() - 2 == sum(p.numel() for p in params) == 12 + 4 + 8 + 2 + 2
    assert torch.count_nonzero(flat) == 0
    assert [v.shape for v in views] == [p.shape for p in params]
    off = 0
    for v, p in zip(views, params, strict=True):
        assert v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert v.storage_offset() == off and v.is_contiguous()
        off += p.numel()


def test_flat_grads_views_share_memory_both_ways() -> None:
    params = list(_model().parameters())
    flat, views = _flat_grads(params)
    flat.copy_(torch.arange(flat.numel(), dtype=flat.dtype))
    assert torch.equal(torch.cat([v.reshape(-1) for v in views]), flat[:VOTE])
    views[2].fill_(-1.0)
    start = params[0].numel() + params[1].numel()
    assert torch.equal(flat[start : start + params[2].numel()], torch.full((params[2].numel(),), -1.0))
    assert flat[start - 1] == start - 1 and flat[start + params[2].numel()] == start + params[2].numel()


def _expected_grads(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    total = None
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, list(model.parameters()))])
        total = g if total is None else total + g
    assert total is not None
    return total


def test_backward_accumulates_in_place_into_the_flat_buffer() -> None:
    model = _model()
    params = list(model.parameters())
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 3, generator=g), torch.randn(5, 2, generator=g)) for _ in range(2)]
    want = _expected_grads(model, batches)

    flat, views = _flat_grads(params)
    flat.fill_(123.0)  # a previous step's gradient, cleared the way the trainer does it
    flat.zero_()
    for p, v in zip(params, views, strict=True):
        p.grad = v
    for x, y in batches:  # two micro-batches: the second accumulates onto the first
        nn.functional.mse_loss(model(x), y).backward()

    for p, v in zip(params, views, strict=True):
        assert p.grad is v  # autograd added into the view, it did not swap in a new tensor
    assert torch.count_nonzero(flat) > 0
    assert torch.equal(flat[:VOTE], want)

    flat.mul_(0.5)  # e.g. the all-reduce writing into flat lands in p.grad
    assert all(torch.equal(p.grad, v) for p, v in zip(params, views, strict=True))
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in params]), want * 0.5)  # type: ignore[union-attr]


def test_optimizer_step_reads_the_flat_buffer() -> None:
    model = _model()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    flat, views = _flat_grads(params)
    for p, v in zip(params, views, strict=True):
        p.grad = v
    opt = torch.optim.SGD(params, lr=0.5)
    flat.copy_(torch.linspace(-1.0, 1.0, flat.numel()))  # written directly, as after an all-reduce
    opt.step()
    for p, b, v in zip(params, before, views, strict=True):
        assert torch.equal(p.detach(), b - 0.5 * v)


def _trainer(collective_timeout_s: float | None = None) -> Trainer:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job = SimpleNamespace(worker="w0")
    return Trainer(
        job,  # type: ignore[arg-type]
        model,
        opt,
        batches=lambda step, world, rank: [],
        loss_fn=lambda m, x, y: torch.zeros(()),
        global_batch=4,
        collective_timeout_s=collective_timeout_s,
    )


def test_collective_bound_is_learned_from_recent_all_reduces(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PHALANX_COLLECTIVE_FLOOR_MS", "PHALANX_COLLECTIVE_FACTOR", "PHALANX_COLLECTIVE_INITIAL_MS"):
        monkeypatch.delenv(name, raising=False)
    t = _trainer()
    assert t.session.collective_bound_s() == 60.0  # nothing completed in this generation yet
    for ms in (10.0, 120.0, 30.0):
        t.session.record_collective(ms)
    assert t.session.collective_bound_s() == 2.0  # the floor: 4 x 120 ms is less
    t.session.record_collective(900.0)
    assert t.session.collective_bound_s() == pytest.approx(3.6)  # 4 x the slowest recent one
    for _ in range(20):  # the slow one slides out of the window
        t.session.record_collective(1.0)
    assert t.session.collective_bound_s() == 2.0
    monkeypatch.setenv("PHALANX_COLLECTIVE_FLOOR_MS", "500")
    monkeypatch.setenv("PHALANX_COLLECTIVE_FACTOR", "10")
    monkeypatch.setenv("PHALANX_COLLECTIVE_INITIAL_MS", "300000")
    t = _trainer(collective_timeout_s=90.0)
    assert t.session.collective_bound_s() == 90.0  # never above the backstop
    t.session.record_collective(80.0)
    assert t.session.collective_bound_s() == pytest.approx(0.8)
    monkeypatch.setenv("PHALANX_COLLECTIVE_FACTOR", "0")
    with pytest.raises(ValueError, match="PHALANX_COLLECTIVE_FACTOR"):
        _trainer()


def test_joiners_take_state_from_every_member_that_holds_it() -> None:
    from phalanx.runtime.session import state_sources

    # three survivors at step 7, three joiners: one each, in parallel
    assert state_sources([7, 7, 7, -1, -1, -1]) == {3: 0, 4: 1, 5: 2}
    # a survivor that missed the last update receives too; more joiners than holders wrap around
    assert state_sources([7, 6, -1, -1, -1]) == {1: 0, 2: 0, 3: 0, 4: 0}
    assert state_sources([7, 7, -1, -1, -1]) == {2: 0, 3: 1, 4: 0}
    # a fresh job: rank 0's initial state is the reference; nobody behind: nothing moves
    assert state_sources([-1, -1, -1]) == {1: 0, 2: 0}
    assert state_sources([5, 5]) == {}

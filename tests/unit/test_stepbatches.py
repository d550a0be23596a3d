"""StepBatches: a redone step reads what the fault-free run read, wherever it is redone."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from phalanx.contract import BatchPlan
from phalanx.runtime.rng import rng_state, set_rng_state
from phalanx.runtime.sampler import ElasticSampler
from phalanx.runtime.stepbatches import StepBatches

DATA = TensorDataset(torch.arange(48.0).unsqueeze(1))


def batches(seed: int = 0) -> StepBatches:
    torch.manual_seed(seed)
    sampler = ElasticSampler(DATA, shuffle=True, seed=3)
    return StepBatches(DataLoader(DATA, batch_size=4, sampler=sampler), sampler)


def rows(parts: list[list[torch.Tensor]]) -> list[float]:
    return [float(v) for part in parts for v in part[0].flatten()]


def test_a_step_redone_at_its_place_trains_the_batch_in_hand_and_continues_the_rng() -> None:
    data = batches()
    first = data.at((0, 2, 0), None)
    after = torch.rand(3)  # the step's own draws (dropout), then it failed
    data.rejoin((0, 2, 0), received=False)
    assert data.at((0, 2, 0), None) is first
    assert torch.equal(torch.rand(3), after)  # the redone step draws them again


def test_a_joiner_given_the_rng_of_the_step_reads_its_batch_and_draws_alike() -> None:
    data = batches()
    first = data.at((0, 2, 0), None)
    after = torch.rand(3)
    twin = batches(seed=9)
    set_rng_state(data.rng_of(0))  # what a joiner gets: the state before the batch
    assert rows(twin.at((0, 2, 0), None)) == rows(first)
    assert torch.equal(torch.rand(3), after)


def test_the_same_step_at_a_new_world_reads_afresh_from_the_rewound_rng() -> None:
    data = batches()
    before = rng_state()
    data.at((0, 2, 0), None)
    data.rejoin((0, 1, 0), received=False)  # a shrink: one rank trains the whole batch
    assert torch.equal(rng_state()["torch"], before["torch"])
    split = BatchPlan(global_batch=8, effective_batch=8, world_size=1, shards=[8])
    got = rows(data.at((0, 1, 0), split))
    fresh = batches()
    assert got == rows(fresh.at((0, 1, 0), split)) and len(got) == 8


def test_steps_walk_the_epoch_and_cross_into_the_next() -> None:
    data = batches()
    seen: list[float] = []
    for step in range(7):  # 48 samples, 8 per step: the seventh step is epoch 1's first
        seen += rows(data.at((step, 2, 0), None)) + rows(data.at((step, 2, 1), None))
        data.committed(2, None)
    assert sorted(seen[:48]) == [float(i) for i in range(48)]
    assert data.sampler.epoch == 1 and len(seen) == 56


def test_a_received_state_drops_the_batch_in_hand() -> None:
    data = batches()
    first = data.at((0, 2, 0), None)
    data.rejoin((0, 2, 0), received=True)
    assert data.at((0, 2, 0), None) is not first

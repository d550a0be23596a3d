"""phalanx.runtime.loop refuses what it cannot recover from, before anything runs:
each mistake gets a clear error and changes nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from phalanx.runtime.buckets import LayoutError, layout_of
from phalanx.runtime.loop import UserLoop
from phalanx.runtime.sampler import ElasticSampler

DATA = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))


def loop() -> UserLoop:
    return UserLoop(SimpleNamespace(worker="w0"))  # type: ignore[arg-type]


def test_steps_needs_the_ddp_model_first() -> None:
    with pytest.raises(RuntimeError, match=r"job\.ddp"):
        next(loop().steps(DataLoader(DATA, batch_size=2, sampler=ElasticSampler(DATA)), 3))


def test_steps_refuses_a_distributed_sampler() -> None:
    lp = loop()
    lp.ddp(nn.Linear(3, 1))
    sampler = DistributedSampler(DATA, num_replicas=2, rank=0)
    with pytest.raises(TypeError, match="ElasticSampler"):
        next(lp.steps(DataLoader(DATA, batch_size=2, sampler=sampler), 3))
    with pytest.raises(TypeError, match="ElasticSampler"):
        next(lp.steps(DataLoader(DATA, batch_size=2, shuffle=True), 3))
    assert lp.session is None


def test_ddp_once_and_with_phalanx_s_group() -> None:
    lp = loop()
    with pytest.raises(ValueError, match="process_group"):
        lp.ddp(nn.Linear(3, 1), process_group=None)
    model = lp.ddp(nn.Linear(3, 1))
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    with pytest.raises(RuntimeError, match="one DDP model"):
        lp.ddp(nn.Linear(3, 1))


def test_track_refuses_what_has_no_state() -> None:
    lp = loop()
    with pytest.raises(TypeError, match="state_dict"):
        lp.track(model=nn.Linear(1, 1), counter=3)
    assert lp.tracked == {}  # nothing half-registered


def test_backward_outside_steps_is_an_error() -> None:
    lp = loop()
    model = lp.ddp(nn.Linear(3, 1))
    with pytest.raises(RuntimeError, match=r"outside job\.steps"):
        model(torch.randn(2, 3)).sum().backward()


def test_a_peer_s_bucket_layout_is_checked() -> None:
    assert layout_of(None, 3) is None
    assert layout_of([[2, 1], [0]], 3) == [[2, 1], [0]]
    for bad in ([[0, 1]], [[0, 1, 1, 2]], [[0], "x"], {"a": 1}, [[0, 1, 3]]):
        with pytest.raises(LayoutError, match="layout"):
            layout_of(bad, 3)

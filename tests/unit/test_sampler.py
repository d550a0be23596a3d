"""ElasticSampler (phalanx.runtime.sampler): DistributedSampler's order as a pure
function of (seed, epoch, offset, world, rank)."""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data.distributed import DistributedSampler

from phalanx.runtime.sampler import ElasticSampler


def elastic(
    n: int, world: int, rank: int, *, epoch: int = 0, offset: int = 0, **kw: object
) -> ElasticSampler:
    s = ElasticSampler(range(n), **kw)  # type: ignore[arg-type]
    s.place(epoch=epoch, offset=offset, world=world, rank=rank)
    return s


@pytest.mark.parametrize(
    ("n", "world", "shuffle", "drop_last"),
    list(itertools.product([1, 7, 10, 64, 101], [1, 2, 3, 4], [True, False], [True, False])),
)
def test_same_order_as_distributed_sampler(n: int, world: int, shuffle: bool, drop_last: bool) -> None:
    if drop_last and n < world:
        pytest.skip("DistributedSampler yields nothing then")
    for epoch in (0, 3):
        for rank in range(world):
            ref = DistributedSampler(
                range(n),  # type: ignore[arg-type]
                world,
                rank,
                shuffle=shuffle,
                seed=5,
                drop_last=drop_last,
            )
            ref.set_epoch(epoch)
            mine = elastic(n, world, rank, epoch=epoch, shuffle=shuffle, seed=5, drop_last=drop_last)
            assert list(mine) == list(ref)
            assert len(mine) == len(ref)


@pytest.mark.parametrize(("n", "world", "batch"), [(100, 3, 4), (64, 4, 8), (10, 2, 3)])
def test_resuming_at_an_offset_continues_the_same_slice(n: int, world: int, batch: int) -> None:
    """After k batches of b on every rank, the rest is what DistributedSampler still yields."""
    for rank in range(world):
        whole = list(elastic(n, world, rank, seed=1))
        for k in range(len(whole) // batch + 1):
            rest = list(elastic(n, world, rank, seed=1, offset=min(n, k * batch * world)))
            if k * batch * world <= n:
                assert rest == whole[k * batch :], (rank, k)


def test_resplit_after_a_shrink_reads_the_rest_of_the_epoch_once() -> None:
    n, batch = 96, 4
    consumed: set[int] = set()
    for rank in range(4):  # two steps at world 4
        consumed |= set(list(elastic(n, 4, rank, seed=2))[: 2 * batch])
    offset = 2 * batch * 4
    assert len(consumed) == offset
    rest = [i for rank in range(3) for i in elastic(n, 3, rank, seed=2, offset=offset)]
    unread = set(range(n)) - consumed
    assert all(rest.count(i) == 1 for i in unread)
    padding = len(rest) - len(unread)  # 64 left for 3 ranks: 2 repeated from the epoch's start
    assert padding == 2 and set(rest) - unread <= set(ElasticSampler(range(n), seed=2).order(0)[:2])  # type: ignore[arg-type]


def test_set_epoch_and_advance() -> None:
    s = elastic(10, 2, 1, seed=0)
    s.advance(4)
    assert s.offset == 4
    s.advance(100)
    assert s.offset == 10 and len(s) == 0 and list(s) == []
    s.set_epoch(1)
    assert (s.epoch, s.offset, s.world, s.rank) == (1, 0, 2, 1)


def test_state_round_trip_and_refusal() -> None:
    a = elastic(50, 2, 0, seed=3, epoch=2, offset=8)
    b = elastic(50, 2, 1, seed=3)
    b.load_state_dict(a.state_dict())
    assert (b.epoch, b.offset, b.rank) == (2, 8, 1)
    other = elastic(50, 2, 1, seed=4)
    before = other.state_dict()
    with pytest.raises(ValueError, match="does not fit"):
        other.load_state_dict(a.state_dict())
    assert other.state_dict() == before  # nothing changed


@pytest.mark.parametrize(
    "place",
    [
        {"epoch": -1, "offset": 0, "world": 1, "rank": 0},
        {"epoch": 0, "offset": 11, "world": 1, "rank": 0},
        {"epoch": 0, "offset": 0, "world": 0, "rank": 0},
        {"epoch": 0, "offset": 0, "world": 2, "rank": 2},
    ],
)
def test_bad_positions_are_refused(place: dict[str, int]) -> None:
    s = ElasticSampler(range(10))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bad sampler position"):
        s.place(**place)
    assert (s.epoch, s.offset, s.world, s.rank) == (0, 0, 1, 0)


def test_empty_dataset_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        ElasticSampler([])

"""DDP's buckets mapped onto a generation's layout (phalanx.runtime.buckets): a rank
whose DDP still has its first-iteration buckets all-reduces with peers whose DDP has
rebuilt them, through real DDP reducers, a real Communicator and gloo (ranks as
threads over a loopback store), and every rank ends with the same gradients."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phalanx.contract import Member, Plan
from phalanx.runtime.buckets import Layout, Remap, done
from phalanx.runtime.comm import CommError, Communicator, Group
from tests.stores import SECRET, hosted

JOIN_S = 60.0
_names = itertools.count()


_init_lock = threading.Lock()


def model() -> nn.Module:
    """The same weights in every rank (threads share the global RNG: one at a time)."""
    with _init_lock:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(rank: int) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(100 + rank))


class Hooked:
    """A DDP model on a one-rank group whose comm hook does what ``fn`` says."""

    def __init__(self) -> None:
        self.local = Group(dist.HashStore(), f"test-buckets-{next(_names)}", 0, 1)
        self.ddp = DistributedDataParallel(model(), process_group=self.local.pg, bucket_cap_mb=0.0005)
        params, _ = self.ddp._build_params_for_reducer()
        self.index = {id(p): i for i, p in enumerate(params)}
        self.fn: Callable[[dist.GradBucket], torch.futures.Future[torch.Tensor]] = lambda b: done(b.buffer())
        self.seen: dict[int, list[int]] = {}
        self.ddp.register_comm_hook(self, _hook)

    def step(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.ddp.zero_grad()
        self.seen = {}
        self.ddp(x).sum().backward()
        return {n: p.grad.clone() for n, p in self.ddp.module.named_parameters() if p.grad is not None}

    def layout(self) -> Layout:
        return [self.seen[i] for i in sorted(self.seen)]


def _hook(state: Hooked, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.seen[bucket.index()] = [state.index[id(p)] for p in bucket.parameters()]
    return state.fn(bucket)


_hook.__annotations__.update(
    {"state": Hooked, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
)


def rebuilt() -> Hooked:
    """DDP after its rebuild: two local iterations (the second forward rebuilds)."""
    h = Hooked()
    h.step(batch(0))
    h.step(batch(0))
    return h


def run_ranks(n: int, fn: Callable[[int], Any]) -> list[Any]:
    results: list[Any] = [None] * n

    def body(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as exc:
            results[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a rank is still blocked"
    return results


def test_a_fresh_ddp_mapped_onto_its_peers_rebuilt_buckets_reduces_as_they_do() -> None:
    first, agreed = Hooked(), rebuilt()
    first.step(batch(0))
    agreed.step(batch(0))
    assert len(first.layout()) == 1 < len(agreed.layout())  # the layouts differ: unmapped, no match
    layout = agreed.layout()
    store = hosted(SECRET)
    plan = Plan(
        job="j1",
        generation=1,
        members=[Member(worker=f"w{r}", rank=r) for r in range(3)],
        reason="test",
        store_prefix="test-buckets/gen1",
        store_secret=SECRET,
        store_addr=f"127.0.0.1:{store.port}",
    )

    comms: list[Communicator] = []

    def rank(r: int) -> dict[str, torch.Tensor]:
        comm = Communicator(f"w{r}", plan.store_addr, backstop_s=JOIN_S)
        comms.append(comm)
        comm.configure(plan, cancelled=lambda: False, arrival_s=JOIN_S, connect_s=JOIN_S)
        errors: list[CommError] = []
        if r == 1:  # a joiner: DDP's first-iteration buckets, mapped onto the agreed ones
            h = Hooked()
            remap = Remap(layout, comm, JOIN_S, h.index, lambda ms: None, errors.append)
            h.fn = lambda b: remap.add(b, failed=False)
        else:  # survivors: DDP rebuilt, its buckets are the agreed ones
            h = rebuilt()
            assert h.layout() == layout

            def direct(b: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
                return comm.allreduce_work(b.buffer(), JOIN_S).get_future().then(lambda f: f.value()[0])

            h.fn = direct
        grads = h.step(batch(r))
        assert not errors, errors
        return grads

    try:  # released once every rank is done: one done may still be sending to a peer
        results = run_ranks(3, rank)
    finally:
        for comm in comms:
            comm.release()
    for res in results:
        assert isinstance(res, dict), res
    expected: dict[str, torch.Tensor] = {}
    for r in range(3):
        m = model()
        m(batch(r)).sum().backward()
        for n, p in m.named_parameters():
            expected[n] = expected.get(n, 0) + p.grad.double()
    for n, want in expected.items():
        assert all(torch.equal(res[n], results[0][n]) for res in results), n  # the same bits everywhere
        torch.testing.assert_close(results[0][n].double(), want, rtol=1e-5, atol=1e-6)


def test_a_failed_step_completes_every_bucket_with_its_local_gradients() -> None:
    h = rebuilt()
    local = h.step(batch(0))
    comm = Communicator("w0", "127.0.0.1:1")  # never configured: nothing may be started
    remap = Remap(h.layout()[::-1], comm, 1.0, h.index, lambda ms: None, lambda err: None)
    h.fn = lambda b: remap.add(b, failed=True)
    got = h.step(batch(0))
    assert all(torch.equal(got[n], local[n]) for n in local)


@pytest.mark.parametrize("fail_at", [0, 1])
def test_an_all_reduce_that_cannot_start_fails_the_step_not_ddp(fail_at: int) -> None:
    h = rebuilt()
    local = h.step(batch(0))
    comm = Communicator("w0", "127.0.0.1:1")  # not configured: each all-reduce refuses at once
    errors: list[CommError] = []
    remap = Remap(
        h.layout()[fail_at:] + h.layout()[:fail_at], comm, 1.0, h.index, lambda ms: None, errors.append
    )
    h.fn = lambda b: remap.add(b, failed=False)
    got = h.step(batch(0))
    assert errors and remap.failed
    assert all(torch.equal(got[n], local[n]) for n in local)

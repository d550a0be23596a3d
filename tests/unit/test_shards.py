"""Sharded state on the wire (phalanx.runtime.shards), who sends a joiner its shard
(phalanx.runtime.session.state_sources with positions), and the mesh's shape over
generations (Communicator.mesh_for, Mesh.position)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from phalanx.runtime.comm import CommError, Communicator
from phalanx.runtime.mesh import group_size_of
from phalanx.runtime.session import StateLost, state_sources, unheld
from phalanx.runtime.sharded import mesh_shape

ROOT = Path(__file__).resolve().parents[2]


def test_a_joiner_takes_its_shard_from_a_holder_at_its_own_position() -> None:
    # (replicate, shard) = (2, 2): ranks 0, 2 hold shard 0; ranks 1, 3 shard 1
    assert state_sources([7, -1, 7, 7], positions=[0, 1, 0, 1]) == {1: 3}
    # two joiners at different positions: two different sources, in parallel
    assert state_sources([-1, 7, 7, -1], positions=[0, 1, 0, 1]) == {0: 2, 3: 1}
    # four replica groups: joiners at one position spread over its holders
    assert state_sources([-1, 5, 5, 5, -1, 5, 5, 5], positions=[0, 1, 0, 1, 0, 1, 0, 1]) == {0: 2, 4: 6}


def test_a_fresh_sharded_job_moves_nothing_and_a_lost_shard_is_an_error() -> None:
    assert state_sources([-1, -1, -1, -1], positions=[0, 1, 0, 1]) == {}
    with pytest.raises(StateLost, match="every replica of shard 1 was lost"):
        state_sources([7, -1, 7, -1], positions=[0, 1, 0, 1])
    # replicated (no positions): as before
    assert state_sources([-1, -1, -1]) == {1: 0, 2: 0}


def test_only_a_position_nobody_holds_sends_the_job_to_its_checkpoint() -> None:
    # a lost rank whose shard a live replica holds: the replica serves it
    assert not unheld([7, -1, 7, 7], positions=[0, 1, 0, 1])
    # every replica of shard 1 lost (or plain FSDP losing a rank): only a checkpoint has it
    assert unheld([7, -1, 7, -1], positions=[0, 1, 0, 1])
    assert unheld([7, -1], positions=[0, 1])
    # a holder behind the most advanced step does not count: its shard is a step old
    assert unheld([7, 6, 7, 6], positions=[0, 1, 0, 1])
    # nobody holds anything (a relaunched job); replicated state (no positions)
    assert unheld([-1, -1], positions=[0, 1]) and unheld([-1, -1], None)
    assert not unheld([-1, 3], None)


def test_the_mesh_follows_the_world_by_whole_replica_groups() -> None:
    comm = Communicator("w0", "127.0.0.1:1")
    comm.set_mesh((-1, 2))
    assert comm.mesh_for(4) == (2, 2) and comm.mesh_for(2) == (1, 2) and comm.mesh_for(6) == (3, 2)
    with pytest.raises(CommError, match="do not make the mesh"):
        comm.mesh_for(3)
    comm.set_mesh((4,))
    assert comm.mesh_for(4) == (4,)
    with pytest.raises(CommError):
        comm.mesh_for(2)
    with pytest.raises(ValueError):
        comm.set_mesh((2, -1))
    assert group_size_of((2, 4)) == 4 and group_size_of((4,)) == 4 and group_size_of((2, 2, 3)) == 6


SHARDS_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from phalanx.checkpoint.packing import pack, unpack
    from phalanx.runtime.shards import ShardMismatch, from_local, optimizer_template, to_local
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = {"model": net.state_dict(), "optimizer": opt.state_dict()}
    local = to_local(state)
    assert not any(isinstance(v, DTensor) for v in local["model"].values())
    assert hasattr(local["model"], "_metadata")
    meta, buf = pack(local)  # what goes on the wire: plain tensors only
    got = unpack(meta, buf)
    # a fresh optimizer (no state yet) still gets DTensor moments laid out like the params
    fresh = torch.optim.AdamW(net.parameters(), lr=0.1)
    back = from_local(got["optimizer"], optimizer_template(fresh, got["optimizer"]), "optimizer")
    fresh.load_state_dict(back)
    for k, v in opt.state_dict()["state"].items():
        for n, t in v.items():
            mine = fresh.state_dict()["state"][k][n]
            assert type(mine) is type(t), (k, n, type(mine))
            assert torch.equal(mine.to_local() if isinstance(mine, DTensor) else mine,
                               t.to_local() if isinstance(t, DTensor) else t)
    model = from_local(got["model"], net.state_dict(), "model")
    net.load_state_dict(model)
    bad = dict(got["model"]); bad["0.weight"] = torch.zeros(5, 4)
    try:
        from_local(bad, net.state_dict(), "model")
    except ShardMismatch as e:
        assert "model.0.weight" in str(e) and "(5, 4)" in str(e), e
    else:
        raise AssertionError("a shard of the wrong shape was taken")
    print("OK")
    """
)


def test_dtensor_shards_travel_as_plain_tensors_and_come_back_laid_out_like_ours() -> None:
    # its own process: the test needs torch.distributed's default group
    out = subprocess.run(
        [sys.executable, "-c", SHARDS_SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


def test_a_mesh_keeps_its_replica_group_and_follows_the_world_in_its_first_dimension() -> None:
    assert mesh_shape((2, -1), 4, 2) == (2, 2)  # the start
    assert mesh_shape((-1, 2), 8, 2) == (4, 2)
    # a spare joining a job shrunk to one group: the group stays, the replicas follow
    assert mesh_shape((2, -1), 2, 2) == (1, 2)
    assert mesh_shape((2, 2), 6, 2) == (3, 2)
    assert mesh_shape((-1,), 2, 2) == (2,) and mesh_shape((4,), 4, 4) == (4,)
    assert mesh_shape((2, 2, -1), 8, 4) == (2, 2, 2)
    # a group size that is not the mesh's: refused, saying what to run
    with pytest.raises(ValueError, match="--group-size 2"):
        mesh_shape((2, -1), 4, 1)
    with pytest.raises(ValueError, match="--group-size 3"):
        mesh_shape((2, 3), 6, 2)
    with pytest.raises(ValueError, match="at most one -1"):
        mesh_shape((-1, -1), 4, 2)

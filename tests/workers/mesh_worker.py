"""One rank of an FSDP2 HSDP job on a (2, 2) mesh, for tests/integration/test_mesh.py.

``--mode ref``: torchrun's way (``init_process_group`` + ``init_device_mesh``).
``--mode phalanx``: a :class:`phalanx.runtime.mesh.Mesh` over a Communicator, with
plans made here (no bus); ``--regroup-at K`` re-points it at a new generation
(the same members) before step K; ``--die-at K`` makes rank ``--die-rank`` exit in
step K's forward, and every other rank writes whether its step body ended without
raising and with the step marked failed.

Writes the full (unsharded) weights, or the failure report, to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from phalanx.contract import Member, Plan
from phalanx.runtime.comm import CommError, Communicator, connect_store, generation_store
from phalanx.runtime.mesh import Mesh

SHAPE, NAMES = (2, 2), ("replicate", "shard")


class Guard:
    def __init__(self) -> None:
        self.in_step = False
        self.failed: CommError | None = None
        self.done = 0

    def collective_bound_s(self) -> float | None:
        return 10.0 if self.in_step else None

    def collective_started(self, bound_s: float, what: str) -> None:
        pass

    def collective_done(self, ms: float) -> None:
        self.done += 1

    def collective_failed(self, err: CommError) -> None:
        self.failed = self.failed or err


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)], nn.Linear(32, 4))


def plan(args: argparse.Namespace, generation: int) -> Plan:
    return Plan(
        job="mesh",
        generation=generation,
        members=[Member(worker=f"w{r}", rank=r) for r in range(args.world)],
        reason="test",
        store_prefix=f"{args.prefix}/gen{generation}",
        store_secret=args.prefix,  # the test hosts its store with this one secret
        store_addr=args.store,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ref", "phalanx"], required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--regroup-at", type=int, default=-1)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--die-rank", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    guard = Guard()
    comm: Communicator | None = None
    if args.mode == "ref":
        store = connect_store(args.store)
        dist.init_process_group(
            "gloo", store=generation_store(store, args.prefix), rank=args.rank, world_size=4
        )
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=NAMES)
    else:
        comm = Communicator(f"w{args.rank}", args.store)
        phx = Mesh(comm, SHAPE, NAMES, rank=args.rank, device_type="cpu")
        phx.set_guard(guard)
        mesh = phx.device_mesh
        # what FSDP2 will hold: the long-lived groups, not a generation's
        assert all(mesh.get_group(name) is group for name, group in zip(NAMES, phx.groups, strict=True))
    net = model()
    for block in net:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    if comm is not None:  # the first generation comes after the model is wrapped, as under job.steps()
        comm.configure(plan(args, 1), cancelled=lambda: False, arrival_s=30.0, connect_s=30.0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    torch.manual_seed(1 + args.rank)
    for step in range(args.steps):
        if comm is not None and step == args.regroup_at:
            comm.configure(plan(args, 2), cancelled=lambda: False, arrival_s=30.0, connect_s=30.0)
        x = torch.randn(8, 32)
        guard.in_step = True
        if step == args.die_at and args.rank == args.die_rank:
            os._exit(3)
        try:
            loss = net(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=0.5)  # DTensor: funcol
            if guard.failed is None:
                opt.step()
        except Exception as exc:  # what the guard must prevent
            import traceback

            args.out.write_text(
                json.dumps({"raised": repr(exc)[:500], "where": traceback.format_exc()[-3000:]})
            )
            return 1
        guard.in_step = False
        if guard.failed is not None:
            args.out.write_text(json.dumps({"raised": None, "failed": str(guard.failed)[:500], "step": step}))
            # Out without tearing down: torch 2.13 aborts now and then destroying a gloo
            # group whose peer died ("terminate called without an active exception", a
            # clean-clone CI run), after the report this test reads is written.
            sys.stdout.flush()
            os._exit(0)
    full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    torch.save({k: v.clone() for k, v in full.items()}, args.out)
    if comm is not None:
        comm.barrier(30.0)
        comm.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())

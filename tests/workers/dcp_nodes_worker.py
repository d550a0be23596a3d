"""One rank of an FSDP2 job saving or loading a DCP checkpoint through the tiers, for
tests/integration/test_dcp_nodes.py. Its node's keeper is ``PHALANX_KEEPER_NODE`` under
``PHALANX_SHM_ROOT`` (set by the test): ranks of different nodes talk to different keepers.

``--mode save``: HSDP on a (2, 2) mesh over gloo (world 4); for each step of ``--steps``
one AdamW step, then ``dcp.async_save`` through :class:`TieredWriter`; rank 0 writes the
full model and optimizer state of each step to ``<out>/full<step>.pt``.

``--mode load``: FSDP2 on a 1-D mesh of ``--world`` ranks (another shard count);
``dcp.load`` of ``--step`` through :class:`TieredReader` and, into a second state, through
DCP's own ``FileSystemReader`` at ``--ref`` (a plain directory of the same files); writes
``<out>/load<rank>.json`` (whether the two are equal tensor by tensor, where the parts came
from) and rank 0 the full state loaded through the tiers to ``<out>/loaded.pt``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from phalanx.checkpoint.dcp import TieredReader, TieredWriter

JOB = "dcpn"
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def sharded(mesh: DeviceMesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(32, 48), nn.GELU()),
        nn.Sequential(nn.Linear(48, 48), nn.GELU()),
        nn.Linear(48, 8),
    )
    for block in model[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    model(torch.randn(8, 32, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k in sorted(tree, key=str):
            out.update(flat(tree[k], f"{prefix}{k}."))
        return out
    if isinstance(tree, list):
        return flat(dict(enumerate(tree)), prefix)
    return {prefix[:-1]: tree}


def save(args: argparse.Namespace, rank: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, opt = sharded(mesh)
    for step in args.steps:
        train_step(model, opt, step, rank)
        msd, osd = get_state_dict(model, opt)
        dcp.async_save({"model": msd, "optim": osd}, storage_writer=TieredWriter(JOB, step)).result()
        fm, fo = get_state_dict(model, opt, options=FULL)
        if rank == 0:
            torch.save({"model": fm, "optim": fo}, args.out / f"full{step}.pt")


def load(args: argparse.Namespace, rank: int) -> None:
    mesh = init_device_mesh("cpu", (args.world,))
    states = []
    for _ in range(2):
        model, opt = sharded(mesh)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()  # the optimizer's state exists: DCP loads into it
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        states.append(({"model": msd, "optim": osd}, model, opt))
    (tiered, model, opt), (reference, _, _) = states
    reader = TieredReader(JOB, args.step)
    dcp.load(tiered, storage_reader=reader)
    dcp.load(reference, storage_reader=dcp.FileSystemReader(args.ref))
    a, b = flat(tiered), flat(reference)
    equal = a.keys() == b.keys() and all(
        torch.equal(full(a[k]), full(b[k])) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        for k in sorted(a)
    )
    set_state_dict(model, opt, model_state_dict=tiered["model"], optim_state_dict=tiered["optim"])
    fm, fo = get_state_dict(model, opt, options=FULL)
    if rank == 0:
        torch.save({"model": fm, "optim": fo}, args.out / "loaded.pt")
    report = {
        "equal": equal,
        "tensors": sum(isinstance(v, torch.Tensor) for v in a.values()),
        "step": reader.loaded.step,
        "parts": {name: got.tier for name, got in reader.parts.items()},
    }
    (args.out / f"load{rank}.json").write_text(json.dumps(report))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("save", "load"), required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", type=Path, required=True)  # a FileStore's file
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, nargs="*", default=[])
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--ref", type=Path, default=None)
    args = ap.parse_args()
    store = dist.FileStore(str(args.store), args.world)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    try:
        (save if args.mode == "save" else load)(args, args.rank)
        dist.barrier()  # no rank tears gloo down while its peer still uses the pair (a C++ abort at exit)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Managed tiered checkpoints: what a save blocks, how fast it is durable, how fast it restores.

    python -m bench.checkpoint [--gib 1.0] [--saves 3] [--skip-direct]

One state dict of ``--gib`` GiB (bench/checkpoint_baselines.make_state: a GPT-like
set of float32 tensors). The "training" side is this process, pinned to CPU 0 with
one torch thread; everything else -- nats-server, the keepers (state-replication
processes of nodes n1, n2, n3, n4, each its own shared memory and disk), the S3
server (moto, on loopback) and the overlapped save's copier thread -- is pinned to
CPU 1, as a training node's spare cores would take it.

- ``shm_copy_s``: a plain copy of the state into a reused shared-memory buffer (the
  floor on this box); ``dcp_async_blocked_s``: ``dcp.async_save`` of the same state
  with the best stager configuration (all are in ``dcp_async``), timed until the
  caller may change the state again -- with asynchronous staging that is when
  staging completes; the call alone is ``dcp_async_call_s``; ``direct_remote_save_s``:
  ``torch.save`` + upload (obstore's default parts, and the parts the object tier
  uses) and synchronous DCP straight to the S3 server, the best of them.
- The loop's step: a forward and backward of an MLP (``step_compute_s``), run at two
  lengths, ``short`` (about half the copy) and ``long`` (about three times it), then an
  optimizer step that would change the state.
- ``blocking_save_s`` (per step length): ``Checkpointer.save_async`` at a step
  boundary (slots reserved first, like the baseline's warm buffer), then the step's
  forward and backward beside the copy, then the fence before the optimizer step:
  the call plus the fence is what the loop waits for. ``--saves`` saves per length,
  each once the previous one is in object storage; ``durable_lag_s``: save called ->
  complete in object storage.
- ``digest_s``: SHA-256 per 64 MiB chunk of the whole state (what the keeper computes
  in ``take``, on its own core, after the slot is published; the manifest's digests that
  every copy is checked against), next to ``crc32_s`` (the CRC32 it replaced) and
  ``blake2b_s``, each timed here on the loop's core, one pass; ``take_s``: the
  keeper's whole take (digest and catalog write), from its ``complete`` events.
- ``drain_overhead_pct``: per save, the mean time of the long step (compute only)
  while the drains run (replica to n2, disk, shared path, object store) against
  before the first save; the median over the saves, every run in
  ``drain_overhead_runs_pct``.
- ``restore_memory_s`` (n1, which holds it), ``restore_peer_s`` (n3, fetching from
  a peer keeper), ``restore_remote_s`` (n4, object storage only, the others gone):
  ``Checkpointer.load`` plus copying into the training state, verified end to end.
  ``remote_bytes_read``: bytes fetched from the object store for that restore
  / state_bytes.

Prints one JSON line last. Needs ~4x the state in /dev/shm and ~6x in memory.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from nats.aio.msg import Msg

from bench.checkpoint_baselines import (
    dcp_async_blocked_s,
    direct_remote_save_s,
    make_state,
    shm_copy_s,
    state_bytes,
)
from phalanx.bus import Bus
from phalanx.checkpoint import Checkpointer
from phalanx.checkpoint.manifest import CHUNK, digest_chunks
from phalanx.contract import CheckpointEvent
from phalanx.contract.subjects import CHECKPOINT
from phalanx.devstack.localstack import LocalStack
from phalanx.devstack.s3server import S3Server

JOB = "bench-ckpt"
TRAIN_CPU, SYSTEM_CPU = 0, 1


def pin(pid: int, cpu: int) -> None:
    """Every thread of ``pid`` onto ``cpu`` (threads started later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except (ProcessLookupError, PermissionError):
            pass


def tails(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "median": round(statistics.median(s), 4),
        "p90": round(s[min(len(s) - 1, int(0.9 * len(s)))], 4),
        "max": round(s[-1], 4),
    }


class Steps:
    """The loop's stand-in: forward and backward of an MLP (``layers`` of 384 wide on
    a batch of 384), whose length the benchmark sets against the copy's."""

    def __init__(self, layers: int = 8) -> None:
        torch.manual_seed(0)
        linears = [torch.nn.Linear(384, 384) for _ in range(max(1, layers))]
        for layer in linears:  # norm-preserving: deep stacks neither vanish into denormals nor blow up
            torch.nn.init.orthogonal_(layer.weight)
            torch.nn.init.zeros_(layer.bias)
        self.model = torch.nn.Sequential(*linears)
        self.x = torch.randn(384, 384)

    def step(self) -> float:
        t0 = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        torch.tanh(self.model(self.x)).sum().backward()
        return time.perf_counter() - t0

    @classmethod
    def lasting(cls, seconds: float) -> Steps:
        """Steps whose forward and backward take about ``seconds`` on this core: resized
        from what the last size took until within 20% of it (at most 6 tries)."""
        steps = cls(8)
        for _ in range(6):
            for _ in range(3):
                steps.step()
            took = statistics.median(steps.step() for _ in range(5))
            if 0.8 * seconds <= took <= 1.2 * seconds:
                break
            steps = cls(max(1, round(len(steps.model) * seconds / took)))
        return steps


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[float, CheckpointEvent]] = []

    async def on_msg(self, event: CheckpointEvent, raw: Msg) -> None:
        self.seen.append((time.perf_counter(), event))

    def complete_at(self, step: int, tier: str) -> float | None:
        for t, e in self.seen:
            if (e.step, e.tier, e.state) == (step, tier, "complete"):
                return t
        return None


def hash_s(state: dict[str, torch.Tensor], fn: Callable[[memoryview], object]) -> float:
    """Seconds for ``fn`` over every ``CHUNK`` of every tensor of ``state``."""
    t0 = time.perf_counter()
    for t in state.values():
        view = t.contiguous().view(torch.uint8).numpy().data.cast("B")
        for i in range(0, len(view), CHUNK):
            fn(view[i : i + CHUNK])
    return time.perf_counter() - t0


def digest_costs(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """``digest_s`` (the manifest's SHA-256, as the keeper computes it), ``crc32_s`` and
    ``blake2b_s`` over the whole state, scaled to 1 GiB."""
    per_gib = (1 << 30) / state_bytes(state)
    digest = time.perf_counter()
    for t in state.values():
        digest_chunks(t.contiguous().view(torch.uint8).numpy().data.cast("B"))
    digest = time.perf_counter() - digest
    return {
        "digest_s": round(digest * per_gib, 4),
        "crc32_s": round(hash_s(state, zlib.crc32) * per_gib, 4),
        "blake2b_s": round(hash_s(state, lambda b: hashlib.blake2b(b, digest_size=32).digest()) * per_gib, 4),
    }


def restore_into(ckpt: Checkpointer, into: dict[str, torch.Tensor]) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    loaded = ckpt.load()
    for k, t in into.items():
        t.copy_(loaded.state["state"][k])
    total = time.perf_counter() - t0
    print(f"restore from {loaded.tier}: {total:.3f} s, keeper {loaded.seconds:.3f} s", file=sys.stderr)
    return total, loaded.tier, loaded.fetched_bytes


async def tiered(
    args: argparse.Namespace, state: dict[str, torch.Tensor], s3: S3Server, work: Path
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tiers = {
        **s3.env(),
        "PHALANX_CKPT_DISK": str(work / "disk"),
        "PHALANX_CKPT_SHARED": str(work / "shared"),
        "PHALANX_CKPT_OBJECT": "s3://tiers/ckpt",
        "PHALANX_CKPT_REPLICAS": "1",
        "PHALANX_CKPT_FSYNC": "1",
        "PHALANX_CKPT_DRAIN": args.drain,
    }
    stack = LocalStack(work / "stack", services=())
    await asyncio.to_thread(stack.start)
    try:
        assert stack.server is not None and stack.server.proc is not None
        pin(stack.server.proc.pid, SYSTEM_CPU)
        for node in ("n1", "n2", "n3"):
            key = await asyncio.to_thread(stack.start_keeper, node, tiers)
            pin(stack.procs[key].pid, SYSTEM_CPU)
        bus = await Bus.connect(stack.url, name="bench")
        events = Events()
        await bus.subscribe(CHECKPOINT.format(job=JOB), events.on_msg, CheckpointEvent)
        ckpt = Checkpointer(JOB, node="n1", worker="w0", root=stack.shm_root, copy_cpus={SYSTEM_CPU})
        await asyncio.to_thread(ckpt.reserve, {"step": 0, "state": state})
        # the copy as slow as it was measured, quiet or here: the long step must outlast it
        copy_s = max(args.copy_s, statistics.median(shm_copy_s(state, repeats=3)))
        lengths = {"short": Steps.lasting(0.5 * copy_s), "long": Steps.lasting(3.0 * copy_s)}
        drain_steps = lengths["long"]  # what the loop runs while the drains do
        for _ in range(5):
            drain_steps.step()
        baseline = [drain_steps.step() for _ in range(40)]
        step, during_all, overhead_runs = 0, [], []
        for name, steps in lengths.items():
            compute = [steps.step() for _ in range(5)]
            blocking, calls, fences, lag, plain = [], [], [], [], []
            for _ in range(args.saves):
                step += 100
                plain += shm_copy_s(state, repeats=1)  # the floor, in the same conditions, just before
                t0 = time.perf_counter()
                pending = ckpt.save_async({"step": step, "state": state}, step)
                calls.append(time.perf_counter() - t0)
                assert pending is not None, "a save found no free slot"
                compute.append(steps.step())  # forward and backward, beside the copy
                f0 = time.perf_counter()
                pending.fence()  # the optimizer step would change the state here
                fences.append(time.perf_counter() - f0)
                blocking.append(calls[-1] + fences[-1])
                deadline = time.monotonic() + 600
                during = []
                while events.complete_at(step, "object") is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"checkpoint {step} not in object storage after 600 s")
                    during.append(drain_steps.step())  # the loop goes on while the keeper drains
                    await asyncio.sleep(0)
                assert pending.result(60) is not None, "the overlapped copy failed"
                done = events.complete_at(step, "object")
                assert done is not None
                lag.append(done - t0)
                during_all += during
                overhead_runs.append((statistics.fmean(during) / statistics.fmean(baseline) - 1) * 100)
            out.setdefault("step_compute_s", {})[name] = tails(compute)
            out.setdefault("blocking_save_s", {})[name] = tails(blocking)
            out.setdefault("blocking_save_runs_s", {})[name] = [round(x, 4) for x in blocking]
            out.setdefault("save_call_s", {})[name] = tails(calls)
            out.setdefault("fence_s", {})[name] = tails(fences)
            out.setdefault("shm_copy_interleaved_runs_s", {})[name] = [round(x, 4) for x in plain]
            out.setdefault("durable_lag_runs_s", {})[name] = [round(x, 3) for x in lag]
            lags = out.setdefault("_lags", [])
            lags += lag
        out["durable_lag_s"] = tails(out.pop("_lags"))
        out["take_s"] = tails(
            [e.seconds for _, e in events.seen if (e.tier, e.state, e.node) == ("memory", "complete", "n1")]
        )
        out["step_ms"] = {
            "no_checkpoint": tails([x * 1e3 for x in baseline]),
            "draining": tails([x * 1e3 for x in during_all]),
        }
        out["drain_overhead_runs_pct"] = [round(x, 2) for x in overhead_runs]
        out["drain_overhead_pct"] = round(statistics.median(overhead_runs), 2)
        out["drain_seconds"] = {
            tier: tails(
                [e.seconds for _, e in events.seen if (e.tier, e.state, e.node) == (tier, "complete", "n1")]
            )
            for tier in ("disk",)
        } | {
            tier: tails([e.seconds for _, e in events.seen if (e.tier, e.state) == (tier, "complete")])
            for tier in ("shared", "object")
        }
        out["tiers_complete"] = sorted({e.tier for _, e in events.seen if e.state == "complete"})

        last = step
        while not any(e.step == last and e.node == "n2" and e.state == "complete" for _, e in events.seen):
            await asyncio.sleep(0.05)  # the restores run once the last replica is in place
        into = {k: torch.zeros_like(v) for k, v in state.items()}  # a model's weights: pages already there
        mem_runs = []
        for _ in range(3):
            mem_s, mem_tier, _ = await asyncio.to_thread(restore_into, ckpt, into)
            assert mem_tier == "memory" and all(torch.equal(into[k], state[k]) for k in state)
            mem_runs.append(mem_s)
        peer_ckpt = Checkpointer(JOB, node="n3", worker="w0", root=stack.shm_root)
        peer_s, peer_tier, _ = await asyncio.to_thread(restore_into, peer_ckpt, into)
        assert peer_tier == "peer" and all(torch.equal(into[k], state[k]) for k in state)

        for key in list(stack.procs):  # n1..n3 are gone; n4 has only the object store
            stack.procs[key].kill()
            stack.procs[key].wait()
        remote_only = {
            k: v for k, v in tiers.items() if k not in ("PHALANX_CKPT_DISK", "PHALANX_CKPT_SHARED")
        }
        key = await asyncio.to_thread(stack.start_keeper, "n4", remote_only)
        pin(stack.procs[key].pid, SYSTEM_CPU)
        for t in into.values():
            t.zero_()
        remote_s, remote_tier, fetched = await asyncio.to_thread(
            restore_into, Checkpointer(JOB, node="n4", worker="w0", root=stack.shm_root), into
        )
        assert remote_tier == "object" and all(torch.equal(into[k], state[k]) for k in state)
        out.update(
            restore_memory_s=round(statistics.median(mem_runs), 4),
            restore_memory_runs_s=[round(x, 4) for x in mem_runs],
            restore_peer_s=round(peer_s, 4),
            restore_remote_s=round(remote_s, 4),
            remote_bytes_read=round(fetched / state_bytes(state), 4),
        )
        ckpt.close()
        await bus.close()
    finally:
        await asyncio.to_thread(stack.stop)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    p.add_argument("--saves", type=int, default=3, help="timed saves through Phalanx")
    p.add_argument("--skip-direct", action="store_true", help="skip the (slow) direct-to-S3 baseline")
    p.add_argument("--drain", default="object | disk, shared", help="the keepers' PHALANX_CKPT_DRAIN lanes")
    args = p.parse_args(argv)
    if os.cpu_count() is None or (os.cpu_count() or 0) < 2:
        p.error("needs 2 CPUs: one for the loop, one for the keepers and the object store")
    os.sched_setaffinity(0, {TRAIN_CPU})
    torch.set_num_threads(1)
    state = make_state(int(args.gib * (1 << 30)))
    work = Path(tempfile.mkdtemp(prefix="phalanx-bench-ckpt-"))
    shm_dir = Path(f"/dev/shm/phalanx-bench-{uuid.uuid4().hex[:8]}")
    os.environ["PHALANX_SHM_ROOT"] = str(shm_dir)
    try:
        return run(args, state, work)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)  # slots and replicas: gigabytes of RAM
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, state: dict[str, torch.Tensor], work: Path) -> int:
    nbytes = state_bytes(state)
    result: dict[str, Any] = {"bench": "checkpoint", "state_bytes": nbytes, "drain_lanes": args.drain}
    shm = shm_copy_s(state, repeats=5)
    result["shm_copy_s"] = tails(shm)
    args.copy_s = result["shm_copy_s"]["median"]
    digests = digest_costs(state)  # per GiB; the keeper's work, not the loop's
    dcp_runs = dcp_async_blocked_s(state, str(work), repeats=3)
    skipped = dcp_runs.pop("skipped")
    # Blocked = until the caller may change the state again: the call itself, and with
    # asynchronous staging the staging too (DCP: do not modify the state before
    # staging_completion). The call alone is reported as dcp_async_call_s.
    calls = {k: tails(v) for k, v in dcp_runs.items() if not k.endswith("+staged")}
    blocked = {
        k: tails(dcp_runs.get(f"{k}+staged", v)) for k, v in dcp_runs.items() if not k.endswith("+staged")
    }
    best = min(blocked, key=lambda k: blocked[k]["median"])
    result["dcp_async"] = {"blocked": blocked, "call": calls, "skipped": skipped, "best": best}
    result["dcp_async_blocked_s"] = blocked[best]
    result["dcp_async_call_s"] = calls[best]
    with S3Server() as s3:  # the tiers' object store, fresh
        assert s3.proc is not None
        pin(s3.proc.pid, SYSTEM_CPU)
        s3.create_bucket("tiers")
        for key, value in asyncio.run(tiered(args, state, s3, work)).items():
            result[key] = value
            if key == "blocking_save_s":
                result.update(digests)  # printed next to it
    if not args.skip_direct:
        with S3Server() as s3:  # a fresh one: moto keeps what it was sent in memory
            assert s3.proc is not None
            pin(s3.proc.pid, SYSTEM_CPU)
            s3.create_bucket("direct")
            direct = direct_remote_save_s(state, s3.endpoint, "direct")
        phases = {k: round(direct.pop(k), 3) for k in ("serialize_s", "upload_s")}
        result["direct_remote"] = {k: round(v, 3) for k, v in direct.items()}
        result["direct_remote_phases"] = phases
        result["direct_remote_save_s"] = round(min(direct.values()), 3)
    shm = result["shm_copy_s"]["median"]
    dcp_blocked = result["dcp_async_blocked_s"]["median"]
    for name, figures in result["blocking_save_s"].items():
        med = figures["median"]
        result.setdefault("blocking_vs_shm_copy", {})[name] = round(med / shm, 3)
        result.setdefault("blocking_vs_dcp_async", {})[name] = round(med / dcp_blocked, 3)
    if "direct_remote_save_s" in result:
        result["durable_lag_vs_direct"] = round(
            result["durable_lag_s"]["median"] / result["direct_remote_save_s"], 3
        )
        result["durable_lag_vs_upload_floor"] = round(
            result["durable_lag_s"]["median"] / phases["upload_s"], 3
        )
    result["restore_memory_vs_remote"] = round(result["restore_remote_s"] / result["restore_memory_s"], 2)
    result["restore_peer_vs_remote"] = round(result["restore_remote_s"] / result["restore_peer_s"], 2)
    result["cpu_layout"] = "loop on cpu0 (1 torch thread); copier, nats, keepers, moto on cpu1"
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

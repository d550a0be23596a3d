"""The CUDA path, checked on a machine with GPUs: ``python -m bench.gpu_check [--out DIR]``.

A prepared script: run as is, it takes a few minutes and prints one JSON object
as its last line on stdout (progress goes to stderr). Each part that cannot run
here says why under ``"skipped"``; a part that failed says so under ``"error"``
(and the exit status is 1).

a. ``env``: torch, CUDA and NCCL versions, the GPUs, the NCCL/torch settings.
b. ``state_transfer``: a ~1 GiB training state (model + two Adam-like moments,
   fp32, plus the CPU tensors a real state holds: Adam's ``step``, an RNG state)
   packed on ``cuda:0`` (``on_device``: pack, both checksums, unpack, and the old
   CPU-staged pack for comparison); with >= 2 GPUs, sent rank 0 -> rank 1 by
   ``send_state``/``recv_state`` over a 2-process NCCL :class:`Group`
   (checksum verified, bitwise compared with the sender's state), next to the raw
   buffer send/recv and device-to-device copies (``dst.copy_(src)`` within
   ``cuda:0`` and ``cuda:0`` -> ``cuda:1``); median and max GB/s of the repeats.
c. ``nccl_recovery``: with >= 3 GPUs (2 ranks + 1 spare), the user-loop example
   port (``examples.ddp_phalanx``) on a :class:`~phalanx.devstack.localstack.LocalStack`,
   fault-free, then with ``kill:w1@step=K``: downtime (the fault log's instant ->
   the last rank's first step in the final generation, from the job's
   ``RecoveryDone`` events), the recovery phases, and whether the final weights
   are bitwise equal (``NCCL_ALGO=Ring``; the ``env`` it ran with is reported).

d. ``nccl_shrink``: with >= 2 GPUs (one rank per GPU, up to 8; NCCL refuses two
   ranks on one GPU), the last rank is lost with no spare, and the survivors'
   next generation is built both ways through the real
   :class:`~phalanx.runtime.comm.Communicator`: a full NCCL init (mode ``off``)
   and ``ncclCommShrink`` of the previous communicator (mode ``require``, so a
   shrink that does not happen fails the part instead of timing the full init),
   alternately, ``--repeats`` times each. Per path: ``configure`` seconds (release,
   rendezvous, gloo, NCCL) and the NCCL part alone (ms), median and max over
   ranks and repeats; then an NCCL all-reduce and an NCCL send/recv between the
   new ranks 0 and 1 checked on the new communicator (the send/recv shows whether
   point-to-point works on a shrunk communicator, which torch's sources leave
   unclear). Needs torch with NCCL >= 2.27; an older one fails the ``require``
   path with the reason. Never run on the machine it was written on (no GPU).

``--cpu-dry-run`` runs the same orchestration on the CPU with gloo (2 processes,
small sizes, GPUs hidden from the jobs) so that the plumbing can be exercised on
any machine; its numbers say nothing about GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.detect import pct
from phalanx.checkpoint.packing import CRC32, WSUM31, checksum, pack, unpack
from phalanx.contract import Member, Plan
from phalanx.runtime.comm import Communicator, Group, arrival_barrier, backend_for, connect_store
from phalanx.runtime.nccl_shrink import ShrinkMode
from phalanx.runtime.state import recv_state, send_state
from phalanx.runtime.store import host_store

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
# What the recovery jobs run with: a fixed NCCL algorithm (and cuBLAS workspace) so
# that two runs can be compared bit for bit.
DETERMINISM_ENV = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

STORE_SECRET = "gpu-check"
"""The one generation secret the check's own stores serve (its ranks prove it)."""


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rates(nbytes: int, seconds: list[float]) -> dict[str, Any]:
    """Median and max throughput (GB/s, 1e9 bytes) of repeated timings."""
    med = pct(seconds, 50)
    return {
        "median_gbps": round(nbytes / med / 1e9, 3) if med else None,
        "max_gbps": round(nbytes / min(seconds) / 1e9, 3) if seconds and min(seconds) > 0 else None,
        "median_ms": round(med * 1000.0, 3) if med is not None else None,
        "repeats": len(seconds),
    }


def timed(device: torch.device, fn: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    """``fn()`` ``repeats`` times (after one warm-up): the durations and the last result."""
    out = fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times, out


# -- a: the environment --------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "nccl_available": dist.is_nccl_available(),
        "nccl": None,
        "gpus": gpus,
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "gpu_memory_gib": [
            round(torch.cuda.get_device_properties(i).total_memory / (1 << 30), 1) for i in range(gpus)
        ],
        "settings": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith(("NCCL_", "TORCH_NCCL_", "CUDA_VISIBLE_DEVICES", "CUBLAS_"))
        },
    }
    with contextlib.suppress(Exception):  # a CPU build has no NCCL to ask
        v = torch.cuda.nccl.version()
        info["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    if gpus >= 2:
        info["peer_access_0_1"] = torch.cuda.can_device_access_peer(0, 1)
    return info


# -- b: state transfer ---------------------------------------------------------------------------


def _pattern(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """``n`` finite fp32 values from exact integer arithmetic: the same bits on any device."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    bits = (i * 2654435761 + seed * 97531 + 12345).bitwise_and_(0x7F7FFFFF)  # exponent never all-ones
    return bits.to(torch.int32).view(torch.float32)


def make_state(nbytes: int, device: torch.device, layers: int = 32) -> dict[str, Any]:
    """A training state of about ``nbytes``: parameters and two Adam moments (fp32) on
    ``device``, and the CPU tensors a real one holds (Adam's step, an RNG state)."""
    per = max(1, nbytes // (12 * layers))
    return {
        "model": {f"layer{i}.weight": _pattern(per, 3 * i, device) for i in range(layers)},
        "optimizer": {
            "state": {
                i: {
                    "step": torch.tensor(float(i + 7)),
                    "exp_avg": _pattern(per, 3 * i + 1, device),
                    "exp_avg_sq": _pattern(per, 3 * i + 2, device),
                }
                for i in range(layers)
            },
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(layers))}],
        },
        "rng": torch.Generator().manual_seed(5).get_state(),
        "step": 7,
    }


def same_state(got: Any, sent: Any, device: torch.device) -> bool:
    """Bitwise equal, and each tensor where it belongs: CPU tensors of the sender on the
    CPU, the others on ``device`` (the receiver's buffer device)."""
    if isinstance(sent, torch.Tensor):
        want = "cpu" if sent.device.type == "cpu" else device.type
        return (
            isinstance(got, torch.Tensor)
            and got.device.type == want
            and got.dtype == sent.dtype
            and got.shape == sent.shape
            and torch.equal(got, sent.to(got.device))
        )
    if isinstance(sent, dict):
        return (
            isinstance(got, dict)
            and list(got) == list(sent)
            and all(same_state(got[k], sent[k], device) for k in sent)
        )
    if isinstance(sent, list | tuple):
        return (
            type(got) is type(sent)
            and len(got) == len(sent)
            and all(same_state(a, b, device) for a, b in zip(got, sent, strict=True))
        )
    return bool(got == sent)


def on_device(device: torch.device, nbytes: int, repeats: int) -> dict[str, Any]:
    """Pack, checksum and unpack on one device, and the copies to compare with."""
    state = make_state(nbytes, device)
    sync(device)
    pack_s, (meta, buf) = timed(device, lambda: pack(state, device), repeats)
    size = buf.numel()
    out: dict[str, Any] = {"device": str(device), "buffer_bytes": size}
    out["pack"] = rates(size, pack_s)
    kind = WSUM31 if device.type != "cpu" else CRC32
    sum_s, crc = timed(device, lambda: checksum(buf), repeats)
    out["checksum_default"] = {"kind": kind, **rates(size, sum_s)}
    wsum_s, _ = timed(device, lambda: checksum(buf, WSUM31), repeats)
    out["checksum_wsum31"] = rates(size, wsum_s)
    if device.type != "cpu":
        head = buf[: min(size, 64 * MIB)]
        out["wsum31_device_equals_cpu"] = checksum(head, WSUM31) == checksum(head.cpu(), WSUM31)
        crc_s, _ = timed(device, lambda: checksum(buf, CRC32), 1)  # through host memory
        out["checksum_crc32_via_host"] = rates(size, crc_s)
        staged_s, _ = timed(device, lambda: pack(state), 1)
        out["pack_staged_through_cpu"] = rates(size, staged_s)
    unpack_s, got = timed(device, lambda: unpack(meta, buf), repeats)
    out["unpack"] = rates(size, unpack_s)
    out["round_trip_bitwise_equal"] = same_state(got, state, device)
    out["checksum_repeatable"] = checksum(buf) == crc
    dst = torch.empty_like(buf)
    copy_s, _ = timed(device, lambda: dst.copy_(buf), repeats)
    out["copy_within_device"] = rates(size, copy_s)
    return out


def copy_peer(src: torch.device, dst: torch.device, nbytes: int, repeats: int) -> dict[str, Any]:
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)

    def go() -> None:
        b.copy_(a)
        sync(src)

    times, _ = timed(dst, go, repeats)
    return {"from": str(src), "to": str(dst), **rates(nbytes, times)}


def _transfer_rank(
    rank: int, port: int, prefix: str, device_type: str, nbytes: int, repeats: int, q: Any
) -> None:
    """One of the two ranks of :func:`transfer` (a spawned process)."""
    out: dict[str, Any] = {"rank": rank}
    try:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        store = connect_store(f"127.0.0.1:{port}")
        store.prove(STORE_SECRET)  # the prefix's first part: its keys are this client's
        arrival_barrier(store, prefix, rank, 2, lambda: False, timeout_s=120.0)
        t0 = time.perf_counter()
        comm = Group(store, prefix, rank, 2, timeout_s=120.0, bind="127.0.0.1", device=device)
        comm.barrier()
        out["comm_init_s"] = round(time.perf_counter() - t0, 4)
        out["backend"] = backend_for(device)
        state = make_state(nbytes, device)  # the receiver's copy is the reference to compare with
        sync(device)
        meta, buf = pack(state, device)
        crc = checksum(buf)
        sync(device)
        out["buffer_bytes"] = buf.numel()
        seconds, raw_seconds = [], []
        for i in range(repeats + 1):  # the first is a warm-up (and the one verified)
            comm.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                send_state(comm, meta, buf, crc, 1)
            else:
                got, _ = recv_state(comm, 0)  # raises on a checksum mismatch
                sync(device)
            if i:
                seconds.append(time.perf_counter() - t0)
            elif rank == 1:
                out["checksum_verified"] = True
                out["bitwise_equal"] = same_state(got, state, device)
            got = None
        rbuf = torch.empty_like(buf)
        for i in range(repeats + 1):
            comm.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                comm.send(buf, 1)
            else:
                comm.recv(rbuf, 0)
                sync(device)
            if i:
                raw_seconds.append(time.perf_counter() - t0)
        if rank == 1:
            out["raw_equal"] = bool(torch.equal(rbuf, buf))
        out["send_recv_state_s"], out["raw_send_recv_s"] = seconds, raw_seconds
        comm.barrier()
        comm.destroy()
    except BaseException as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        out["traceback"] = traceback.format_exc()[-3000:]
    q.put(out)


def transfer(device_type: str, nbytes: int, repeats: int, timeout_s: float = 240.0) -> dict[str, Any]:
    """Rank 0 -> rank 1, two processes, one device each: ``send_state``/``recv_state``
    and the raw buffer, both timed on the receiver from a common barrier."""
    store = host_store("127.0.0.1", secrets=(STORE_SECRET,))
    prefix = f"{STORE_SECRET}/{os.getpid()}/{time.time_ns()}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_transfer_rank, args=(r, store.port, prefix, device_type, nbytes, repeats, q))
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < 2:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"transfer ranks still running after {timeout_s}s")
            r = q.get(timeout=left)
            results[r["rank"]] = r
    finally:
        for p in procs:
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: res["error"] for r, res in results.items() if "error" in res}
    if errors:
        tb = next(res.get("traceback", "") for res in results.values() if "error" in res)
        raise RuntimeError(f"transfer ranks failed: {errors}\n{tb}")
    recv, send = results[1], results[0]
    size = int(recv["buffer_bytes"])
    return {
        "backend": recv["backend"],
        "buffer_bytes": size,
        "comm_init_s": [send["comm_init_s"], recv["comm_init_s"]],
        "send_recv_state": rates(size, recv["send_recv_state_s"]),
        "raw_send_recv": rates(size, recv["raw_send_recv_s"]),
        "checksum_verified": recv.get("checksum_verified", False),
        "bitwise_equal": recv.get("bitwise_equal", False),
        "raw_equal": recv.get("raw_equal", False),
    }


def state_transfer(dry_run: bool, nbytes: int, repeats: int) -> dict[str, Any]:
    gpus = 0 if dry_run or not torch.cuda.is_available() else torch.cuda.device_count()
    if not dry_run and gpus == 0:
        return {"skipped": "needs a CUDA GPU, found none (--cpu-dry-run runs the plumbing on the CPU)"}
    device = torch.device("cpu") if dry_run else torch.device("cuda", 0)
    out: dict[str, Any] = {"requested_bytes": nbytes}
    log(f"state transfer: on {device}, {nbytes / MIB:.0f} MiB")
    out["on_device"] = on_device(device, nbytes, repeats)
    if dry_run:
        out["copy_peer"] = {"skipped": "cpu dry run: one device"}
        log("state transfer: 2 processes over gloo")
        out["send_recv"] = transfer("cpu", nbytes, repeats)
    elif gpus >= 2:
        out["copy_peer"] = copy_peer(torch.device("cuda", 0), torch.device("cuda", 1), nbytes, repeats)
        torch.cuda.empty_cache()  # the ranks' processes need the memory
        log("state transfer: cuda:0 -> cuda:1 over NCCL (2 processes)")
        out["send_recv"] = transfer("cuda", nbytes, repeats)
    else:
        out["copy_peer"] = {"skipped": f"needs >= 2 GPUs, found {gpus}"}
        out["send_recv"] = {"skipped": f"NCCL send/recv needs >= 2 GPUs (one per rank), found {gpus}"}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


# -- c: recovery of a killed rank over NCCL ------------------------------------------------------


def _example_takes_device() -> bool:
    """Whether examples.ddp_phalanx's command line has ``--device``."""
    from examples.mlp import parse_args

    with contextlib.redirect_stderr(io.StringIO()):
        try:
            parse_args(["--device", "cpu"])
        except SystemExit:
            return False
    return True


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _weights_equal(a: Path, b: Path) -> tuple[bool, list[str]]:
    wa = torch.load(a, map_location="cpu", weights_only=True)
    wb = torch.load(b, map_location="cpu", weights_only=True)
    if wa.keys() != wb.keys():
        return False, sorted(set(wa) ^ set(wb))
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    return not different, different


def nccl_recovery(out: Path, dry_run: bool, steps: int, fault_step: int) -> dict[str, Any]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not dry_run and gpus < 3:
        return {"skipped": f"needs >= 3 GPUs (2 ranks + 1 spare), found {gpus}"}
    if not (REPO / "examples" / "ddp_phalanx.py").exists():
        return {"skipped": "examples/ddp_phalanx.py is not in this checkout"}
    from phalanx.devstack.localstack import LocalStack

    device = "cpu" if dry_run else "cuda"
    env = dict(DETERMINISM_ENV)
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the jobs run on the CPU even where GPUs exist
    env["PHALANX_DATA_CACHE_DIR"] = str(out / "datacache")
    nproc, batch = 2, 32
    cmd = [sys.executable, "-m", "examples.ddp_phalanx", "--steps", str(steps), "--batch-size", str(batch)]
    if _example_takes_device():
        cmd += ["--device", device]
    job_timeout_s = 120.0 if dry_run else 180.0
    fault = f"kill:w1@step={fault_step}"
    fault_log = out / "faults.jsonl"
    ref_w, run_w = out / "fault_free.pt", out / "faulty.pt"
    ref_log, run_log = out / "fault_free.steps", out / "faulty.steps"
    stamp = int(time.time())
    services = ("failure-detector", "elasticity-planner")
    with LocalStack(
        out / "stack", services=services, env={"PHALANX_DATA_CACHE_DIR": env["PHALANX_DATA_CACHE_DIR"]}
    ) as stack:
        log(f"recovery: fault-free run, {nproc} ranks + 1 spare, {steps} steps on {device}")
        ref = stack.run_job(
            f"gpuref{stamp}",
            [*cmd, "--save", str(ref_w), "--steps-log", str(ref_log)],
            nproc=nproc,
            spares=1,
            global_batch=batch * nproc,
            timeout_s=job_timeout_s,
            env=env,
        )
        if ref.returncode != 0:
            raise RuntimeError(
                f"the fault-free run failed ({ref.returncode}): {[d.reason for d in ref.decisions]}"
            )
        log(f"recovery: the same with {fault}")
        run = stack.run_job(
            f"gpufault{stamp}",
            [*cmd, "--save", str(run_w), "--steps-log", str(run_log)],
            nproc=nproc,
            spares=1,
            faults=fault,
            global_batch=batch * nproc,
            timeout_s=job_timeout_s,
            env={**env, "PHALANX_FAULT_LOG": str(fault_log)},
        )
    if run.returncode != 0:
        raise RuntimeError(f"the faulty run failed ({run.returncode}): {[d.reason for d in run.decisions]}")
    strikes = _read_jsonl(fault_log)
    if not strikes or not run.plans:
        raise RuntimeError(f"no fault struck (fault log {strikes}, plans {len(run.plans)})")
    fault_ts = float(strikes[0]["ts"])
    gen = max(p.generation for p in run.plans)
    first = [r for r in run.recoveries if r.generation == gen]
    if not first:
        raise RuntimeError(f"no RecoveryDone for generation {gen}")
    phases = sorted({k for r in first for k in r.phases_ms})
    equal, different = _weights_equal(ref_w, run_w)
    steps_log = _read_jsonl(run_log)
    return {
        "device": device,
        "command": [Path(cmd[0]).name, *cmd[1:]],
        "env": env,
        "ranks": nproc,
        "spares": 1,
        "steps": steps,
        "fault": fault,
        "decisions": [str(d.action) for d in run.decisions],
        "final_generation": gen,
        "downtime_s": round(max(r.ts for r in first) - fault_ts, 4),
        "detect_ms": round((run.faults[0].ts - fault_ts) * 1000.0, 1) if run.faults else None,
        "phases_ms_max_over_ranks": {
            p: round(max(r.phases_ms.get(p, 0.0) for r in first), 2) for p in phases
        },
        "resumed_at_step": min((r.step for r in first), default=None),
        "steps_logged": len(steps_log),
        "weights_bitwise_equal": equal,
        "weights_different": different[:20],
        "wall_s": {"fault_free": round(ref.wall_s, 2), "faulty": round(run.wall_s, 2)},
    }


# -- d: shrinking the NCCL communicator after a rank is lost ------------------------------------


def _shrink_plan(addr: str, run: str, generation: int, world: int, shrunk: list[int]) -> Plan:
    """Generation ``generation`` of workers w0..w{world-1}; ``shrunk``: the previous
    generation's ranks left out (the planner's ``Plan.shrunk``), an unplanned loss."""
    return Plan(
        job="gpucheck",
        generation=generation,
        members=[Member(worker=f"w{r}", rank=r) for r in range(world)],
        reason="gpu_check shrink",
        store_prefix=f"gpu-check-shrink/{run}/gen{generation}",
        store_secret=STORE_SECRET,
        store_addr=addr,
        shrunk=shrunk,
    )


def _shrink_rank(rank: int, n: int, port: int, run: str, device_type: str, repeats: int, q: Any) -> None:
    """One of the ``n`` ranks of :func:`shrink_paths` (a spawned process): per
    repeat and path, a generation of all ``n``, then one without the last rank."""
    out: dict[str, Any] = {"rank": rank, "paths": {}}
    try:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        addr = f"127.0.0.1:{port}"
        comm = Communicator(f"w{rank}", addr, bind="127.0.0.1", device=device, nccl_shrink=ShrinkMode.AUTO)
        lost, generation = n - 1, 0

        def configure(plan: Plan) -> None:
            comm.configure(plan, cancelled=lambda: False, arrival_s=120.0, connect_s=120.0)

        for _ in range(repeats):
            for path, mode in (("full_init", ShrinkMode.OFF), ("shrink", ShrinkMode.REQUIRE)):
                rec = out["paths"].setdefault(path, {"configure_s": [], "nccl_ms": [], "how": []})
                generation += 1
                comm.nccl_shrink = ShrinkMode.AUTO  # the generation before the loss parks its NCCL comm
                configure(_shrink_plan(addr, run, generation, n, []))
                t = torch.ones(4, device=device)
                comm.allreduce_sum_(t, 60.0)
                if int(t[0]) != n:
                    raise RuntimeError(f"all-reduce of {n} ranks gave {t.tolist()}")
                generation += 1
                if rank == lost:  # lost, no spare: its NCCL communicator goes (aborted, as by death)
                    comm.nccl_shrink = ShrinkMode.OFF
                    comm.release()
                    continue
                comm.nccl_shrink = mode  # read by release() (park or abort) and by the shrink vote
                t0 = time.perf_counter()
                configure(_shrink_plan(addr, run, generation, n - 1, [lost]))
                sync(device)
                rec["configure_s"].append(time.perf_counter() - t0)
                built = comm.held().nccl_built
                rec["how"].append(built.get("how", "gloo only"))
                if "ms" in built:
                    rec["nccl_ms"].append(built["ms"])
                t = torch.ones(4, device=device)
                comm.allreduce_sum_(t, 60.0)
                rec["allreduce_ok"] = rec.get("allreduce_ok", True) and int(t[0]) == n - 1
                if n - 1 >= 2 and comm.rank in (0, 1):  # point to point on the new communicator
                    buf = torch.full((1024,), float(generation), device=device)
                    if comm.rank == 0:
                        comm.send(buf, 1, timeout_s=60.0)
                    else:
                        got = torch.zeros_like(buf)
                        comm.recv(got, 0, timeout_s=60.0)
                        rec["send_recv_ok"] = rec.get("send_recv_ok", True) and bool(torch.equal(got, buf))
                comm.barrier(60.0)
        comm.nccl_shrink = ShrinkMode.OFF
        comm.release()
    except BaseException as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        out["traceback"] = traceback.format_exc()[-3000:]
    q.put(out)


def shrink_paths(dry_run: bool, repeats: int, timeout_s: float = 420.0) -> dict[str, Any]:
    """Full NCCL re-init against ncclCommShrink after the last rank is lost with no
    spare, one process per GPU; on a CPU dry run the same orchestration over gloo
    (3 processes), where both paths are the same gloo build."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not dry_run and gpus < 2:
        return {
            "skipped": f"needs >= 2 GPUs (one rank per GPU: NCCL refuses two ranks on one GPU), found {gpus}"
        }
    n = 3 if dry_run else min(gpus, 8)
    device_type = "cpu" if dry_run else "cuda"
    store = host_store("127.0.0.1", secrets=(STORE_SECRET,))
    run = f"{os.getpid()}-{time.time_ns()}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    env_shrink = os.environ.pop("PHALANX_NCCL_SHRINK", None)  # the ranks set the mode themselves
    log(f"nccl shrink: {n} ranks on {device_type}, the last one lost, {repeats} repeat(s) per path")
    procs = [
        ctx.Process(target=_shrink_rank, args=(r, n, store.port, run, device_type, repeats, q))
        for r in range(n)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"shrink ranks still running after {timeout_s}s")
            r = q.get(timeout=left)
            results[r["rank"]] = r
    finally:
        if env_shrink is not None:
            os.environ["PHALANX_NCCL_SHRINK"] = env_shrink
        for p in procs:
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: res["error"] for r, res in results.items() if "error" in res}
    if errors:
        tb = next(res.get("traceback", "") for res in results.values() if "error" in res)
        raise RuntimeError(f"shrink ranks failed: {errors}\n{tb}")
    survivors = [results[r] for r in range(n - 1)]
    out: dict[str, Any] = {"ranks": n, "lost": [n - 1], "backend": backend_for(torch.device(device_type))}
    for path in ("full_init", "shrink"):
        recs = [s["paths"][path] for s in survivors]
        conf = [x for rec in recs for x in rec["configure_s"]]
        nccl = [x for rec in recs for x in rec["nccl_ms"]]
        out[path] = {
            "configure_s_median": round(float(pct(conf, 50) or 0.0), 4) if conf else None,
            "configure_s_max": round(max(conf), 4) if conf else None,
            "nccl_ms_median": round(float(pct(nccl, 50) or 0.0), 2) if nccl else None,
            "nccl_ms_max": round(max(nccl), 2) if nccl else None,
            "how": sorted({h for rec in recs for h in rec["how"]}),
            "allreduce_ok": all(rec.get("allreduce_ok", False) for rec in recs),
            "send_recv_ok": all(rec.get("send_recv_ok", True) for rec in recs) if n - 1 >= 2 else None,
            "repeats": repeats,
        }
    return out


# -- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="working files (logs, weights, result.json); default: a temp dir")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same orchestration on CPU/gloo, small")
    ap.add_argument("--mib", type=int, default=None, help="state size in MiB (default 1024; dry run 16)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=None, help="recovery: steps (default 40; dry run 12)")
    ap.add_argument("--fault-step", type=int, default=None, help="recovery: kill w1 in this step")
    ap.add_argument("--skip", action="append", default=[], choices=["transfer", "recovery", "shrink"])
    args = ap.parse_args(argv)
    dry = args.cpu_dry_run
    nbytes = (args.mib if args.mib is not None else (16 if dry else 1024)) * MIB
    steps = args.steps if args.steps is not None else (12 if dry else 40)
    fault_step = args.fault_step if args.fault_step is not None else max(1, min(steps - 2, steps // 3 + 1))
    if args.repeats < 1 or steps < 3 or not 1 <= fault_step < steps:
        ap.error("--repeats >= 1, --steps >= 3 and 1 <= --fault-step < --steps")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="phalanx-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result: dict[str, Any] = {"dry_run": dry, "out": str(out), "env": environment()}
    failed = False
    parts: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("state_transfer", lambda: state_transfer(dry, nbytes, args.repeats)),
        ("nccl_recovery", lambda: nccl_recovery(out, dry, steps, fault_step)),
        ("nccl_shrink", lambda: shrink_paths(dry, args.repeats)),
    ]
    for (name, fn), skip in zip(parts, ("transfer", "recovery", "shrink"), strict=True):
        if skip in args.skip:
            result[name] = {"skipped": f"--skip {skip}"}
            continue
        try:
            result[name] = fn()
        except Exception as exc:
            failed = True
            log(traceback.format_exc())
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    result["wall_s"] = round(time.time() - t0, 1)
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

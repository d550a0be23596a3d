"""Runs one baseline trial (torchrun + DDP + DCP, bench/baseline/train_ddp.py) and
measures what a fault costs it.

    python -m bench.baseline.run [--nproc 4] [--steps 40] [--kill-at-step 23] [--kill-rank 1]

:func:`run_trial` launches ``torchrun`` (as ``python -m torch.distributed.run`` of
the running interpreter, so the same virtualenv) with ``--max-restarts 3`` and a
c10d rendezvous on a free loopback port, with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(without it, restarts fail on stale gloo peer addresses: PyTorch issue 135712).
It then reads the trial's JSON-lines log:

- ``fault_step``: the step after which the victim killed itself; the fault time is
  the wall time the victim wrote just before its SIGKILL;
- ``downtime_s``: fault time to the first step completed after the restart;
- ``lost_steps``: steps completed before the fault and done again after it
  (``fault_step - resume_step + 1``);
- ``catchup_s``: fault time to the completion of ``fault_step + 1``, the first new
  step (downtime plus the redone steps);
- ``total_s``: wall time of the whole torchrun run; ``final_step``: the last step
  completed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.baseline.torchrun import REPO, TorchrunFailed, torchrun_command, torchrun_env
from examples.corpus import DEFAULT_OUT, build_corpus

SCRIPT = REPO / "bench" / "baseline" / "train_ddp.py"


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The trial's numbers from its log (see the module docstring)."""
    steps = [e for e in events if e["event"] == "step"]
    if not steps:
        raise ValueError("the log has no completed step")
    faults = [e for e in events if e["event"] == "fault"]
    attempts = sorted({e["attempt"] for e in events if e["event"] == "start"})
    first_attempt = [e["step_s"] for e in steps if e["attempt"] == 0]
    out: dict[str, Any] = {
        "final_step": max(e["step"] for e in steps),
        "restarts": max(attempts) if attempts else 0,
        "steady_step_s": statistics.median(first_attempt[1:]) if len(first_attempt) > 1 else None,
        "ckpt_s": statistics.median(e["ckpt_s"] for e in events if e["event"] == "ckpt")
        if any(e["event"] == "ckpt" for e in events)
        else None,
        "fault_step": None,
        "downtime_s": None,
        "lost_steps": None,
        "resume_step": None,
        "catchup_s": None,
    }
    if not faults:
        return out
    fault = faults[0]
    after = sorted((e for e in steps if e["attempt"] > fault["attempt"]), key=lambda e: e["time"])
    if not after:
        raise ValueError("no step completed after the fault")
    first = after[0]
    out["fault_step"] = fault["step"]
    out["resume_step"] = first["step"]
    out["downtime_s"] = first["time"] - fault["time"]
    out["lost_steps"] = max(0, fault["step"] - first["step"] + 1)
    new = [e for e in after if e["step"] > fault["step"]]
    out["catchup_s"] = new[0]["time"] - fault["time"] if new else None
    restart = [e for e in events if e["event"] == "start" and e["attempt"] == first["attempt"]]
    if restart:
        r = restart[0]
        out["restart_phases_s"] = {  # where the downtime went, on rank 0
            "to_new_process": (r["proc_start"] - fault["time"]) if r.get("proc_start") else None,
            "to_process_group": r["pg_ready"] - fault["time"],
            "to_checkpoint_loaded": r["time"] - fault["time"],
        }
    return out


def script_args(
    data: str | os.PathLike[str],
    steps: int,
    global_batch: int,
    seq_len: int,
    seed: int,
    ckpt: Path,
    ckpt_every: int,
    log: Path,
) -> list[str]:
    """The arguments of bench/baseline/train_ddp.py for one trial."""
    args = {
        "--data": data,
        "--steps": steps,
        "--global-batch": global_batch,
        "--seq-len": seq_len,
        "--seed": seed,
        "--ckpt-dir": ckpt,
        "--ckpt-every": ckpt_every,
        "--log-file": log,
    }
    return [str(x) for kv in args.items() for x in kv]


def run_trial(
    workdir: str | os.PathLike[str],
    nproc: int = 4,
    steps: int = 40,
    kill_at_step: int | None = 23,
    kill_rank: int = 1,
    ckpt_every: int = 10,
    *,
    global_batch: int = 16,
    seq_len: int = 128,
    seed: int = 0,
    data: str | os.PathLike[str] | None = None,
    max_restarts: int = 3,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """One torchrun trial in ``workdir`` (which must not hold an earlier trial's log
    or checkpoints); returns the numbers of :func:`summarize` plus ``total_s`` and
    the paths of the log and of torchrun's output."""
    work = Path(workdir)
    log, ckpt, out_path = work / "log.jsonl", work / "ckpt", work / "torchrun.out"
    if log.exists() or (ckpt.exists() and any(ckpt.iterdir())):
        raise FileExistsError(f"{work} holds an earlier trial; use a fresh directory")
    work.mkdir(parents=True, exist_ok=True)
    if data is None:
        data = REPO / DEFAULT_OUT
        build_corpus(Path(data))  # idempotent
    cmd = torchrun_command(
        nproc,
        [str(SCRIPT), *script_args(data, steps, global_batch, seq_len, seed, ckpt, ckpt_every, log)],
        max_restarts=max_restarts,
    )
    if kill_at_step is not None:
        cmd += ["--kill-at-step", str(kill_at_step), "--kill-rank", str(kill_rank)]
    env = torchrun_env()
    t0 = time.time()
    with open(out_path, "wb") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    total = time.time() - t0
    if proc.returncode != 0:
        tail = out_path.read_text(errors="replace")[-3000:]
        raise TorchrunFailed(f"torchrun exited with {proc.returncode}; output tail:\n{tail}")
    result = summarize(read_log(log))
    if result["final_step"] != steps - 1:
        raise RuntimeError(f"the run ended at step {result['final_step']}, not {steps - 1}")
    return {**result, "total_s": total, "nproc": nproc, "log": str(log), "output": str(out_path)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.baseline.run", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workdir", type=Path, default=None, help="default: a new directory under .phalanx/bench"
    )
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-at-step", type=int, default=23, help="-1: no fault")
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=16)
    args = ap.parse_args(argv)
    work = args.workdir or REPO / ".phalanx" / "bench" / f"baseline-{time.strftime('%Y%m%d-%H%M%S')}"
    result = run_trial(
        work,
        args.nproc,
        args.steps,
        None if args.kill_at_step < 0 else args.kill_at_step,
        args.kill_rank,
        args.ckpt_every,
        global_batch=args.global_batch,
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

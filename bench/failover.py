"""Planner failover: the leader is SIGKILLed mid-incident; how long until the standby's plan?

    python -m bench.failover [--trials 10] [--lease-ttl 1.0]

A real nats-server and two ``elasticity-planner`` processes (leader and standby,
one lease in KV). Each trial opens a new job the way launchers do (a job spec,
the planner's answer, the workers' registrations: 3 ranks and a spare) and waits
for generation 1. Then it SIGKILLs the current leader and at once publishes the
crash of rank 1 (as the failure-detector would). ``planner_failover_s`` is the
time from the kill to the standby's committed plan (generation 2, the spare in
rank 1, a higher fencing token), as the plan subject delivers it. The killed
planner is started again as the next trial's standby.

The standby asks the lease holder at each of its steps whether it is there, and
takes over as soon as the server answers that no one listens on the holder's own
subject (its connection closed with the process); otherwise once the lease's
revision has not moved for the TTL (``PHALANX_PLANNER_LEASE_TTL_S``, default 1 s).
Then it rewinds the consumers the dead leader held and decides. Targets: median
<= 0.3 s, max <= 0.5 s. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg
from phalanx.services.elasticity_planner.lease import leader_pid

from bench.detect import pct
from phalanx.bus import Bus
from phalanx.contract import FaultCause, JobSpec, NodeJoined, Plan, RankFailed, Registered, Role
from phalanx.contract.streams import JOBS_BUCKET
from phalanx.contract.subjects import FAILED, JOB_SPEC, JOINED, PLAN, REGISTERED
from phalanx.devstack.natsserver import NatsServer


class Planners:
    """Two planner processes; the one holding the lease is found from the lease record."""

    def __init__(self, url: str, work: Path, ttl_s: float) -> None:
        self.url, self.work, self.ttl_s = url, work, ttl_s
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self) -> subprocess.Popen[bytes]:
        log = open(self.work / f"planner-{len(self.procs)}.log", "ab")
        env = {**os.environ, "NATS_URL": self.url, "PHALANX_PLANNER_LEASE_TTL_S": str(self.ttl_s)}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "phalanx.services.elasticity_planner"], env=env, stdout=log, stderr=log
            )
        finally:
            log.close()
        self.procs.append(proc)
        return proc

    async def leader(self, bus: Bus) -> subprocess.Popen[bytes]:
        kv = await bus.kv.bucket(JOBS_BUCKET)
        for _ in range(200):
            pid = await leader_pid(kv)
            live = [p for p in self.procs if p.pid == pid and p.poll() is None]
            if live:
                return live[0]
            await asyncio.sleep(0.05)
        raise RuntimeError("no live planner holds the lease")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


async def _open_job(bus: Bus, job: str, plans: asyncio.Queue[Plan]) -> Plan:
    answers: asyncio.Queue[NodeJoined] = asyncio.Queue()

    async def on_answer(answer: NodeJoined, raw: Msg) -> None:
        answers.put_nowait(answer)

    sub = await bus.subscribe(JOINED.format(job=job), on_answer, NodeJoined)
    workers = ["w0", "w1", "w2", "w3"]
    spec = JobSpec(
        job=job,
        node="n0",
        launcher=f"L-{job}",
        store_addr="127.0.0.1:1",
        workers=workers,
        ranks=3,
        global_batch=12,
    )
    await bus.publish(JOB_SPEC, spec, job=job, msg_id=f"{job}:spec")
    answer = await asyncio.wait_for(answers.get(), 30)
    await sub.unsubscribe()
    if not answer.accepted:
        raise RuntimeError(f"job {job} refused: {answer.reason}")
    for i, w in enumerate(workers):
        reg = Registered(
            job=job,
            worker=w,
            role=Role.RANK if i < 3 else Role.SPARE,
            host="n0",
            pid=1000 + i,
            launch=answer.run,
        )
        await bus.publish(REGISTERED, reg, job=job, msg_id=f"{job}:{w}:reg")
    return await asyncio.wait_for(plans.get(), 30)


async def trial(bus: Bus, planners: Planners, job: str) -> dict[str, Any]:
    plans: asyncio.Queue[Plan] = asyncio.Queue()

    async def on_plan(plan: Plan, raw: Msg) -> None:
        plans.put_nowait(plan)

    sub = await bus.subscribe(PLAN.format(job=job), on_plan, Plan)
    try:
        gen1 = await _open_job(bus, job, plans)
        await asyncio.sleep(0.3)  # acknowledgements of generation 1 are not part of the measure
        leader = await planners.leader(bus)
        crash = RankFailed(
            job=job,
            incident=f"{job}:w1:1001",
            worker="w1",
            rank=1,
            generation=1,
            cause=FaultCause.PROCESS_EXIT,
            fault_at=time.time(),
        )
        t0 = time.time()
        leader.send_signal(signal.SIGKILL)
        await bus.publish(FAILED, crash, job=job, msg_id=crash.incident)
        while True:
            plan = await asyncio.wait_for(plans.get(), 30)
            if plan.generation == 2:
                break
        elapsed = time.time() - t0
        leader.wait(10)
    finally:
        await sub.unsubscribe()
    if plan.rank_of("w3") != 1 or plan.token <= gen1.token:
        raise RuntimeError(f"unexpected plan after failover: {plan}")
    planners.spawn()  # the next trial's standby
    await asyncio.sleep(planners.ttl_s + 0.5)  # the respawned planner connects and stands by (not measured)
    return {"failover_s": round(elapsed, 3), "token_before": gen1.token, "token_after": plan.token}


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    with NatsServer(store_dir=work / "nats") as server:
        planners = Planners(server.url, work, a.lease_ttl)
        try:
            bus = await Bus.connect(server.url, name="bench-failover")
            planners.spawn()
            await planners.leader(bus)
            planners.spawn()
            await asyncio.sleep(1.0)  # the second planner connects and stands by (not measured)
            samples = []
            for i in range(a.trials):
                r = await trial(bus, planners, f"fo{i}")
                print(json.dumps({"trial": i, **r}), flush=True)
                samples.append(r["failover_s"])
            await bus.close()
        finally:
            planners.stop()
    return {
        "bench": "failover",
        "trials": a.trials,
        "lease_ttl_s": a.lease_ttl,
        "planner_failover_s": round(statistics.median(samples), 3),
        "planner_failover_p90_s": round(pct(samples, 90) or 0.0, 3),
        "planner_failover_max_s": round(max(samples), 3),
        "samples_s": samples,
        "target_median_s": 0.3,
        "target_max_s": 0.5,
        "ok": statistics.median(samples) <= 0.3 and max(samples) <= 0.5,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument(
        "--lease-ttl", type=float, default=1.0, help="PHALANX_PLANNER_LEASE_TTL_S for both planners"
    )
    a = p.parse_args(argv)
    if a.trials < 1 or a.lease_ttl <= 0:
        p.error("--trials must be >= 1 and --lease-ttl > 0")
    with tempfile.TemporaryDirectory(prefix="phalanx-failover-") as tmp:
        result = asyncio.run(run(a, Path(tmp)))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""Failure-detection benchmark: ``python -m bench.detect`` (``make bench-detect``).

Starts its own nats-server, the failure detector as a separate process
(``python -m phalanx.services.failure_detector``) and, in this process, the
job's launcher (:class:`phalanx.runtime.launcher.Launcher`) with real worker
processes (tests/workers/heartbeat_worker.py: real RankStatus + HeartbeatPublisher)
plus thousands of simulated ranks heartbeating from one asyncio task. Then:

1. **steady**: ``--steady-s`` of real + simulated ranks; any verdict counts as
   a false positive (so do verdicts for the wrong worker at any later time);
2. **simulated faults**: some simulated ranks fall silent at random moments;
   detection time = verdict received - moment of silence;
3. **crash** (the launcher path): a real worker is SIGKILLed, the launcher sees
   the exit and publishes ``RankExited``, the detector answers ``RankFailed``;
   time from the kill to the verdict's receipt;
4. **hang**: a real worker is SIGSTOPped (heartbeats stop, no exit); time from
   the stop to ``RankHung``; then it is SIGKILLed, and the exit report must not
   make a second verdict;
5. **stall**: a real worker blocks in COMPUTE while heartbeating
   (``PHALANX_FAULTS=stall:...``); time from the stall to ``RankHung``.

Progress goes to stderr; the last line on stdout is one JSON object.

    python -m bench.detect --quick              # ~40 s
    python -m bench.detect --steady-s 60        # the default run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from phalanx.bus import Bus
from phalanx.bus.subjects import HEARTBEAT
from phalanx.natsserver import NatsServer
from phalanx.runtime.launcher import LaunchConfig, Launcher
from phalanx.schemas import FaultCause, Heartbeat, Phase, RankFailed, RankHung, Role, decode
from phalanx.service import ping
from phalanx.telemetry import setup_logging

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "heartbeat_worker.py"
JOB = "bench"
SIM_JOB = "bench-sim"
SIM_PID_BASE = 50_000_000


def log(msg: str) -> None:
    print(f"[bench.detect {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in 0..100); None when there are no values.

    >>> pct([1.0, 2.0, 3.0, 4.0], 50)
    2.5
    """
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def r1(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


# -- verdicts ------------------------------------------------------------------------
@dataclass
class Verdicts:
    """Every RankFailed/RankHung received, and which workers were faulted on purpose."""

    seen: dict[str, list[tuple[RankFailed | RankHung, float]]] = field(default_factory=dict)
    faulted: dict[tuple[str, str], float] = field(default_factory=dict)
    """(job, worker) -> wall time of the injected fault."""
    false_positives: list[str] = field(default_factory=list)
    waiters: dict[str, asyncio.Future[tuple[RankFailed | RankHung, float]]] = field(default_factory=dict)

    async def attach(self, bus: Bus) -> None:
        async def cb(raw: Msg) -> None:
            at = time.time()
            msg = decode(raw.data, raw.headers)
            assert isinstance(msg, RankFailed | RankHung)
            self.seen.setdefault(msg.incident, []).append((msg, at))
            fault = self.faulted.get((msg.job, msg.worker))
            if fault is None or at < fault:
                self.false_positives.append(msg.incident)
                log(f"FALSE POSITIVE {msg.incident} {msg.cause.value} evidence={msg.evidence}")
            fut = self.waiters.pop(msg.incident, None)
            if fut is not None and not fut.done():
                fut.set_result((msg, at))

        for subject in ("phalanx.evt.*.failed", "phalanx.evt.*.hung"):
            await bus.nc.subscribe(subject, cb=cb)

    def expect(self, incident: str) -> asyncio.Future[tuple[RankFailed | RankHung, float]]:
        fut: asyncio.Future[tuple[RankFailed | RankHung, float]] = asyncio.get_running_loop().create_future()
        if incident in self.seen:
            fut.set_result(self.seen[incident][0])
        else:
            self.waiters[incident] = fut
        return fut

    @property
    def duplicates(self) -> int:
        return sum(len(v) - 1 for v in self.seen.values())


# -- simulated ranks -----------------------------------------------------------------
class SimulatedRanks:
    """``n`` ranks heartbeating every ``interval`` from one task, phases spread evenly.

    Each rank alternates COMPUTE and COLLECTIVE and completes a step per heartbeat,
    like a rank with steps shorter than the interval.
    """

    def __init__(self, bus: Bus, n: int, interval: float, rng: random.Random) -> None:
        self.bus, self.n, self.interval = bus, n, interval
        self.silent_at: dict[int, float] = {}
        self.seq = [0] * n
        self.lags: list[float] = []
        self.sent = 0
        self._rng = rng
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="simulated-ranks")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def silence(self, i: int) -> float:
        """Rank ``i`` sends nothing more; returns the wall time of the fault."""
        t = time.time()
        self.silent_at[i] = t
        return t

    def heartbeat(self, i: int) -> Heartbeat:
        seq = self.seq[i]
        return Heartbeat(
            job=SIM_JOB,
            worker=f"s{i}",
            rank=i,
            generation=1,
            step=seq,
            step_ms=self.interval * 800,
            phase=Phase.COMPUTE if seq % 2 == 0 else Phase.COLLECTIVE,
            phase_ms=self._rng.uniform(0, self.interval * 400),
            seq=seq,
            pid=SIM_PID_BASE + i,
            host="sim",
            interval_ms=self.interval * 1e3,
        )

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        due = [(t0 + self.interval * i / self.n, i) for i in range(self.n)]
        heapq.heapify(due)
        while due:
            now = loop.time()
            while due and due[0][0] <= now:
                at, i = heapq.heappop(due)
                if i in self.silent_at:
                    continue
                self.lags.append(now - at)
                await self.bus.publish(
                    HEARTBEAT, self.heartbeat(i), traced=False, job=SIM_JOB, worker=f"s{i}"
                )
                self.seq[i] += 1
                self.sent += 1
                heapq.heappush(due, (at + self.interval, i))
            if due:
                await asyncio.sleep(max(0.0, due[0][0] - loop.time()))


# -- real workers --------------------------------------------------------------------
class Workers:
    """The launcher and a view of the heartbeats of its workers."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.beats: dict[tuple[str, int], int] = {}

    async def attach(self, bus: Bus) -> None:
        async def cb(raw: Msg) -> None:
            hb = decode(raw.data, raw.headers, Heartbeat)
            key = (hb.worker, hb.pid)
            self.beats[key] = self.beats.get(key, 0) + 1

        await bus.nc.subscribe(HEARTBEAT.wildcard(job=JOB), cb=cb)

    def pid(self, name: str) -> int:
        return self.launcher.workers[name].proc.pid

    async def spawn(self, names: list[str], *, beats: int, batch: int = 3, timeout: float = 60.0) -> None:
        """Start workers a few at a time (start-up is CPU-heavy on 2 cores); wait for
        ``beats`` heartbeats from each, so the detector has learnt their rhythm."""
        for k in range(0, len(names), batch):
            group = names[k : k + batch]
            for name in group:
                self.launcher.spawn(name, Role.RANK)
            await self.wait_beats(group, 1, timeout)
        await self.wait_beats(names, beats, timeout)

    async def wait_beats(self, names: list[str], beats: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(self.beats.get((n, self.pid(n)), 0) < beats for n in names):
            for n in names:
                if self.launcher.workers[n].proc.poll() is not None:
                    raise RuntimeError(
                        f"worker {n} exited early (code {self.launcher.workers[n].proc.returncode})"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {names} did not heartbeat {beats} times")
            await asyncio.sleep(0.05)


# -- phases --------------------------------------------------------------------------
async def sim_faults(
    sim: SimulatedRanks, verdicts: Verdicts, count: int, window_s: float, rng: random.Random, timeout: float
) -> tuple[list[float], int]:
    """Silence ``count`` simulated ranks at random moments; detection times (ms) and misses."""
    victims = rng.sample(range(sim.n), count)
    times = sorted(rng.uniform(0, window_s) for _ in victims)
    start = time.monotonic()
    waits: list[tuple[float, asyncio.Future[tuple[RankFailed | RankHung, float]]]] = []
    for i, at in zip(victims, times, strict=True):
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        verdicts.faulted[(SIM_JOB, f"s{i}")] = t = sim.silence(i)
        waits.append((t, verdicts.expect(f"{SIM_JOB}:s{i}:{SIM_PID_BASE + i}")))
    out, missed = [], 0
    for t, fut in waits:
        try:
            msg, at = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            missed += 1
            continue
        if msg.cause is FaultCause.HEARTBEAT_LOST:
            out.append((at - t) * 1e3)
    return out, missed


async def crash_trials(
    workers: Workers,
    verdicts: Verdicts,
    names: list[str],
    interval: float,
    rng: random.Random,
    timeout: float,
) -> list[float]:
    """SIGKILL each worker through the launcher; ms from the kill to RankFailed."""
    out = []
    for name in names:
        await asyncio.sleep(rng.uniform(0, interval))  # land anywhere between two heartbeats
        pid = workers.pid(name)
        fut = verdicts.expect(f"{JOB}:{name}:{pid}")
        verdicts.faulted[(JOB, name)] = t = time.time()
        workers.launcher.kill(name, signal.SIGKILL)
        msg, at = await asyncio.wait_for(fut, timeout)
        if msg.cause is not FaultCause.PROCESS_EXIT:
            raise RuntimeError(f"{name}: expected process_exit, got {msg.cause}")
        out.append((at - t) * 1e3)
    return out


async def hang_trials(
    workers: Workers,
    verdicts: Verdicts,
    names: list[str],
    interval: float,
    rng: random.Random,
    timeout: float,
) -> list[float]:
    """SIGSTOP workers at staggered random moments; ms from the stop to RankHung.
    Each is SIGKILLed afterwards: that exit report must not make a second verdict."""

    async def one(k: int, name: str) -> float:
        await asyncio.sleep(k * 0.35 + rng.uniform(0, interval))
        pid = workers.pid(name)
        fut = verdicts.expect(f"{JOB}:{name}:{pid}")
        verdicts.faulted[(JOB, name)] = t = time.time()
        workers.launcher.kill(name, signal.SIGSTOP)
        msg, at = await asyncio.wait_for(fut, timeout)
        workers.launcher.kill(name, signal.SIGKILL)
        if msg.cause is not FaultCause.HEARTBEAT_LOST:
            raise RuntimeError(f"{name}: expected heartbeat_lost, got {msg.cause}")
        return (at - t) * 1e3

    return list(await asyncio.gather(*(one(k, n) for k, n in enumerate(names))))


async def stall_trials(
    workers: Workers, verdicts: Verdicts, names: list[str], timeout: float
) -> tuple[list[float], list[float]]:
    """Workers that stall in COMPUTE (PHALANX_FAULTS); ms from the stall to RankHung, and the bounds."""
    futs = []
    for name in names:
        verdicts.faulted[(JOB, name)] = 0.0  # the stall time is only known from the verdict
        futs.append(verdicts.expect(f"{JOB}:{name}:{workers.pid(name)}"))
    out, bounds = [], []
    for fut in futs:
        msg, at = await asyncio.wait_for(fut, timeout)
        if msg.cause is not FaultCause.STEP_STALL:
            raise RuntimeError(f"{msg.worker}: expected step_stall, got {msg.cause}")
        out.append((at - msg.fault_at) * 1e3)
        bounds.append(float(msg.evidence["bound_ms"]))
    return out, bounds


# -- main ----------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.detect", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short run: 10 s steady, few trials")
    p.add_argument("--steady-s", type=float, default=None, help="steady phase (default 60, quick 10)")
    p.add_argument("--interval-ms", type=float, default=500.0, help="heartbeat interval")
    p.add_argument("--ranks", type=int, default=4, help="real ranks that run throughout")
    p.add_argument("--spares", type=int, default=1, help="real hot spares that run throughout")
    p.add_argument("--simulated", type=int, default=2000, help="simulated ranks")
    p.add_argument(
        "--sim-faults", type=int, default=None, help="simulated ranks that fall silent (40, quick 20)"
    )
    p.add_argument("--crash", type=int, default=None, help="SIGKILL trials (20, quick 6)")
    p.add_argument("--hang", type=int, default=None, help="SIGSTOP trials (12, quick 6)")
    p.add_argument("--stall", type=int, default=None, help="step-stall trials (2, quick 1)")
    p.add_argument("--stall-floor-ms", type=float, default=2000.0)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    quick = a.quick
    a.steady_s = a.steady_s if a.steady_s is not None else (10.0 if quick else 60.0)
    a.sim_faults = a.sim_faults if a.sim_faults is not None else (20 if quick else 40)
    a.crash = a.crash if a.crash is not None else (6 if quick else 20)
    a.hang = a.hang if a.hang is not None else (6 if quick else 12)
    a.stall = a.stall if a.stall is not None else (1 if quick else 2)
    return a


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    rng = random.Random(a.seed)
    interval = a.interval_ms / 1e3
    timeout = max(20.0, 20 * interval)
    stall_names = [f"st{i}" for i in range(a.stall)]
    stall_step = 10
    srv = NatsServer(store_dir=work / "nats").start()
    detector: subprocess.Popen[bytes] | None = None
    launcher: Launcher | None = None
    bus: Bus | None = None
    sim: SimulatedRanks | None = None
    try:
        env = {
            **os.environ,
            "NATS_URL": srv.url,
            "PHALANX_HEARTBEAT_MS": str(a.interval_ms),
            "PHALANX_STALL_FLOOR_MS": str(a.stall_floor_ms),
            "PHALANX_SPAN_FILE": str(work / "spans.jsonl"),
            "PHALANX_LOG_LEVEL": "WARNING",
        }
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        with open(work / "detector.log", "wb") as out:
            detector = subprocess.Popen(
                [sys.executable, "-m", "phalanx.services.failure_detector"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        bus = await Bus.connect(srv.url, name="bench")
        deadline = time.monotonic() + 30
        while True:
            try:
                await ping(bus, "failure-detector", timeout=0.5)
                break
            except Exception:
                if detector.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"detector did not start; see {work / 'detector.log'}") from None
                await asyncio.sleep(0.1)
        verdicts = Verdicts()
        await verdicts.attach(bus)

        faults = ",".join(f"stall:{n}@step={stall_step}" for n in stall_names)
        launcher = Launcher(
            LaunchConfig(
                job=JOB,
                nproc=a.ranks,
                spares=a.spares,
                nats_url=srv.url,
                log_dir=work / "workers",
                cmd=[sys.executable, str(WORKER), "--interval-ms", str(a.interval_ms), "--step-ms", "100"],
                env={
                    "PHALANX_HEARTBEAT_MS": str(a.interval_ms),
                    "PHALANX_FAULTS": faults,
                    "PHALANX_LOG_LEVEL": "WARNING",
                    "PHALANX_SPAN_FILE": str(work / "spans.jsonl"),
                },
            )
        )
        workers = Workers(launcher)
        await workers.attach(bus)
        log(f"nats {srv.url}; starting launcher with {a.ranks} ranks + {a.spares} spares")
        await launcher.start()
        steady_names = list(launcher.workers)
        await workers.wait_beats(steady_names, 3, 60.0)

        sim = SimulatedRanks(bus, a.simulated, interval, rng)
        sim.start()
        total = a.simulated + len(steady_names)
        deadline = time.monotonic() + 60
        while (await ping(bus, "failure-detector")).details["tracked_workers"] < total:
            if time.monotonic() > deadline:
                raise TimeoutError("the detector does not track every rank")
            await asyncio.sleep(0.2)
        hb0, t0 = (await ping(bus, "failure-detector")).details["heartbeats"], time.monotonic()

        crash_names = [f"c{i}" for i in range(a.crash)]
        hang_names = [f"h{i}" for i in range(a.hang)]
        log(
            f"steady for {a.steady_s:.0f} s: {len(steady_names)} real + {a.simulated} simulated ranks at "
            f"{a.interval_ms:.0f} ms; starting {len(crash_names) + len(hang_names)} trial workers meanwhile"
        )
        steady_end = time.monotonic() + a.steady_s
        await workers.spawn(crash_names + hang_names, beats=8)
        await asyncio.sleep(max(0.0, steady_end - time.monotonic()))  # the observation window itself
        health = (await ping(bus, "failure-detector")).details
        hb_rate = (float(health["heartbeats"]) - float(hb0)) / (time.monotonic() - t0)
        steady_fp = len(verdicts.false_positives)
        log(f"steady done: {steady_fp} false positives, detector took {hb_rate:.0f} heartbeats/s")

        log(f"simulated faults: {a.sim_faults} ranks fall silent")
        sim_ms, sim_missed = await sim_faults(sim, verdicts, a.sim_faults, 5.0, rng, timeout)
        log(f"crash trials: {len(crash_names)} SIGKILLs through the launcher")
        crash_ms = await crash_trials(workers, verdicts, crash_names, interval, rng, timeout)
        log(f"hang trials: {len(hang_names)} SIGSTOPs")
        hang_ms = await hang_trials(workers, verdicts, hang_names, interval, rng, timeout)
        stall_ms: list[float] = []
        bounds: list[float] = []
        if stall_names:
            log(f"stall trials: {len(stall_names)} ranks stall in COMPUTE at step {stall_step}")
            await workers.spawn(stall_names, beats=1)
            stall_ms, bounds = await stall_trials(
                workers, verdicts, stall_names, timeout + a.stall_floor_ms / 1e3
            )
        # barrier for late duplicates: every exit reported so far has been judged once
        # the detector's own counter of exit reports reaches them (SIGKILLs of stopped workers)
        deadline = time.monotonic() + timeout
        while True:
            health = (await ping(bus, "failure-detector")).details
            if int(health["repeated_exits"]) >= len(hang_names) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        lag_p99 = pct(sim.lags, 99)
        return {
            "crash_detect_ms_p50": r1(pct(crash_ms, 50)),
            "crash_detect_ms_p99": r1(pct(crash_ms, 99)),
            "hang_detect_ms_p50": r1(pct(hang_ms, 50)),
            "hang_detect_ms_p99": r1(pct(hang_ms, 99)),
            "hang_detect_intervals_p50": round(pct(hang_ms, 50) / a.interval_ms, 2) if hang_ms else None,
            "hang_detect_intervals_max": round(max(hang_ms) / a.interval_ms, 2) if hang_ms else None,
            "stall_detect_ms_p50": r1(pct(stall_ms, 50)),
            "stall_bound_ms": r1(pct(bounds, 50)),
            "simulated_detect_ms_p50": r1(pct(sim_ms, 50)),
            "simulated_detect_ms_p99": r1(pct(sim_ms, 99)),
            "simulated_detect_intervals_p99": round(pct(sim_ms, 99) / a.interval_ms, 2) if sim_ms else None,
            "simulated_missed": sim_missed,
            "heartbeat_interval_ms": a.interval_ms,
            "ranks": len(steady_names),
            "real_workers": len(launcher.workers),
            "simulated_ranks": a.simulated,
            "false_positives": len(verdicts.false_positives),
            "false_positives_steady": steady_fp,
            "duplicates": verdicts.duplicates,
            "steady_s": a.steady_s,
            "crash_trials": len(crash_ms),
            "hang_trials": len(hang_ms),
            "stall_trials": len(stall_ms),
            "simulated_faults": len(sim_ms) + sim_missed,
            "crash_path": "launcher",
            "detector_heartbeats_per_s": round(hb_rate, 1),
            "detector_lag_holds": health["lag_holds"],
            "detector_backlog_holds": health["backlog_holds"],
            "detector_decode_errors": health["decode_errors"],
            "sim_publish_lag_ms_p99": r1(lag_p99 * 1e3) if lag_p99 is not None else None,
            "cpus": os.cpu_count(),
        }
    finally:
        if sim is not None:
            await sim.stop()
        if launcher is not None:
            await launcher.stop()
        if bus is not None:
            await bus.close()
        if detector is not None and detector.poll() is None:
            detector.send_signal(signal.SIGTERM)
            try:
                detector.wait(15)
            except subprocess.TimeoutExpired:
                detector.kill()
        srv.cleanup()


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    setup_logging("bench-detect", os.environ.get("PHALANX_LOG_LEVEL", "WARNING"))  # JSON lines on stderr
    keep = os.environ.get("PHALANX_BENCH_DIR")
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-detect-") as tmp:
        work = Path(keep) if keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(run(a, work))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

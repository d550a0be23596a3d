"""Failure-detection benchmark: ``python -m bench.detect`` (``make bench-detect``).

Starts its own nats-server, the failure detector as a separate process
(``python -m phalanx.services.failure_detector``) and, in this process, the
job's launcher (:class:`phalanx.launcher.launcher.Launcher`) with real worker
processes (tests/workers/heartbeat_worker.py: real RankStatus + HeartbeatPublisher)
plus thousands of simulated ranks, 8 per simulated node, published as one
:class:`~phalanx.contract.NodeDigest` per node and interval (what each node's
launcher sends) by ``--sim-procs`` simulator processes. Then:

1. **steady**: ``--steady-s`` of real + simulated ranks; any verdict counts as
   a false positive (so do verdicts for the wrong worker or node at any later time);
2. **simulated faults**: some simulated ranks stop heartbeating at random moments
   (their digest entry freezes while the node goes on); detection time = verdict
   received - moment the rank stopped;
3. **node faults**: some simulated nodes go silent (no more digests); one
   ``NodeLost`` each is expected, and no ``RankHung`` for their ranks;
4. **crash** (the launcher path): a real worker is SIGKILLed, the launcher sees
   the exit and publishes ``RankExited``, the detector answers ``RankFailed``;
   time from the kill to the verdict's receipt;
5. **hang**: a real worker is SIGSTOPped (heartbeats stop, no exit); time from
   the stop to ``RankHung``; then it is SIGKILLed, and the exit report must not
   make a second verdict;
6. **stall**: a real worker blocks in COMPUTE while heartbeating
   (``PHALANX_FAULTS=stall:...``); time from the stall to ``RankHung``.

Progress goes to stderr; the last line on stdout is one JSON object.

    python -m bench.detect --quick              # ~1 min
    python -m bench.detect --steady-s 60        # the default run (~3 min)
    python -m bench.detect --simulated 16000    # 2,000 simulated nodes
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
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from nats.aio.msg import Msg

from phalanx.bus import Bus
from phalanx.contract import (
    FaultCause,
    Heartbeat,
    NodeDigest,
    NodeLost,
    RankFailed,
    RankHung,
    Role,
    decode,
    encode,
)
from phalanx.contract.codec import headers_for
from phalanx.contract.subjects import HEARTBEAT, NODE_DIGEST
from phalanx.devstack.natsserver import NatsServer
from phalanx.launcher.launcher import LaunchConfig, Launcher
from phalanx.service import ping
from phalanx.settings import TelemetrySettings, load
from phalanx.telemetry import setup_logging

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "heartbeat_worker.py"
JOB = "bench"
SIM_JOB = "bench-sim"
SIM_PID_BASE = 50_000_000
PER_NODE = 8
CTL = "bench.sim.ctl"
Verdict = RankFailed | RankHung | NodeLost


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
    """Every RankFailed/RankHung/NodeLost received, and what was faulted on purpose."""

    seen: dict[str, list[tuple[Verdict, float]]] = field(default_factory=dict)
    faulted: dict[tuple[str, str], float] = field(default_factory=dict)
    """(job, worker or ``node:<node>``) -> wall time of the injected fault."""
    false_positives: list[str] = field(default_factory=list)
    waiters: dict[str, asyncio.Future[tuple[Verdict, float]]] = field(default_factory=dict)

    async def attach(self, bus: Bus) -> None:
        async def cb(raw: Msg) -> None:
            at = time.time()
            msg = decode(raw.data, raw.headers)
            assert isinstance(msg, RankFailed | RankHung | NodeLost)
            self.seen.setdefault(msg.incident, []).append((msg, at))
            who = f"node:{msg.node}" if isinstance(msg, NodeLost) else msg.worker
            fault = self.faulted.get((msg.job, who))
            if fault is None or at < fault:
                self.false_positives.append(msg.incident)
                log(f"FALSE POSITIVE {msg.incident} {msg.cause.value} evidence={msg.evidence}")
            fut = self.waiters.pop(msg.incident, None)
            if fut is not None and not fut.done():
                fut.set_result((msg, at))

        for subject in ("phalanx.evt.*.failed", "phalanx.evt.*.hung", "phalanx.evt.*.node_lost"):
            await bus.nc.subscribe(subject, cb=cb)

    def expect(self, incident: str) -> asyncio.Future[tuple[Verdict, float]]:
        fut: asyncio.Future[tuple[Verdict, float]] = asyncio.get_running_loop().create_future()
        if incident in self.seen:
            fut.set_result(self.seen[incident][0])
        else:
            self.waiters[incident] = fut
        return fut

    @property
    def duplicates(self) -> int:
        return sum(len(v) - 1 for v in self.seen.values())


# -- simulated nodes -----------------------------------------------------------------
def sim_node(k: int) -> str:
    return f"n{k}"


def sim_worker(k: int, j: int) -> str:
    return f"n{k}-w{j}"


def sim_pid(k: int, j: int) -> int:
    return SIM_PID_BASE + k * PER_NODE + j


def sim_launcher(k: int) -> str:
    return f"sim-{k}"


class SimulatedNodes:
    """Simulated nodes, each publishing the digest its launcher would: 8 ranks that
    heartbeat every ``interval`` (each at its own phase), sampled once per interval
    (digests spread evenly over the interval). Each rank completes a step per
    heartbeat, alternating COMPUTE and COLLECTIVE, like a rank with short steps.

    Faults come by request on ``bench.sim.ctl.<proc>``: ``freeze`` a rank (its entry
    stops moving on, like a SIGSTOPped rank) or ``silence`` a node (no more digests);
    the reply is the wall time of the fault.

    The simulators share the bench's cores with the detector, so a digest is built
    from msgpack fragments packed once per rank (:meth:`payload`, a few us): the
    bytes are exactly ``msgpack.packb`` of the dict a launcher encodes
    (:meth:`digest`, the reference, checked against it by a doctest in
    :func:`_check_payload`).
    """

    def __init__(self, bus: Bus, nodes: list[int], interval: float, seed: int) -> None:
        self.bus, self.nodes, self.interval = bus, nodes, interval
        rng = random.Random(seed)
        self.t0 = time.monotonic()
        self.phase = {(k, j): rng.uniform(0, interval) for k in nodes for j in range(PER_NODE)}
        self.phase_ms = {(k, j): rng.uniform(0, interval * 400) for k in nodes for j in range(PER_NODE)}
        self.frozen: dict[tuple[int, int], float] = {}
        self.silent: set[int] = set()
        self.seq = dict.fromkeys(nodes, 0)
        self.lags: list[float] = []
        self.sent = 0
        self.headers = headers_for(NodeDigest)
        self.subjects = {k: NODE_DIGEST.format(job=SIM_JOB, node=sim_node(k)) for k in nodes}
        pk = msgpack.Packer(use_bin_type=True).pack
        self._node_parts = {
            k: (
                b"\x88" + pk("job") + pk(SIM_JOB) + pk("ts"),
                pk("node") + pk(sim_node(k)) + pk("launcher") + pk(sim_launcher(k))
                + pk("host") + pk(f"sim-{k}") + pk("seq"),
                pk("interval_ms") + pk(interval * 1e3) + pk("entries"),
            )
            for k in nodes
        }  # fmt: skip
        # per rank: (when it first heard, fragments before seq, before step, after step by
        # the parity of the step (phase), after age_ms by the same parity (op))
        self._ranks = {
            k: [
                (
                    self.t0 + self.phase[(k, j)],
                    b"\x8d" + pk("worker") + pk(sim_worker(k, j)) + pk("pid") + pk(sim_pid(k, j)) + pk("seq"),
                    pk("rank") + pk(k * PER_NODE + j) + pk("generation") + pk(1) + pk("step"),
                    tuple(
                        pk("step_ms") + pk(interval * 800) + pk("phase") + pk(phase)
                        + pk("phase_ms") + pk(self.phase_ms[(k, j)]) + pk("age_ms")
                        for phase in ("compute", "collective")
                    ),
                    tuple(
                        pk("interval_ms") + pk(interval * 1e3) + pk("collective_bound_ms") + pk(SIM_BOUND_MS)
                        + pk("op") + pk(op)
                        for op in (0, 1)  # in compute after the step, in its one collective
                    ),
                )
                for j in range(PER_NODE)
            ]
            for k in nodes
        }  # fmt: skip
        self._pack_int = pk

    def entry(self, k: int, j: int, now: float) -> dict[str, Any] | None:
        """Rank ``j`` of node ``k``'s digest entry at ``now`` (the reference of :meth:`payload`)."""
        t = min(now, self.frozen.get((k, j), now)) - self.t0 - self.phase[(k, j)]
        if t < 0:
            return None  # no heartbeat yet
        m = int(t // self.interval)
        heard = self.t0 + self.phase[(k, j)] + m * self.interval
        return {
            "worker": sim_worker(k, j),
            "pid": sim_pid(k, j),
            "seq": m,
            "rank": k * PER_NODE + j,
            "generation": 1,
            "step": m,
            "step_ms": self.interval * 800,
            "phase": "compute" if m % 2 == 0 else "collective",
            "phase_ms": self.phase_ms[(k, j)],
            "age_ms": max(0.0, (now - heard) * 1e3),
            "interval_ms": self.interval * 1e3,
            "collective_bound_ms": SIM_BOUND_MS,
            "op": m % 2,
        }

    def digest(self, k: int, now: float, ts: float) -> dict[str, Any]:
        """Node ``k``'s digest at ``now`` as a dict (what a launcher encodes; the reference)."""
        return {
            "job": SIM_JOB,
            "ts": ts,
            "node": sim_node(k),
            "launcher": sim_launcher(k),
            "host": f"sim-{k}",
            "seq": self.seq[k],
            "interval_ms": self.interval * 1e3,
            "entries": [e for j in range(PER_NODE) if (e := self.entry(k, j, now)) is not None],
        }

    def payload(self, k: int, now: float, ts: float | None = None) -> bytes:
        """``msgpack.packb(self.digest(k, now, ts))``, from the fragments (the hot path)."""
        interval, frozen, pk = self.interval, self.frozen, self._pack_int
        parts: list[bytes] = []
        for j, (start, before_seq, before_step, after_step, tail) in enumerate(self._ranks[k]):
            at = frozen.get((k, j), now) if frozen else now
            t = (at if at < now else now) - start
            if t < 0:
                continue  # no heartbeat yet
            m = int(t // interval)
            age = (now - (start + m * interval)) * 1e3
            packed = pk(m)
            parts += (
                before_seq,
                packed,
                before_step,
                packed,
                after_step[m & 1],
                _F64(0xCB, age if age > 0.0 else 0.0),
                tail[m & 1],
            )
        head, mid, end = self._node_parts[k]
        count = len(parts) // 7
        data = b"".join(
            (head, _F64(0xCB, time.time() if ts is None else ts), mid, pk(self.seq[k]), end, _ARRAY(0x90 | count), *parts)
        )  # fmt: skip
        self.seq[k] += 1
        return data

    async def control(self, raw: Msg) -> None:
        req = json.loads(raw.data)
        at = time.time()
        if req["op"] == "freeze":
            self.frozen[(req["node"], req["rank"])] = time.monotonic()
        elif req["op"] == "silence":
            self.silent.add(req["node"])
        elif req["op"] == "stats":
            lag = pct(self.lags, 99)
            await raw.respond(json.dumps({"sent": self.sent, "lag_p99_s": lag}).encode())
            return
        await raw.respond(json.dumps({"at": at}).encode())

    async def run(self) -> None:
        """Publish each node's digest every interval, spread evenly; the loop wakes at
        most every ``SIM_BATCH_S`` and sends what is due (a launcher's timer jitters too)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        n = len(self.nodes)
        due = [(t0 + self.interval * i / n, k) for i, k in enumerate(self.nodes)]
        heapq.heapify(due)
        publish, headers, subjects = self.bus.nc.publish, self.headers, self.subjects
        while due:
            now = loop.time()
            while due and due[0][0] <= now:
                at, k = heapq.heappop(due)
                if k in self.silent:
                    continue
                self.lags.append(now - at)
                await publish(subjects[k], self.payload(k, time.monotonic()), headers=headers)
                self.sent += 1
                heapq.heappush(due, (at + self.interval, k))
            if due:
                await asyncio.sleep(max(SIM_BATCH_S, due[0][0] - loop.time()))


_F64 = struct.Struct(">Bd").pack
_ARRAY = struct.Struct(">B").pack
SIM_BATCH_S = 0.005
SIM_BOUND_MS = 2000.0  # the per-op all-reduce timeout a simulated rank reports


def _check_payload() -> None:
    """The fragments make the very bytes of the reference dict, which decode() accepts
    and a launcher's encode() of that message makes too.

    >>> _check_payload()
    """
    from phalanx.services.failure_detector.wire import read_digest

    sim = SimulatedNodes(None, [0, 7, 1999], 0.5, 3)  # type: ignore[arg-type]
    sim.frozen[(7, 2)] = sim.t0 + 0.9
    for dt in (0.0, 0.3, 0.61, 1.2, 5.55, 40.02):
        for k in sim.nodes:
            now = sim.t0 + dt
            ref = msgpack.packb(sim.digest(k, now, 1.7e9 + dt), use_bin_type=True)
            got = sim.payload(k, now, 1.7e9 + dt)
            assert got == ref, (k, dt, msgpack.unpackb(got), msgpack.unpackb(ref))
            # a launcher encoding the same digest sends the very same bytes
            assert encode(decode(got, sim.headers, NodeDigest)) == (got, sim.headers)
            assert read_digest(got, sim.headers) is not None


async def simulate(url: str, proc: int, nodes: list[int], interval: float, seed: int) -> None:
    """A simulator process: publish the digests of ``nodes`` until SIGTERM."""
    bus = await Bus.connect(url, name=f"bench-sim-{proc}", ensure=False)
    sim = SimulatedNodes(bus, nodes, interval, seed)
    await bus.nc.subscribe(f"{CTL}.{proc}", cb=sim.control)
    done = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, done.set)
    task = asyncio.create_task(sim.run())
    print("ready", flush=True)
    await done.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await bus.close()


class Simulators:
    """The simulator processes, seen from the bench."""

    def __init__(self, url: str, nodes: int, procs: int, interval: float, seed: int, work: Path) -> None:
        self.nodes, self.procs = nodes, max(1, min(procs, nodes))
        self.owner = {k: k % self.procs for k in range(nodes)}
        self.running: list[subprocess.Popen[bytes]] = []
        for p in range(self.procs):
            mine = [k for k in range(nodes) if self.owner[k] == p]
            with open(work / f"sim-{p}.log", "wb") as err:
                self.running.append(
                    subprocess.Popen(
                        [
                            *(sys.executable, "-m", "bench.detect", "_simulate", url, str(p)),
                            *(str(interval), str(seed + p), ",".join(map(str, mine))),
                        ],
                        stdout=subprocess.PIPE,
                        stderr=err,
                        cwd=ROOT,
                    )
                )
        self.bus: Bus | None = None

    async def ready(self, bus: Bus) -> None:
        self.bus = bus
        for proc in self.running:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
            if not line.startswith(b"ready"):
                raise RuntimeError("a simulator did not start")

    async def _ask(self, proc: int, req: dict[str, Any]) -> dict[str, Any]:
        assert self.bus is not None
        reply = await self.bus.nc.request(f"{CTL}.{proc}", json.dumps(req).encode(), timeout=5)
        return json.loads(reply.data)  # type: ignore[no-any-return]

    async def freeze(self, k: int, j: int) -> float:
        return float((await self._ask(self.owner[k], {"op": "freeze", "node": k, "rank": j}))["at"])

    async def silence(self, k: int) -> float:
        return float((await self._ask(self.owner[k], {"op": "silence", "node": k}))["at"])

    async def stats(self) -> tuple[int, float | None]:
        replies = [await self._ask(p, {"op": "stats"}) for p in range(self.procs)]
        lags = [r["lag_p99_s"] for r in replies if r["lag_p99_s"] is not None]
        return sum(r["sent"] for r in replies), max(lags) if lags else None

    def stop(self) -> None:
        for proc in self.running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.running:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


# -- real workers --------------------------------------------------------------------
class Workers:
    """The launcher and a view of the heartbeats of its workers."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.beats: dict[tuple[str, int], int] = {}
        self.seqs: dict[tuple[str, int], int] = {}

    async def attach(self, bus: Bus) -> None:
        async def cb(raw: Msg) -> None:
            hb = decode(raw.data, raw.headers, Heartbeat)
            key = (hb.worker, hb.pid)
            self.beats[key] = self.beats.get(key, 0) + 1

        async def digest_cb(raw: Msg) -> None:  # workers under a launcher that sends node digests
            for e in decode(raw.data, raw.headers, NodeDigest).entries:
                key = (e.worker, e.pid)
                if e.seq != self.seqs.get(key):
                    self.seqs[key] = e.seq
                    self.beats[key] = self.beats.get(key, 0) + 1

        await bus.nc.subscribe(HEARTBEAT.wildcard(job=JOB), cb=cb)
        await bus.nc.subscribe(NODE_DIGEST.wildcard(job=JOB), cb=digest_cb)

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
    sims: Simulators,
    verdicts: Verdicts,
    victims: list[tuple[int, int]],
    window_s: float,
    rng: random.Random,
    timeout: float,
) -> tuple[list[float], int]:
    """Freeze simulated ranks (entries stop moving on) at random moments; ms to RankHung, and misses."""
    times = sorted(rng.uniform(0, window_s) for _ in victims)
    start = time.monotonic()
    waits: list[tuple[float, asyncio.Future[tuple[Verdict, float]]]] = []
    for (k, j), at in zip(victims, times, strict=True):
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        verdicts.faulted[(SIM_JOB, sim_worker(k, j))] = 0.0  # before the reply: a fast verdict is no FP
        fut = verdicts.expect(f"{SIM_JOB}:{sim_worker(k, j)}:{sim_pid(k, j)}")
        verdicts.faulted[(SIM_JOB, sim_worker(k, j))] = t = await sims.freeze(k, j)
        waits.append((t, fut))
    return await _collect(waits, timeout, FaultCause.HEARTBEAT_LOST)


async def node_faults(
    sims: Simulators,
    verdicts: Verdicts,
    nodes: list[int],
    window_s: float,
    rng: random.Random,
    timeout: float,
) -> tuple[list[float], int]:
    """Silence simulated nodes at random moments; ms to NodeLost, and misses."""
    times = sorted(rng.uniform(0, window_s) for _ in nodes)
    start = time.monotonic()
    waits: list[tuple[float, asyncio.Future[tuple[Verdict, float]]]] = []
    for k, at in zip(nodes, times, strict=True):
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        verdicts.faulted[(SIM_JOB, f"node:{sim_node(k)}")] = 0.0
        fut = verdicts.expect(f"{SIM_JOB}:node:{sim_node(k)}:{sim_launcher(k)}")
        verdicts.faulted[(SIM_JOB, f"node:{sim_node(k)}")] = t = await sims.silence(k)
        waits.append((t, fut))
    return await _collect(waits, timeout, FaultCause.HEARTBEAT_LOST)


async def _collect(
    waits: list[tuple[float, asyncio.Future[tuple[Verdict, float]]]], timeout: float, cause: FaultCause
) -> tuple[list[float], int]:
    out, missed = [], 0
    for t, fut in waits:
        try:
            msg, at = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            missed += 1
            continue
        if msg.cause is cause:
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
            raise RuntimeError(f"{msg.incident}: expected step_stall, got {msg.cause}")
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
    p.add_argument(
        "--simulated", type=int, default=16000, help=f"simulated ranks, {PER_NODE} per simulated node"
    )
    p.add_argument("--sim-procs", type=int, default=1, help="simulator processes")
    p.add_argument(
        "--sim-faults", type=int, default=None, help="simulated ranks that fall silent (40, quick 20)"
    )
    p.add_argument(
        "--node-faults", type=int, default=None, help="simulated nodes that go silent (20, quick 8)"
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
    a.node_faults = a.node_faults if a.node_faults is not None else (8 if quick else 20)
    a.nodes = math.ceil(a.simulated / PER_NODE)
    if a.sim_faults + a.node_faults > a.nodes:
        p.error("more simulated faults than simulated nodes")
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
    services: dict[str, subprocess.Popen[bytes]] = {}
    launcher: Launcher | None = None
    bus: Bus | None = None
    sims: Simulators | None = None
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
        # the planner only answers the launcher's join (the trial workers are no members)
        for name in ("failure-detector", "elasticity-planner"):
            with open(work / f"{name}.log", "wb") as out:
                services[name] = subprocess.Popen(
                    [sys.executable, "-m", f"phalanx.services.{name.replace('-', '_')}"],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
        bus = await Bus.connect(srv.url, name="bench")
        deadline = time.monotonic() + 30
        for name, proc in services.items():
            while True:
                try:
                    await ping(bus, name, timeout=0.5)
                    break
                except Exception:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{name} did not start; see {work / name}.log") from None
                    await asyncio.sleep(0.1)
        verdicts = Verdicts()
        await verdicts.attach(bus)

        faults = ",".join(f"stall:{n}@step={stall_step}" for n in stall_names)
        os.environ["PHALANX_HEARTBEAT_MS"] = str(a.interval_ms)  # the launcher's digest interval
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

        sims = Simulators(srv.url, a.nodes, a.sim_procs, interval, a.seed, work)
        await sims.ready(bus)
        total = a.nodes * PER_NODE + len(steady_names)
        deadline = time.monotonic() + 60
        while (await ping(bus, "failure-detector", timeout=10.0)).details["tracked_workers"] < total:
            if time.monotonic() > deadline:
                raise TimeoutError("the detector does not track every rank")
            await asyncio.sleep(0.2)
        health = (await ping(bus, "failure-detector", timeout=10.0)).details
        hb0, dg0, t0 = health["heartbeats"], health["digests"], time.monotonic()

        crash_names = [f"c{i}" for i in range(a.crash)]
        hang_names = [f"h{i}" for i in range(a.hang)]
        log(
            f"steady for {a.steady_s:.0f} s: {len(steady_names)} real + {a.nodes * PER_NODE} simulated ranks "
            f"({a.nodes} nodes) at "
            f"{a.interval_ms:.0f} ms; starting {len(crash_names) + len(hang_names)} trial workers meanwhile"
        )
        steady_end = time.monotonic() + a.steady_s
        await workers.spawn(crash_names + hang_names, beats=8)
        await asyncio.sleep(max(0.0, steady_end - time.monotonic()))  # the observation window itself
        health = (await ping(bus, "failure-detector", timeout=10.0)).details
        elapsed = time.monotonic() - t0
        hb_rate = (float(health["heartbeats"]) - float(hb0)) / elapsed
        digest_rate = (float(health["digests"]) - float(dg0)) / elapsed
        steady_fp = len(verdicts.false_positives)
        log(
            f"steady done: {steady_fp} false positives, detector took {digest_rate:.0f} digests/s "
            f"({hb_rate:.0f} heartbeats/s)"
        )

        picked = rng.sample(range(a.nodes), a.sim_faults + a.node_faults)
        victims = [(k, rng.randrange(PER_NODE)) for k in picked[: a.sim_faults]]
        lost_nodes = picked[a.sim_faults :]
        log(f"simulated faults: {a.sim_faults} ranks stop inside live nodes")
        sim_ms, sim_missed = await sim_faults(sims, verdicts, victims, 5.0, rng, timeout)
        log(f"node faults: {a.node_faults} simulated nodes go silent")
        node_ms, node_missed = await node_faults(sims, verdicts, lost_nodes, 5.0, rng, timeout)
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
            health = (await ping(bus, "failure-detector", timeout=10.0)).details
            if int(health["repeated_exits"]) >= len(hang_names) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        sim_sent, lag_p99 = await sims.stats()
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
            "node_lost_detect_ms_p50": r1(pct(node_ms, 50)),
            "node_lost_detect_ms_p99": r1(pct(node_ms, 99)),
            "node_lost_detect_intervals_p99": round(pct(node_ms, 99) / a.interval_ms, 2) if node_ms else None,
            "node_lost_missed": node_missed,
            "heartbeat_interval_ms": a.interval_ms,
            "ranks": len(steady_names),
            "real_workers": len(launcher.workers),
            "simulated_ranks": a.nodes * PER_NODE,
            "simulated_nodes": a.nodes,
            "false_positives": len(verdicts.false_positives),
            "false_positives_steady": steady_fp,
            "duplicates": verdicts.duplicates,
            "steady_s": a.steady_s,
            "crash_trials": len(crash_ms),
            "hang_trials": len(hang_ms),
            "stall_trials": len(stall_ms),
            "simulated_faults": len(sim_ms) + sim_missed,
            "node_faults": len(node_ms) + node_missed,
            "crash_path": "launcher",
            "detector_heartbeats_per_s": round(hb_rate, 1),
            "detector_digests_per_s": round(digest_rate, 1),
            "detector_lag_holds": health["lag_holds"],
            "detector_backlog_holds": health["backlog_holds"],
            "detector_decode_errors": health["decode_errors"],
            "sim_digests_sent": sim_sent,
            "sim_publish_lag_ms_p99": r1(lag_p99 * 1e3) if lag_p99 is not None else None,
            "cpus": os.cpu_count(),
        }
    finally:
        # the detector goes first: simulated nodes that stop are no incident to judge
        detector = services.get("failure-detector")
        if detector is not None and detector.poll() is None:
            detector.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                detector.wait(15)
        try:
            if sims is not None:
                sims.stop()
            if launcher is not None:
                await launcher.stop()
            if bus is not None:
                await bus.close()
        finally:  # the services and the server go even when stopping the launcher failed
            for proc in services.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in services.values():
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            srv.cleanup()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["_simulate"]:  # a simulator process (see Simulators)
        url, proc, interval, seed, nodes = args[1:6]
        asyncio.run(simulate(url, int(proc), [int(k) for k in nodes.split(",")], float(interval), int(seed)))
        return
    a = parse(args)
    setup_logging("bench-detect", load(TelemetrySettings).log_level or "WARNING")  # JSON lines on stderr
    keep = os.environ.get("PHALANX_BENCH_DIR")
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-detect-") as tmp:
        work = Path(keep) if keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(run(a, work))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

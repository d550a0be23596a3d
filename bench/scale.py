"""The control plane at scale: ``python -m bench.scale --ranks 16384 --ranks-per-node 8``.

Starts its own nats-server (with its HTTP monitoring port: ``/varz`` ``in_bytes``,
``out_bytes``, ``in_msgs``, ``out_msgs`` are the server's own counts), the failure
detector and the elasticity planner as separate processes (``python -m
phalanx.services.<name>``; the bus creates the streams and buckets through
:mod:`phalanx.bus.topology` as every service does), and ``--sim-procs`` processes of
simulated launchers (:mod:`bench.scalesim`: asyncio clients speaking the real wire
protocol through :class:`~phalanx.bus.Bus` and the contract's models). Then:

1. **start**: every simulated node joins (``JobSpec`` -> ``NodeJoined``), its workers
   register, its launcher publishes one ``NodeDigest`` per interval; the planner commits
   generation 1 once every rank registered. Plan sources start once generation 1 is
   committed (today's followers would otherwise watch every revision of the record
   during the join, O(N^2) bytes: ``join_fanout_bytes_today_est`` is that sum, computed
   from the sizes of the revisions the bench saw and one more follower per revision);
2. **node losses** (``--node-losses``, one after another, each once the previous plan is
   acknowledged): a quiet window measures the background traffic (digests, today's
   launchers' polling); then a node's digests stop (its launcher and ranks stop
   receiving too); the detector declares it lost, the planner commits the next
   generation, every live launcher receives it through the design's plan source
   (:mod:`bench.scaleplan`), members acknowledge; the record shows every acknowledgement
   taken; a settle window lets the last deliveries land.

Figures (the last line on stdout, one JSON object; progress on stderr):

- ``record_bytes``: the ``<job>.plan`` KV value after the last plan (and at generation 1);
- ``plan_bytes_per_node``: payload bytes one launcher's plan source received for one plan
  (from the verdict to the end of the settle window; polling re-reads excluded and given
  as ``launcher_poll_bytes_per_s``), median and max over launchers and losses;
- ``node_loss_to_all_launchers_s``: digests stop -> the last live launcher holds the new
  plan (detection included), median, p90, max over the losses; its parts:
  ``detect_s`` (digests stop -> the detector's ``NodeLost`` reaches the bench),
  ``verdict_to_published_s`` (-> the planner's first publish of the plan, as the bench
  sees it), ``verdict_to_first_launcher_s``, ``verdict_to_all_launchers_s``, and
  ``verdict_to_launchers_p50_s`` (half the launchers hold it);
- ``planner_decision_ms``: the planner's own ``plan`` span of each NodeLost (its
  transaction: input taken -> reducer step -> record committed by compare-and-set), from
  the span file;
- ``planner_rss_mb``: VmRSS of the planner process after generation 1 and at the end,
  and its peak (VmHWM), from /proc;
- ``nats_bytes_per_plan``: server in_bytes + out_bytes from the verdict to the end of the
  settle window, minus the bench's own connection and minus the background rate of the
  quiet window over that time (``raw`` without the background subtracted).

Today's ranks each follow the record too. ``--rank-followers K`` runs K of them for real
(spread over the nodes; ``all`` for every worker); their bytes per plan are measured and
``nats_bytes_per_plan_all_ranks_est`` adds the rest at the measured mean per rank.

    python -m bench.scale --ranks 1024 --ranks-per-node 8          # today's design, ~3 min
    python -m bench.scale --ranks 65536 --record-only              # the record alone
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from bench import scalerecord
from bench.scaleplan import design
from bench.scalerecord import JOB, log
from bench.scalesim import CTL, node_name
from phalanx.bus import Bus
from phalanx.bus.kv import kv_decode
from phalanx.contract import JobRecord, NodeLost, decode
from phalanx.contract.streams import JOBS_BUCKET
from phalanx.contract.subjects import DELTA, NODE_LOST, PLAN
from phalanx.devstack.natsserver import NatsServer, free_port
from phalanx.service import ping
from phalanx.settings import TelemetrySettings, load
from phalanx.telemetry import setup_logging
from phalanx.worker.follow import record_key

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("failure-detector", "elasticity-planner")


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


def summary(values: list[float], digits: int = 3) -> dict[str, float | None]:
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, digits)

    return {
        "median": r(pct(values, 50)),
        "p90": r(pct(values, 90)),
        "max": r(max(values) if values else None),
    }


def proc_status(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (peak) of process ``pid`` in MiB."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = round(int(rest.split()[0]) / 1024, 1)
    return out


class Varz:
    """The server's own statistics from its monitoring port."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/varz"

    def _get(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url, timeout=5) as r:
            data: dict[str, Any] = json.loads(r.read())
        return data

    async def sample(self, bus: Bus) -> dict[str, float]:
        """The server's totals now, and this bench's own connection's, and the time."""
        v = await asyncio.to_thread(self._get)
        s = bus.nc.stats
        return {
            "t": time.time(),
            "bytes": float(v["in_bytes"] + v["out_bytes"]),
            "msgs": float(v["in_msgs"] + v["out_msgs"]),
            "own_bytes": float(s["in_bytes"] + s["out_bytes"]),
            "own_msgs": float(s["in_msgs"] + s["out_msgs"]),
        }


def delta(a: dict[str, float], b: dict[str, float]) -> tuple[float, float, float]:
    """(seconds, bytes, msgs) between two samples, the bench's own traffic taken out."""
    return (
        b["t"] - a["t"],
        (b["bytes"] - a["bytes"]) - (b["own_bytes"] - a["own_bytes"]),
        (b["msgs"] - a["msgs"]) - (b["own_msgs"] - a["own_msgs"]),
    )


class Sims:
    """The simulator processes, seen from the bench."""

    def __init__(self, a: argparse.Namespace, url: str, work: Path) -> None:
        self.procs = max(1, min(a.sim_procs, a.nodes))
        self.owner = {k: k % self.procs for k in range(a.nodes)}
        self.running: list[subprocess.Popen[bytes]] = []
        for p in range(self.procs):
            cfg = {
                "url": url,
                "proc": p,
                "job": JOB,
                "design": a.design,
                "nodes": [k for k in range(a.nodes) if self.owner[k] == p],
                "ranks_per_node": a.ranks_per_node,
                "spares_per_node": a.spares_per_node,
                "min_nodes": a.nodes,
                "max_nodes": a.nodes,
                "global_batch": a.ranks * 4,
                "interval_s": a.interval_ms / 1e3,
                "rank_stride": a.rank_stride,
                "join_timeout_s": a.timeout_s,
            }
            with open(work / f"sim-{p}.log", "wb") as err:
                self.running.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "bench.scalesim", json.dumps(cfg)],
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
                raise RuntimeError("a simulator did not start (see its sim-<n>.log)")

    async def ask(self, proc: int, req: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        assert self.bus is not None
        reply = await self.bus.nc.request(f"{CTL}.{proc}", json.dumps(req).encode(), timeout=timeout)
        out: dict[str, Any] = json.loads(reply.data)
        return out

    async def ask_all(self, req: dict[str, Any], timeout: float = 10.0) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self.ask(p, req, timeout) for p in range(self.procs))))

    def stop(self) -> None:
        for proc in self.running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.running:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


class Record:
    """The job's record, read by the bench (its bytes are taken out of the server's)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.size = 0

    async def read(self) -> JobRecord | None:
        bucket = await self.bus.kv.bucket(JOBS_BUCKET)
        entry = await bucket.get(record_key(JOB))
        if entry is None or not entry.value:
            return None
        self.size = len(entry.value)
        return kv_decode(entry.value, JobRecord)

    async def wait(self, ok: Any, timeout_s: float, every_s: float = 0.2) -> JobRecord:
        deadline = time.monotonic() + timeout_s
        while True:
            rec = await self.read()
            if rec is not None and ok(rec):
                return rec
            if time.monotonic() > deadline:
                raise TimeoutError("the job's record did not get there")
            await asyncio.sleep(every_s)


async def watch_join(bus: Bus, stop: asyncio.Event) -> list[int]:
    """The size of every revision of the record while the job starts (not decoded)."""
    sizes: list[int] = []
    watcher = await bus.kv.watch(JOBS_BUCKET, record_key(JOB), heartbeat_s=5.0)
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                entry = await asyncio.wait_for(watcher.__anext__(), 1.0)
                if entry.value:
                    sizes.append(len(entry.value))
    finally:
        await watcher.stop()
    return sizes


def planner_spans(span_file: Path, incidents: set[str]) -> list[float]:
    """Durations (ms) of the planner's ``plan`` spans of these incidents."""
    out = []
    with contextlib.suppress(FileNotFoundError):
        for line in span_file.read_text().splitlines():
            s = json.loads(line)
            if s.get("name") == "plan" and s.get("attributes", {}).get("phalanx.incident") in incidents:
                out.append((s["end_ns"] - s["start_ns"]) / 1e6)
    return out


def channel_bytes(counted: dict[str, Any], poll: bool) -> int:
    b: dict[str, int] = counted["bytes"]
    return sum(v for c, v in b.items() if (c == "read") == poll)


async def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    design(a.design)  # an unknown design fails here, not in the simulators
    rng = random.Random(a.seed)
    mport = free_port()
    srv = NatsServer(store_dir=work / "nats", extra_args=["-m", str(mport)]).start()
    varz = Varz(mport)
    span_file = work / "spans.jsonl"
    services: dict[str, subprocess.Popen[bytes]] = {}
    sims: Sims | None = None
    bus: Bus | None = None
    try:
        env = {
            **os.environ,
            "NATS_URL": srv.url,
            "PHALANX_HEARTBEAT_MS": str(a.interval_ms),
            "PHALANX_SPAN_FILE": str(span_file),
            "PHALANX_LOG_LEVEL": "WARNING",
        }
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        for name in SERVICES:
            with open(work / f"{name}.log", "wb") as out:
                services[name] = subprocess.Popen(
                    [sys.executable, "-m", f"phalanx.services.{name.replace('-', '_')}"],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
        bus = await Bus.connect(srv.url, name="bench-scale")
        deadline = time.monotonic() + 60
        for name, proc in services.items():
            while True:
                try:
                    await ping(bus, name, timeout=0.5)
                    break
                except Exception:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{name} did not start; see {work / name}.log") from None
                    await asyncio.sleep(0.1)
        planner_pid = services["elasticity-planner"].pid
        lost: dict[str, tuple[NodeLost, float]] = {}
        lost_changed = asyncio.Event()

        async def on_lost(raw: Msg) -> None:
            msg = decode(raw.data, raw.headers, NodeLost)
            lost.setdefault(msg.node, (msg, time.time()))
            lost_changed.set()

        await bus.nc.subscribe(NODE_LOST.format(job=JOB), cb=on_lost)
        published: list[float] = []  # arrivals of plans and deltas (the planner's publish, as seen here)

        async def on_published(raw: Msg) -> None:
            published.append(time.time())

        for subject in (PLAN, DELTA):
            await bus.nc.subscribe(subject.format(job=JOB), cb=on_published)
        record = Record(bus)

        # -- start ------------------------------------------------------------------------
        t_start = time.monotonic()
        log(
            f"nats {srv.url}; {a.nodes} simulated nodes x ({a.ranks_per_node} ranks + {a.spares_per_node} "
            f"spares) in {a.sim_procs} processes, design {a.design}, digests every {a.interval_ms:g} ms"
        )
        join_done = asyncio.Event()
        join_watch = asyncio.create_task(watch_join(bus, join_done))
        sims = Sims(a, srv.url, work)
        await sims.ready(bus)
        last_log = 0.0
        while True:
            st = await sims.ask_all({"op": "status"})
            rec = await record.read()
            if rec is not None and rec.plan is not None:
                break
            if time.monotonic() - last_log > 10:
                last_log = time.monotonic()
                log(
                    f"start: {sum(s['joined'] for s in st)}/{a.nodes} nodes joined, "
                    f"{sum(s['registered'] for s in st)}/{a.workers} workers registered"
                )
            if time.monotonic() - t_start > a.timeout_s or any(p.poll() is not None for p in sims.running):
                raise RuntimeError("the job did not start (see the planner's and simulators' logs)")
            await asyncio.sleep(1.0)
        start_s = time.monotonic() - t_start
        join_done.set()
        sizes = await join_watch
        record_gen1 = record.size
        generation = rec.plan.generation
        log(f"generation {generation} committed after {start_s:.1f} s; record {record_gen1} B")
        rss_started = proc_status(planner_pid)
        follow = await sims.ask_all({"op": "follow"}, timeout=a.timeout_s)
        rank_followers = sum(f["ranks"] for f in follow)
        done = await sims.ask_all(
            {"op": "await", "generation": generation, "timeout_s": a.timeout_s}, a.timeout_s + 10
        )
        if not all(d["ok"] for d in done):
            raise RuntimeError(f"not every launcher holds generation {generation}: {done}")
        await sims.ask_all({"op": "collect"})
        log(f"every launcher holds generation {generation}; {rank_followers} ranks follow plans themselves")

        # -- node losses --------------------------------------------------------------------
        live = list(range(a.nodes))
        rng.shuffle(live)
        to_lose = live[: a.node_losses]
        publish_s, first_s, half_s = [], [], []
        loss_s, detect_s, spread_s, plan_bytes, poll_rates, rank_bytes = [], [], [], [], [], []
        nats_net, nats_raw, nats_msgs, background = [], [], [], []
        incidents: set[str] = set()
        failures: list[str] = []
        for i, k in enumerate(to_lose):
            q0 = await varz.sample(bus)
            await asyncio.sleep(a.quiet_s)
            q1 = await varz.sample(bus)
            q_s, q_bytes, _ = delta(q0, q1)
            bg_rate = q_bytes / q_s
            await sims.ask_all({"op": "collect"})  # counters from here on
            t_silence = float((await sims.ask(sims.owner[k], {"op": "silence", "node": k}))["at"])
            name = node_name(k)
            try:
                while name not in lost:
                    lost_changed.clear()
                    await asyncio.wait_for(lost_changed.wait(), a.plan_timeout_s)
            except TimeoutError:
                failures.append(f"{name}: no NodeLost")
                break
            verdict, t_verdict = lost[name]
            incidents.add(verdict.incident)
            c = await varz.sample(bus)
            target = generation + 1
            done = await sims.ask_all(
                {"op": "await", "generation": target, "timeout_s": a.plan_timeout_s}, a.plan_timeout_s + 30
            )
            if not all(d["ok"] for d in done):
                failures.append(f"{name}: not every launcher got generation {target}: {done}")
                break
            held = [t for d in done for t in d["times"]]  # when each live launcher first held it
            t_all, t_first = max(held), min(held)
            half_s.append((pct(held, 50) or t_all) - t_verdict)
            t_pub = min((t for t in published if t >= t_verdict), default=None)
            try:
                rec = await record.wait(
                    lambda r, g=target: r.planner is not None and r.planner.acked >= g, a.plan_timeout_s
                )
            except TimeoutError:
                failures.append(f"{name}: generation {target} was never fully acknowledged")
                break
            await asyncio.sleep(a.settle_s)
            d = await varz.sample(bus)
            got = await sims.ask_all({"op": "collect"}, timeout=30)
            w_s, w_bytes, w_msgs = delta(c, d)
            assert rec.plan is not None
            generation = rec.plan.generation
            loss_s.append(t_all - t_silence)
            detect_s.append(t_verdict - t_silence)
            spread_s.append(t_all - t_verdict)
            first_s.append(t_first - t_verdict)
            pub = "?" if t_pub is None else f"{t_pub - t_verdict:.2f}"
            if t_pub is not None:
                publish_s.append(t_pub - t_verdict)
            nats_raw.append(w_bytes)
            nats_net.append(w_bytes - bg_rate * w_s)
            nats_msgs.append(w_msgs)
            background.append(bg_rate)
            for g in got:
                for launcher in g["launchers"]:
                    plan_bytes.append(channel_bytes(launcher, poll=False))
                    poll_rates.append(channel_bytes(launcher, poll=True) / w_s)
                for r in g["ranks"]:
                    rank_bytes.append(sum(r["bytes"].values()))
            log(
                f"loss {i + 1}/{len(to_lose)}: {name} -> generation {generation} at every launcher after "
                f"{loss_s[-1]:.2f} s (detected {detect_s[-1]:.2f} s, published +{pub} s, "
                f"first launcher +{first_s[-1]:.2f} s, half +{half_s[-1]:.2f} s); server {w_bytes / 1e6:.1f} MB in the plan's "
                f"{w_s:.1f} s ({bg_rate / 1e6:.2f} MB/s background)"
            )
        rss_end = proc_status(planner_pid)
        await asyncio.sleep(0.5)  # the planner's span batch
        decision_ms = planner_spans(span_file, incidents)
        await record.read()
        per_rank = sum(rank_bytes) / len(rank_bytes) if rank_bytes else 0.0
        net_median = pct(nats_net, 50)
        all_ranks = None
        if net_median is not None and rank_followers:
            all_ranks = net_median + per_rank * max(0, a.workers - rank_followers)
        st = await sims.ask_all({"op": "status"})
        lags = [s["lag_p99_s"] for s in st if s["lag_p99_s"] is not None]
        return {
            "design": a.design,
            "ranks": a.ranks,
            "nodes": a.nodes,
            "workers": a.workers,
            "ranks_per_node": a.ranks_per_node,
            "spares_per_node": a.spares_per_node,
            "record_bytes": record.size,
            "record_bytes_gen1": record_gen1,
            "plan_bytes_per_node": {
                "median": pct([float(b) for b in plan_bytes], 50),
                "max": max(plan_bytes) if plan_bytes else None,
            },
            "launcher_poll_bytes_per_s": round(pct(poll_rates, 50) or 0.0, 1),
            "node_loss_to_all_launchers_s": summary(loss_s),
            "detect_s": summary(detect_s),
            "verdict_to_all_launchers_s": summary(spread_s),
            "verdict_to_published_s": summary(publish_s),
            "verdict_to_first_launcher_s": summary(first_s),
            "verdict_to_launchers_p50_s": summary(half_s),
            "planner_decision_ms": {
                **summary(decision_ms, 1),
                "source": "planner plan span (txn: step + CAS)",
            },
            "planner_rss_mb": {
                "after_start": rss_started.get("VmRSS"),
                "end": rss_end.get("VmRSS"),
                "peak": rss_end.get("VmHWM"),
            },
            "nats_bytes_per_plan": {
                "median": pct(nats_net, 50),
                "max": max(nats_net) if nats_net else None,
                "raw_median": pct(nats_raw, 50),
                "background_bytes_per_s": pct(background, 50),
            },
            "nats_msgs_per_plan": pct(nats_msgs, 50),
            "rank_followers": rank_followers,
            "rank_plan_bytes_per_rank": round(per_rank, 1),
            "nats_bytes_per_plan_all_ranks_est": all_ranks,
            "join_fanout_bytes_today_est": sum(i * s for i, s in enumerate(sizes, start=1)),
            "start_s": round(start_s, 1),
            "node_losses": len(loss_s),
            "failures": failures,
            "interval_ms": a.interval_ms,
            "sim_procs": sims.procs,
            "sim_digest_lag_p99_s": max(lags) if lags else None,
            "cpus": os.cpu_count(),
        }
    finally:
        detector = services.get("failure-detector")
        if detector is not None and detector.poll() is None:
            detector.send_signal(signal.SIGTERM)  # first: nodes that stop are no incident
            with contextlib.suppress(subprocess.TimeoutExpired):
                detector.wait(15)
        if sims is not None:
            sims.stop()
        if bus is not None:
            await bus.close()
        for proc in services.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in services.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        srv.cleanup()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024, help="ranks of the job (members of generation 1)")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--spares-per-node", type=int, default=1, help="hot spares each node starts with")
    p.add_argument("--design", default="new", help="plan delivery: new | today (bench/scaleplan.py)")
    p.add_argument(
        "--baseline",
        default="today",
        help="then run this design in the same invocation and report it under its name ('' for none)",
    )
    p.add_argument("--record-only", action="store_true", help="build and measure the job record alone")
    p.add_argument("--record-mode", choices=("inplace", "step"), default="step")
    p.add_argument("--node-losses", type=int, default=10)
    p.add_argument("--sim-procs", type=int, default=2, help="simulator processes")
    p.add_argument("--interval-ms", type=float, default=500.0, help="heartbeat and digest interval")
    p.add_argument(
        "--rank-followers",
        default="256",
        help="ranks that follow plans on NATS themselves for real (design today): a count, or 'all'",
    )
    p.add_argument("--quiet-s", type=float, default=2.0, help="background window before each loss")
    p.add_argument("--settle-s", type=float, default=1.0, help="after the last acknowledgement is taken")
    p.add_argument("--timeout-s", type=float, default=600.0, help="for the job to start")
    p.add_argument("--plan-timeout-s", type=float, default=120.0, help="for each plan to reach everyone")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    if a.ranks < 1 or a.ranks_per_node < 1 or a.ranks % a.ranks_per_node:
        p.error("--ranks must be a positive multiple of --ranks-per-node")
    a.nodes = a.ranks // a.ranks_per_node
    a.workers = a.nodes * (a.ranks_per_node + a.spares_per_node)
    if not a.record_only and a.node_losses >= a.nodes:
        p.error("need more nodes than node losses")
    k = a.workers if a.rank_followers == "all" else int(a.rank_followers)
    a.rank_stride = 0 if k <= 0 else max(1, math.ceil(a.workers / k))
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse(sys.argv[1:] if argv is None else argv)
    setup_logging("bench-scale", load(TelemetrySettings).log_level or "WARNING")
    if a.record_only:
        result = scalerecord.measure(a.ranks, a.ranks_per_node, a.spares_per_node, mode=a.record_mode)
        print(json.dumps(result), flush=True)
        return
    keep = os.environ.get("PHALANX_BENCH_DIR")
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-scale-") as tmp:
        work = Path(keep) if keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(run(a, work))
        if a.baseline and a.baseline != a.design:
            # The baseline in the same invocation: fresh servers and simulators, the other design.
            log(f"baseline: design {a.baseline}")
            b = argparse.Namespace(**{**vars(a), "design": a.baseline})
            try:
                (work / "baseline").mkdir(exist_ok=True)
                base = asyncio.run(run(b, work / "baseline"))
            except Exception as exc:  # e.g. a record past the payload limit: it cannot commit
                base = {"error": repr(exc)[:500]}
            result[a.baseline] = base
            if isinstance(base.get("nats_bytes_per_plan"), dict) and base["nats_bytes_per_plan"].get(
                "median"
            ):
                result["nats_bytes_per_plan_ratio"] = round(
                    (result["nats_bytes_per_plan"]["median"] or 0) / base["nats_bytes_per_plan"]["median"], 5
                )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

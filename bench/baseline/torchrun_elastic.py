"""The torchrun-elastic baseline of the elastic-training benchmark (``bench.elastic``):
a scripted capacity trace run under ``torchrun --nnodes MIN:MAX`` with restarts from
a checkpoint.

    python -m bench.baseline.torchrun_elastic [--period 20] [--trace 0:4,20:2,40:3,60:4 --end 80]
                                              [--steady-steps 200] [--workdir DIR]

What runs: one torchrun agent (``python -m torch.distributed.run``) per "node" slot,
all on 127.0.0.1, each with ``--nproc-per-node 1``, ``--nnodes MIN:MAX`` (the trace's
smallest and largest sizes), a c10d rendezvous hosted by agent 0 (``is_host=1``; the
others ``is_host=0``), ``--max-restarts 100``, running bench/baseline/elastic_worker.py:
the MLP of examples/mlp.py on a constant global batch ``G`` (default 48) split over
whatever world the rendezvous formed (``phalanx.batchplan.shard_sizes``, SUM
all-reduce of ``n/G``-weighted gradients, as Phalanx splits it), rank 0 checkpointing
model + optimizer every 10 steps and every rank resuming from that checkpoint at start.

The trace, ``[(t, size), ...]`` in seconds from the start until ``end_s``: at each
``t`` the driver changes the number of agents as a scheduler would. Scale down:
SIGTERM to the process group of the highest-numbered agents (torchrun's agent then
stops its worker; agent 0, which hosts the rendezvous store, is never removed: its
loss would end the job). The surviving workers fail on their gloo connections, their
agents restart them (a restart counted against ``--max-restarts``) and rejoin; the
rendezvous moves to a new round once the departed agents' keep-alives have expired.
Scale up: new agents start; each joins the rendezvous's wait list, the running agents
see it on their next monitor tick, stop their workers and form a new round with it.
Either way every worker restarts and resumes from the last checkpoint, redoing the
steps since.

Measured (:func:`run_trace`, from rank 0's steps log, one JSON line per step):

- per change, ``pause_s``: the last step completed by the round that was running at the
  change (for a scale-up it trains on until torchrun stops it) -> the first step
  completed at the new size; ``since_change_s``: the change -> that first step;
- ``redone_steps``: steps completed again after the change (step numbers logged
  before), i.e. the steps since the last checkpoint;
- goodput (:func:`goodput`), counted from the first completed step ``t0`` to the end
  of the trace: samples whose optimizer step survived (``G`` x distinct step numbers
  completed in ``(t0, end]``) / samples the offered capacity could have trained
  (``sum over the trace's segments, clipped to [t0, end], of duration x G x rate(size)``,
  ``rate`` the steady steps per second at that size). The rates come from short
  fixed-size torchrun runs of the same worker before the trace
  (:func:`measure_step_times`: median step time after a warm-up; the checkpoint steps
  are in the runs but not in the median, so the baseline's checkpoint cost counts as
  lost goodput too).

Rendezvous settings, tuned down from torchrun's defaults (``--rdzv-conf``; all whole
seconds, 1 is the minimum) so that the baseline is not handicapped:

- ``keep_alive_interval=1,keep_alive_max_attempt=3`` (defaults 5 and 3): a SIGTERMed
  agent does not leave the rendezvous (torchrun keeps it open on a signal so that the
  job can go on), so the next round waits until its keep-alive expires: 1-3 s after
  it is gone instead of 10-15 s. ``keep_alive_max_attempt=2`` is NOT reliable: the
  keep-alive timer fires every interval but only beats once a full interval has
  passed since the last beat, so a live agent's beat is often ~2 s old, and the
  running agents' own polls (``num_nodes_waiting``, every monitor tick) then drop
  live participants. Seen here: agents 0 and 1 were dropped while training, the
  round advanced under them, the next agent to join formed a round of its own with
  the one after it, and two 2-rank groups trained at once on the same checkpoint
  (``overlapping_rounds`` in the report checks for it).
- ``last_call_timeout=1`` (30): once MIN agents have joined a round the rendezvous
  waits this long for more (not at all once MAX have joined). Agents poll a pending
  round once a second, so 1 s can close a round before a slow agent joins; that
  agent then waits in the wait list and forces one more round (``rendezvous_rounds``
  in the report shows it; it did not happen in the runs here).
- ``join_timeout=60`` (600) and ``close_timeout=5`` (30): not on a pause's path (how
  long an agent waits for a round to complete, and for the rendezvous to close at
  the end); 60 s leaves room for a slow restart on this loaded 2-core machine.
- ``--monitor-interval 0.1`` (torchrun's default): how often an agent polls its
  workers and the wait list.

With torchrun's defaults (keep-alive 15 s, last call 30 s) each pause grows by tens
of seconds. Environment: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see
bench/baseline/run.py), ``GLOO_SOCKET_IFNAME=lo``, ``OMP_NUM_THREADS=1``,
``LOGLEVEL=INFO`` (the agents' rounds in their output files).

Where a pause goes (``restart_phases_s`` per change, from the worker's
``--starts-log``): after a scale-down, 3-4 s until the new workers exist (the
survivors' gloo error, their agents' restart, the departed agents' keep-alive
expiry, the last call); after a scale-up, 4-5 s (the new agent's own start-up, ~3 s
of importing torch, then its join and the round); then every worker's start-up,
3-8 s on this machine: importing torch (~2 s alone) and ``torch._dynamo`` (pulled in
by constructing AdamW, ~2 s), all the workers at once on 2 cores.

Limitations: all agents share this machine's 2 cores (and whatever else runs on
it), so the step time grows with the world size instead of shrinking (the rates are
measured per size for that reason), the steady runs are short and noisy, and a
restart's start-up competes with the running workers; the trace's times are when
the driver acts, not when an agent's process is gone or ready; the steps log's
``ts`` is rank 0's wall time after its optimizer step. A change whose new size has
not trained a step before the next change (or the end) has no pause (``None``;
``pause_at_least_s`` gives the bound), so keep the period above ~15 s here.

Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from bench.baseline.torchrun import REPO, torchrun_command, torchrun_env
from phalanx.devstack.natsserver import free_port

WORKER = REPO / "bench" / "baseline" / "elastic_worker.py"
RDZV_CONF: dict[str, int] = {
    "join_timeout": 60,
    "last_call_timeout": 1,
    "close_timeout": 5,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 3,
}
MONITOR_INTERVAL_S = 0.1
MAX_RESTARTS = 100
CKPT_EVERY = 10
MARKER = "PHALANX_ELASTIC_BASELINE"  # in every agent's and worker's environment: to find them all

Trace = list[tuple[float, int]]


# --- the trace --------------------------------------------------------------------


def default_trace(period: float) -> tuple[Trace, float]:
    """The 4 -> 2 -> 3 -> 4 trace, a size every ``period`` seconds, and its end."""
    return [(0.0, 4), (period, 2), (2 * period, 3), (3 * period, 4)], 4 * period


def parse_trace(text: str) -> Trace:
    """``"0:4,15:2,30:3,45:4"`` -> ``[(0.0, 4), (15.0, 2), (30.0, 3), (45.0, 4)]``."""
    out: Trace = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        t, sep, w = part.partition(":")
        if not sep:
            raise ValueError(f"trace entry {part!r} is not TIME:SIZE")
        out.append((float(t), int(w)))
    check_trace(out)
    return out


def check_trace(trace: Sequence[tuple[float, int]], end_s: float | None = None) -> None:
    """Raises unless the trace starts at time 0, its times increase, consecutive sizes
    differ, every size is >= 1 and ``end_s`` (when given) is after its last change."""
    if not trace:
        raise ValueError("empty trace")
    if trace[0][0] != 0:
        raise ValueError(f"the trace must start at time 0, not {trace[0][0]}")
    for (t0, w0), (t1, w1) in itertools.pairwise(trace):
        if t1 <= t0:
            raise ValueError(f"trace times must increase: {t0} then {t1}")
        if w1 == w0:
            raise ValueError(f"no change at {t1}: size {w1} again")
    if min(w for _, w in trace) < 1:
        raise ValueError("sizes must be >= 1")
    if end_s is not None and end_s <= trace[-1][0]:
        raise ValueError(f"the trace ends at {end_s}, not after its last change at {trace[-1][0]}")


# --- the steps log ----------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """One line of rank 0's steps log: step ``step`` (from 0) completed at ``ts`` on
    ``world`` ranks, in the launch ``attempt`` (one value per restart round)."""

    step: int
    loss: float
    world: int
    ts: float
    attempt: int = 0


def parse_steps_log(text: str) -> list[StepRecord]:
    """The log's records by time; blank and torn lines (a worker killed mid-write) skipped."""
    out = []
    for line in text.splitlines():
        try:
            e = json.loads(line)
            out.append(
                StepRecord(
                    int(e["step"]),
                    float(e["loss"]),
                    int(e["world"]),
                    float(e["ts"]),
                    int(e.get("attempt", 0)),
                )
            )
        except (ValueError, KeyError, TypeError):
            continue
    out.sort(key=lambda r: r.ts)
    return out


def read_steps_log(path: Path) -> list[StepRecord]:
    return parse_steps_log(path.read_text(errors="replace")) if path.exists() else []


_ROUND = re.compile(r"\]\s+group_world_size=(\d+)\s*$")


def agent_rounds(text: str) -> list[int]:
    """The world size of each rendezvous round an agent's output (``LOGLEVEL=INFO``)
    reports, in order."""
    return [int(m.group(1)) for line in text.splitlines() if (m := _ROUND.search(line))]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's objects; torn lines skipped."""
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                e = json.loads(line)
                if isinstance(e, dict):
                    out.append(e)
    return out


def step_durations(records: Iterable[StepRecord]) -> list[float]:
    """Seconds between consecutive steps of the same launch (``step`` then ``step + 1``)."""
    out = []
    prev: StepRecord | None = None
    for r in records:
        if prev is not None and r.attempt == prev.attempt and r.step == prev.step + 1:
            out.append(r.ts - prev.ts)
        prev = r
    return out


# --- analysis ---------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """One membership change of the trace, as the steps log saw it."""

    t_s: float  # scripted time (seconds from the start)
    ts: float  # wall time the driver acted
    world_from: int
    world_to: int
    last_step_before: StepRecord | None  # the last step of the round running at the change
    first_step_after: StepRecord | None  # the first step completed at the new size
    redone_steps: int  # steps completed again after this change (before the next one)

    @property
    def pause_s(self) -> float | None:
        if self.last_step_before is None or self.first_step_after is None:
            return None
        return self.first_step_after.ts - self.last_step_before.ts

    @property
    def since_change_s(self) -> float | None:
        return None if self.first_step_after is None else self.first_step_after.ts - self.ts

    def pause_at_least_s(self, end_ts: float) -> float | None:
        """The pause, or when no step completed at the new size before ``end_ts`` (the
        next change or the end), the time from the last step to then."""
        if self.last_step_before is None:
            return None
        p = self.pause_s
        return end_ts - self.last_step_before.ts if p is None else p


def analyze_changes(
    steps: Sequence[StepRecord], trace: Sequence[tuple[float, int]], change_ts: Sequence[float], end_ts: float
) -> list[Change]:
    """The applied changes (``change_ts[i]``: the wall time of ``trace[i + 1]``) with their
    pauses and redone steps, from the steps log's records ``steps`` (sorted by time)."""
    out = []
    bounds = [*change_ts, end_ts]
    # a step completed again: its number was logged before (each redo counted once)
    redo_ts: list[float] = []
    best = -1
    for r in steps:
        if r.step <= best:
            redo_ts.append(r.ts)
        best = max(best, r.step)
    for i, ts in enumerate(change_ts):
        w_from, w_to = trace[i][1], trace[i + 1][1]
        before = [r for r in steps if r.ts <= ts]
        after = next((r for r in steps if ts < r.ts <= bounds[i + 1] and r.world == w_to), None)
        last = before[-1] if before else None
        if last is not None:  # the round running at the change may train on (scale-up)
            limit = after.ts if after is not None else bounds[i + 1]
            last = [r for r in steps if r.attempt == last.attempt and r.ts < limit][-1]
        redone = sum(1 for t in redo_ts if ts < t <= bounds[i + 1])
        out.append(Change(trace[i + 1][0], ts, w_from, w_to, last, after, redone))
    return out


@dataclass
class ElasticRun:
    """One trace under torchrun elastic: the steps log, the changes and their costs."""

    trace: Trace
    end_s: float
    start_ts: float  # wall time of the trace's time 0 (the first agents started)
    end_ts: float  # wall time the run ended: the trace's end, or the job's when it finished first
    global_batch: int
    steps: list[StepRecord]
    change_ts: list[float]  # wall time of each applied change (trace[1:], in order)
    changes: list[Change] = field(default_factory=list)
    finished_early: bool = False  # the job reached steps_cap before the trace's end
    settings: dict[str, Any] = field(default_factory=dict)
    workdir: Path | None = None
    starts: list[dict[str, Any]] = field(default_factory=list)  # the worker's --starts-log
    rounds: list[int] = field(default_factory=list)  # world size of agent 0's rendezvous rounds

    def __post_init__(self) -> None:
        if not self.changes:
            self.changes = analyze_changes(self.steps, self.trace, self.change_ts, self.end_ts)

    @property
    def pauses_s(self) -> list[float | None]:
        return [c.pause_s for c in self.changes]

    @property
    def redone_steps(self) -> list[int]:
        return [c.redone_steps for c in self.changes]

    @property
    def first_ts(self) -> float:
        if not self.steps:
            raise ValueError("no step completed")
        return self.steps[0].ts

    def segments(self) -> list[tuple[float, float, int]]:
        """``(from_ts, to_ts, size)`` of the offered capacity, in wall time."""
        starts = [self.start_ts, *self.change_ts]
        ends = [*self.change_ts, self.end_ts]
        return [(a, b, self.trace[i][1]) for i, (a, b) in enumerate(zip(starts, ends, strict=True))]

    def overlapping_rounds(self) -> int:
        """Pairs of launches whose steps interleave in time: two worker groups training
        at once (a split rendezvous), which must not happen (0)."""
        spans: dict[int, tuple[float, float]] = {}
        for r in self.steps:
            a, b = spans.get(r.attempt, (r.ts, r.ts))
            spans[r.attempt] = (min(a, r.ts), max(b, r.ts))
        ordered = sorted(spans.values())
        return sum(1 for (_, b0), (a1, _) in itertools.pairwise(ordered) if a1 < b0)

    def restart_phases(self, change: Change) -> dict[str, float] | None:
        """Seconds from ``change`` to each start-up point of the launch that first trained
        at the new size (rank 0's): worker process created, imports done, process group
        ready, checkpoint loaded, first step completed."""
        first = change.first_step_after
        if first is None:
            return None
        start = next((s for s in self.starts if s.get("attempt") == first.attempt), None)
        if start is None:
            return None
        out = {
            k: round(start[k] - change.ts, 3)
            for k in ("proc_start", "imported", "pg_ready", "ready")
            if isinstance(start.get(k), (int, float))
        }
        out["first_step"] = round(first.ts - change.ts, 3)
        return out

    def step_times_by_world(self) -> dict[int, list[float]]:
        """Step durations within each round of this run, by world size."""
        out: dict[int, list[float]] = {}
        for a in sorted({r.attempt for r in self.steps}):
            recs = [r for r in self.steps if r.attempt == a]
            out.setdefault(recs[0].world, []).extend(step_durations(recs))
        return out


def trained_steps(run: ElasticRun) -> int:
    """Distinct step numbers completed after the first completed step, until the end."""
    t0 = run.first_ts
    return len({r.step for r in run.steps if t0 < r.ts <= run.end_ts})


def offered_steps(run: ElasticRun, rates: dict[int, float]) -> float:
    """Steps the trace's capacity could have trained from the first completed step to the
    end, at ``rates[size]`` steps per second."""
    t0, total = run.first_ts, 0.0
    for a, b, w in run.segments():
        if w not in rates:
            raise KeyError(f"no rate for world size {w}")
        total += max(0.0, min(b, run.end_ts) - max(a, t0)) * rates[w]
    return total


def goodput(run: ElasticRun, rates: dict[int, float]) -> float:
    """Samples whose optimizer step survived / samples the offered capacity could train,
    from the first completed step to the end of the trace. ``rates[size]``: the steady
    optimizer steps per second at that world size (``1 / step time``; see
    :func:`rates_from_step_times`). ``G`` cancels out of the ratio."""
    offered = offered_steps(run, rates)
    if offered <= 0:
        raise ValueError("no capacity offered after the first completed step")
    return run.global_batch * trained_steps(run) / (run.global_batch * offered)


def rates_from_step_times(step_s: dict[int, float]) -> dict[int, float]:
    """Steps per second from seconds per step."""
    return {w: 1.0 / s for w, s in step_s.items()}


# --- processes --------------------------------------------------------------------


def _marked(value: str) -> list[int]:
    """Pids of the processes whose environment holds ``MARKER=value``."""
    want = f"{MARKER}={value}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if want in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
    return out


def _kill_marked(value: str, procs: Iterable[subprocess.Popen[bytes]] = ()) -> list[int]:
    """SIGKILL every process marked ``value`` (agents and their workers, which torchrun
    starts in sessions of their own) until none is left; reaps ``procs``. Returns the
    pids still there after 10 s (none, normally)."""
    left: list[int] = []
    for _ in range(100):
        left = [p for p in _marked(value) if p != os.getpid()]
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(0.1)
        time.sleep(0.05)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)
    return left


def _env(marker: str) -> dict[str, str]:
    env = torchrun_env()
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["LOGLEVEL"] = "INFO"  # torchrun's rendezvous rounds in the agents' output files
    env[MARKER] = marker
    return env


def _worker_args(
    steps: int,
    global_batch: int,
    ckpt: Path,
    steps_log: Path,
    ckpt_every: int,
    seed: int,
    starts_log: Path | None = None,
) -> list[str]:
    extra = [] if starts_log is None else ["--starts-log", str(starts_log)]
    return [
        str(WORKER),
        "--steps",
        str(steps),
        "--global-batch",
        str(global_batch),
        "--seed",
        str(seed),
        "--ckpt",
        str(ckpt),
        "--ckpt-every",
        str(ckpt_every),
        "--steps-log",
        str(steps_log),
        *extra,
    ]


def rdzv_conf_string(conf: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in conf.items())


def agent_command(
    slot: int,
    *,
    nnodes: str,
    endpoint: str,
    rdzv_id: str,
    rdzv_conf: dict[str, int],
    monitor_interval: float,
    worker_args: Sequence[str],
) -> list[str]:
    """The torchrun agent of node slot ``slot`` (slot 0 hosts the rendezvous store)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        f"{rdzv_conf_string(rdzv_conf)},is_host={1 if slot == 0 else 0}",
        "--local-addr",
        "127.0.0.1",
        "--max-restarts",
        str(MAX_RESTARTS),
        "--monitor-interval",
        str(monitor_interval),
        *worker_args,
    ]


def _tail(path: Path, chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def run_trace(
    trace: Sequence[tuple[float, int]],
    *,
    end_s: float,
    steps_cap: int,
    global_batch: int = 48,
    workdir: Path,
    ckpt_every: int = CKPT_EVERY,
    rdzv_conf: dict[str, int] | None = None,
    monitor_interval: float = MONITOR_INTERVAL_S,
    seed: int = 0,
) -> ElasticRun:
    """Run ``trace`` (``[(seconds from the start, world size), ...]``, until ``end_s``)
    under torchrun elastic, one agent per node slot, the worker training at most
    ``steps_cap`` steps; ``workdir`` must not hold an earlier run. Every agent and
    worker is killed before it returns (or raises, when an agent fails on its own)."""
    trace = [(float(t), int(w)) for t, w in trace]
    check_trace(trace, end_s)
    conf = dict(RDZV_CONF if rdzv_conf is None else rdzv_conf)
    work = Path(workdir)
    steps_log, ckpt, starts_log = work / "steps.jsonl", work / "ckpt.pt", work / "starts.jsonl"
    if steps_log.exists() or ckpt.exists():
        raise FileExistsError(f"{work} holds an earlier run; use a fresh directory")
    work.mkdir(parents=True, exist_ok=True)
    sizes = [w for _, w in trace]
    nnodes = f"{min(sizes)}:{max(sizes)}"
    rdzv_id = f"elastic-{secrets.token_hex(4)}"
    env = _env(rdzv_id)
    wargs = _worker_args(steps_cap, global_batch, ckpt, steps_log, ckpt_every, seed, starts_log)
    endpoint = f"127.0.0.1:{free_port()}"
    settings: dict[str, Any] = {
        "nnodes": nnodes,
        "nproc_per_node": 1,
        "rdzv_backend": "c10d",
        "rdzv_conf": rdzv_conf_string(conf),
        "monitor_interval_s": monitor_interval,
        "max_restarts": MAX_RESTARTS,
        "ckpt_every": ckpt_every,
        "steps_cap": steps_cap,
        "scale_down": "SIGTERM to the agent's process group",
    }
    running: list[subprocess.Popen[bytes]] = []  # index: node slot
    stopped: list[subprocess.Popen[bytes]] = []
    outputs: list[IO[bytes]] = []
    output_of: dict[int, Path] = {}  # agent pid -> its output file

    def start(slot: int) -> None:
        path = work / f"agent{slot}.{len(outputs)}.out"
        out = open(path, "wb")  # closed in finally
        outputs.append(out)
        cmd = agent_command(
            slot,
            nnodes=nnodes,
            endpoint=endpoint,
            rdzv_id=rdzv_id,
            rdzv_conf=conf,
            monitor_interval=monitor_interval,
            worker_args=wargs,
        )
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        running.append(proc)
        output_of[proc.pid] = path

    change_ts: list[float] = []
    finished = False
    start_ts = time.time()
    try:
        for slot in range(trace[0][1]):
            start(slot)
        for t, w in [*trace[1:], (end_s, 0)]:
            while (now := time.time()) < start_ts + t:
                for slot, p in enumerate(running):
                    code = p.poll()
                    if code == 0:
                        finished = True
                    elif code is not None:
                        raise RuntimeError(f"agent {slot} exited with {code}:\n{_tail(output_of[p.pid])}")
                if finished:
                    break
                time.sleep(min(0.05, start_ts + t - now))
            if finished or w == 0:
                break
            change_ts.append(time.time())
            if w < len(running):
                for p in running[w:]:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGTERM)
                stopped += running[w:]
                del running[w:]
            else:
                for slot in range(len(running), w):
                    start(slot)
        end_ts = time.time()
    finally:
        left = _kill_marked(rdzv_id, [*running, *stopped])
        for out in outputs:
            out.close()
        if left:
            print(f"torchrun_elastic: processes left behind: {left}", file=sys.stderr)
    return ElasticRun(
        trace=trace,
        end_s=end_s,
        start_ts=start_ts,
        end_ts=end_ts,
        global_batch=global_batch,
        steps=read_steps_log(steps_log),
        change_ts=change_ts,
        finished_early=finished,
        settings=settings,
        workdir=work,
        starts=read_jsonl(starts_log),
        rounds=agent_rounds(_tail(work / "agent0.0.out", 10_000_000)),
    )


# --- steady step times ------------------------------------------------------------


@dataclass(frozen=True)
class StepTimes:
    """Steady step times (seconds) of a fixed-size run, after the warm-up."""

    world: int
    p50: float
    p90: float
    max: float
    mean: float
    n: int


def summarize_durations(world: int, durations: Sequence[float]) -> StepTimes:
    if not durations:
        raise ValueError(f"no step durations for world size {world}")
    ys = sorted(durations)
    p90 = ys[min(len(ys) - 1, round(0.9 * (len(ys) - 1)))]
    return StepTimes(world, statistics.median(ys), p90, ys[-1], statistics.fmean(ys), len(ys))


def measure_step_times(
    sizes: Iterable[int],
    steps: int = 200,
    *,
    warmup: int = 20,
    global_batch: int = 48,
    ckpt_every: int = CKPT_EVERY,
    workdir: Path | None = None,
    seed: int = 0,
    timeout_s: float = 300.0,
) -> dict[int, StepTimes]:
    """Step times of the elastic worker at each fixed size, under plain torchrun (one
    agent, ``size`` workers, no restarts): ``steps`` steps each, the first ``warmup``
    left out."""
    if steps <= warmup + 1:
        raise ValueError(f"need steps > warmup + 1, got steps={steps} warmup={warmup}")
    out: dict[int, StepTimes] = {}
    with tempfile.TemporaryDirectory(prefix="phalanx-elastic-steady-") as tmp:
        base = Path(workdir) if workdir is not None else Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        for w in sizes:
            log, ckpt, output = base / f"steady{w}.jsonl", base / f"steady{w}.pt", base / f"steady{w}.out"
            for f in (log, ckpt):
                f.unlink(missing_ok=True)
            marker = f"steady-{secrets.token_hex(4)}"
            cmd = torchrun_command(w, _worker_args(steps, global_batch, ckpt, log, ckpt_every, seed))
            with open(output, "wb") as o:
                proc = subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env=_env(marker),
                    stdout=o,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                try:
                    code = proc.wait(timeout_s)
                finally:
                    _kill_marked(marker, [proc])
            if code != 0:
                raise RuntimeError(f"torchrun (size {w}) exited with {code}:\n{_tail(output)}")
            recs = [r for r in read_steps_log(log) if r.step >= warmup]
            out[w] = summarize_durations(w, step_durations(recs))
    return out


def steady_step_times(sizes: Iterable[int], steps: int = 200, **kwargs: Any) -> dict[int, float]:
    """Median steady step time (seconds) at each size (:func:`measure_step_times`)."""
    return {w: s.p50 for w, s in measure_step_times(sizes, steps, **kwargs).items()}


# --- report -----------------------------------------------------------------------


def _stats(xs: Sequence[float]) -> dict[str, float] | None:
    if not xs:
        return None
    ys = sorted(xs)
    p90 = ys[min(len(ys) - 1, round(0.9 * (len(ys) - 1)))]
    return {"median": round(statistics.median(ys), 3), "p90": round(p90, 3), "max": round(ys[-1], 3)}


def _round(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def report(run: ElasticRun, step_times: dict[int, StepTimes]) -> dict[str, Any]:
    """The JSON summary of a run and the steady step times its goodput uses."""
    rates = rates_from_step_times({w: s.p50 for w, s in step_times.items()})
    pauses = [p for p in run.pauses_s if p is not None]
    in_run = {w: statistics.median(d) for w, d in run.step_times_by_world().items() if d}
    in_run_rates = rates_from_step_times(in_run)
    have_in_run = all(w in in_run_rates for _, w in run.trace)
    t0 = run.first_ts
    bounds = [*run.change_ts[1:], run.end_ts]
    return {
        "pauses_s": [None if p is None else round(p, 3) for p in run.pauses_s],
        "max_pause_s": round(max(pauses), 3) if pauses else None,
        "pause_s": _stats(pauses),
        "since_change_s": [
            None if c.since_change_s is None else round(c.since_change_s, 3) for c in run.changes
        ],
        "redone_steps": run.redone_steps,
        "goodput": round(goodput(run, rates), 4),
        "goodput_in_run_rates": round(goodput(run, in_run_rates), 4) if have_in_run else None,
        "rates_steps_per_s": {str(w): round(r, 3) for w, r in sorted(rates.items())},
        "step_s": {
            str(w): {
                k: round(v, 5) if isinstance(v, float) else v for k, v in asdict(s).items() if k != "world"
            }
            for w, s in sorted(step_times.items())
        },
        "in_run_step_s": {str(w): round(v, 5) for w, v in sorted(in_run.items())},
        "changes": [
            {
                "t_s": c.t_s,
                "at_s": round(c.ts - run.start_ts, 3),
                "from": c.world_from,
                "to": c.world_to,
                "last_step": None if c.last_step_before is None else c.last_step_before.step,
                "first_step": None if c.first_step_after is None else c.first_step_after.step,
                "pause_s": None if c.pause_s is None else round(c.pause_s, 3),
                "recovered": c.first_step_after is not None,
                "pause_at_least_s": _round(c.pause_at_least_s(end)),
                "redone_steps": c.redone_steps,
                "restart_phases_s": run.restart_phases(c),
            }
            for c, end in zip(run.changes, bounds, strict=True)
        ],
        "overlapping_rounds": run.overlapping_rounds(),
        "rendezvous_rounds": run.rounds,  # one per change and the start, unless a round closed early
        "first_step_at_s": round(t0 - run.start_ts, 3),
        "trained_steps": trained_steps(run),
        "trained_samples": run.global_batch * trained_steps(run),
        "offered_samples": round(run.global_batch * offered_steps(run, rates), 1),
        "final_step": max(r.step for r in run.steps),
        "final_loss": round(run.steps[-1].loss, 6),
        "finished_early": run.finished_early,
        "trace": [[t, w] for t, w in run.trace],
        "end_s": run.end_s,
        "global_batch": run.global_batch,
        "settings": run.settings,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.baseline.torchrun_elastic", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--period", type=float, default=20.0, help="seconds per size of the 4-2-3-4 trace")
    ap.add_argument("--trace", default=None, help="TIME:SIZE,... instead (needs --end)")
    ap.add_argument("--end", type=float, default=None, help="end of --trace, seconds")
    ap.add_argument("--global-batch", type=int, default=48)
    ap.add_argument("--steps-cap", type=int, default=1_000_000)
    ap.add_argument("--steady-steps", type=int, default=200, help="steps of each fixed-size run")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--workdir", type=Path, default=None, help="keep logs here (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.trace is not None:
        if args.end is None:
            ap.error("--trace needs --end")
        trace, end_s = parse_trace(args.trace), args.end
    else:
        trace, end_s = default_trace(args.period)
    check_trace(trace, end_s)

    def stop(signum: int, _frame: Any) -> None:  # run the finally blocks: kill every agent
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="phalanx-elastic-") as tmp:
        base = args.workdir or Path(tmp)
        step_times = measure_step_times(
            sorted({w for _, w in trace}),
            args.steady_steps,
            warmup=args.warmup,
            global_batch=args.global_batch,
            workdir=base / "steady",
        )
        for w, s in sorted(step_times.items()):
            print(json.dumps({"steady_world": w, **asdict(s)}), flush=True)
        run = run_trace(
            trace,
            end_s=end_s,
            steps_cap=args.steps_cap,
            global_batch=args.global_batch,
            workdir=base / "trace",
        )
        out = report(run, step_times)
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

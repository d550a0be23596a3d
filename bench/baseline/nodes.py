"""The torchrun baseline for the loss of a whole NODE: elastic ``--nnodes MIN:MAX``.

    python -m bench.baseline.nodes [--nodes 3] [--trials 1] [--nproc-per-node 1] [--steps 30]

Each node is a network namespace of a :class:`phalanx.devstack.netns.NetnsCluster` with one
torchrun agent (``python -m torch.distributed.run``) running ``--nproc-per-node``
workers of bench/baseline/train_ddp.py (plain DDP over gloo, DCP checkpoints every
``ckpt_every`` steps in a directory all nodes share: namespaces share the file
system). ``--nnodes len(nodes)-1:len(nodes)`` lets the job go on with the surviving
nodes after one is lost: the survivors' workers fail on their gloo connections to
the dead node, their agents restart them (``--max-restarts 3``), the c10d rendezvous
drops the dead node once its keep-alive expires and completes with the survivors,
and every worker reloads the newest complete checkpoint.

The fault: once rank 0 logs step ``kill_at_step``, every process of namespace
``kill_node`` (agent and workers) gets SIGKILL (:meth:`NetnsCluster.kill_node`).
``fault_step`` is the last step completed before it, the fault time the wall time
just before the kills; ``downtime_s`` runs from the fault to the first step
completed after the restart on the shrunk world (the numbers come from
:func:`bench.baseline.run.summarize`).

Rendezvous settings, tuned down from torchrun's defaults so that the baseline is
not handicapped (``--rdzv-conf``): ``join_timeout=60`` (default 600),
``last_call_timeout=1`` (30; its minimum, whole seconds), ``close_timeout=5`` (30),
``keep_alive_interval=1`` (5) and ``keep_alive_max_attempt=2`` (3), so the dead node
leaves the rendezvous ~2 s after its last heartbeat (15 s by default);
``--monitor-interval 0.1``. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` as in
bench/baseline/run.py, and ``GLOO_SOCKET_IFNAME`` set to each node's veth so that
gloo binds the namespace's address (the shared hostname resolves to the host's).

Limitation of torchrun this exposes: the c10d rendezvous store lives inside the agent
on the ``--rdzv-endpoint`` node (``nodes[0]``, ``is_host=1``). Losing that node loses
the store, and the survivors cannot form a new rendezvous: the job dies. So the
victim must be another node (``kill_node != nodes[0]``); ``allow_store_host=True``
(``--kill-store-host``) kills it anyway and reports what happens instead of raising.
Phalanx keeps its state on NATS, which is not tied to a training node.

Also: SIGKILL lets the kernel close the dead processes' sockets (the namespace's
interface stays up), so the survivors' gloo calls fail at once. A node that
vanishes from the network (power loss) would instead leave them blocked until a
gloo timeout (30 min by default); ``partition_first=True`` models that by cutting
the node off before killing it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from bench.baseline.run import REPO, SCRIPT, script_args, summarize
from examples.corpus import DEFAULT_OUT, build_corpus
from phalanx.devstack.netns import NetnsCluster

RDZV_CONF = (
    "join_timeout=60,last_call_timeout=1,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2"
)
MONITOR_INTERVAL_S = 0.1


def _read_events(path: Path) -> list[dict[str, Any]]:
    """The log's events; a torn last line (a writer killed mid-write) is skipped."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _kill_trees(roots: list[int]) -> None:
    """SIGKILL the processes ``roots`` and all their descendants (torchrun starts its
    workers in sessions of their own, so a process group would not reach them)."""
    kids, todo, seen = _children(), list(roots), set()
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += kids.get(pid, [])
    for pid in seen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _agent_cmd(
    cluster: NetnsCluster,
    node: str,
    *,
    nodes: list[str],
    nproc_per_node: int,
    endpoint: str,
    rdzv_id: str,
    train_args: list[str],
    max_restarts: int,
) -> list[str]:
    is_host = "1" if node == nodes[0] else "0"
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        f"{len(nodes) - 1}:{len(nodes)}",
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        f"{RDZV_CONF},is_host={is_host}",
        "--local-addr",
        cluster.ip(node),
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        str(MONITOR_INTERVAL_S),
        str(SCRIPT),
        *train_args,
    ]


def run_node_loss_trial(
    cluster: NetnsCluster,
    workdir: Path,
    *,
    nodes: list[str],
    nproc_per_node: int,
    steps: int,
    kill_node: str,
    kill_at_step: int,
    ckpt_every: int = 10,
    data: Path,
    global_batch: int = 16,
    seq_len: int = 128,
    seed: int = 0,
    max_restarts: int = 3,
    timeout_s: float = 300.0,
    allow_store_host: bool = False,
    partition_first: bool = False,
) -> dict[str, Any]:
    """One elastic torchrun job over ``nodes`` (namespaces of ``cluster``) that loses
    ``kill_node`` after step ``kill_at_step``; ``workdir`` must be fresh. Returns the
    numbers of :func:`bench.baseline.run.summarize` plus ``world_before``,
    ``world_after``, ``total_s``, ``fault_time`` and paths; raises when the job does
    not finish (unless ``allow_store_host``: then ``recovered`` says whether it did)."""
    if len(nodes) < 2 or kill_node not in nodes:
        raise ValueError(f"need >= 2 nodes and kill_node among them: {nodes}, {kill_node}")
    if kill_node == nodes[0] and not allow_store_host:
        raise ValueError(
            f"{kill_node} hosts torchrun's c10d rendezvous store; its loss ends the job "
            "(pass allow_store_host=True to measure that)"
        )
    if not 0 <= kill_at_step < steps - 1:
        raise ValueError("kill_at_step must leave at least one step to run")
    work = Path(workdir)
    log, ckpt = work / "log.jsonl", work / "ckpt"
    if log.exists() or (ckpt.exists() and any(ckpt.iterdir())):
        raise FileExistsError(f"{work} holds an earlier trial; use a fresh directory")
    work.mkdir(parents=True, exist_ok=True)
    train_args = script_args(data, steps, global_batch, seq_len, seed, ckpt, ckpt_every, log)
    endpoint = f"{cluster.ip(nodes[0])}:{random.randint(20000, 59999)}"
    rdzv_id = f"nodes-{secrets.token_hex(4)}"
    agents: dict[str, subprocess.Popen[bytes]] = {}
    outputs: dict[str, IO[bytes]] = {}
    t0 = time.time()
    fault_time: float | None = None
    try:
        for node in nodes:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            env["OMP_NUM_THREADS"] = "1"
            env["GLOO_SOCKET_IFNAME"] = cluster.ifname(node)
            outputs[node] = open(work / f"torchrun-{node}.out", "wb")
            cmd = _agent_cmd(
                cluster,
                node,
                nodes=nodes,
                nproc_per_node=nproc_per_node,
                endpoint=endpoint,
                rdzv_id=rdzv_id,
                train_args=train_args,
                max_restarts=max_restarts,
            )
            agents[node] = cluster.popen(
                node, cmd, cwd=REPO, env=env, stdout=outputs[node], stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout_s
        # wait for rank 0 to log the fault step (polling the log: the agents run on)
        while fault_time is None:
            if any(e["event"] == "step" and e["step"] >= kill_at_step for e in _read_events(log)):
                if partition_first:
                    cluster.partition(kill_node)
                fault_time = cluster.kill_node(kill_node)
                break
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents.values()):
                raise RuntimeError(f"the job did not reach step {kill_at_step}: {_tails(work, nodes)}")
            time.sleep(0.005)  # log poll interval; the fault lands within 5 ms of the step
        survivors = [n for n in nodes if n != kill_node]
        codes: dict[str, int | None] = {}
        exited_s: dict[str, float | None] = {}
        for node in survivors:
            try:
                codes[node] = agents[node].wait(max(1.0, deadline - time.monotonic()))
                exited_s[node] = time.time() - fault_time
            except subprocess.TimeoutExpired:
                codes[node], exited_s[node] = None, None
        total = time.time() - t0
    finally:
        _kill_trees([a.pid for a in agents.values() if a.poll() is None])
        for a in agents.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.wait(10)
        for f in outputs.values():
            f.close()
        if partition_first and fault_time is not None:
            cluster.heal(kill_node)
    events = _read_events(log)
    first_attempt = [e for e in events if e["event"] == "step" and e["attempt"] == 0]
    fault_step = max((e["step"] for e in first_attempt), default=-1)
    fault = {"event": "fault", "step": fault_step, "node": kill_node, "time": fault_time, "attempt": 0}
    with open(log, "a") as rec:  # for the record: the harness, not a rank, made this fault
        rec.write(json.dumps(fault) + "\n")
    events.append(fault)
    starts = sorted((e for e in events if e["event"] == "start"), key=lambda e: e["time"])
    info: dict[str, Any] = {
        "nodes": len(nodes),
        "nproc_per_node": nproc_per_node,
        "kill_node": kill_node,
        "killed_store_host": kill_node == nodes[0],
        "partition_first": partition_first,
        "fault_time": fault_time,
        "world_before": starts[0]["world_size"] if starts else None,
        "world_after": starts[-1]["world_size"] if len(starts) > 1 else None,
        "agent_exit_codes": codes,
        "agent_exit_after_fault_s": exited_s,  # None: still running at the timeout
        "total_s": total,
        "rdzv_conf": RDZV_CONF,
        "log": str(log),
        "outputs": {n: str(work / f"torchrun-{n}.out") for n in nodes},
    }
    ok = all(c == 0 for c in codes.values())
    done = any(e["event"] == "done" for e in events)
    if not (ok and done):
        if allow_store_host or partition_first:
            return {**info, "recovered": False, "fault_step": fault_step, "tail": _tails(work, survivors)}
        raise RuntimeError(f"the job did not finish after the node loss: {codes}\n{_tails(work, survivors)}")
    result = summarize(events)
    if result["final_step"] != steps - 1:
        raise RuntimeError(f"the run ended at step {result['final_step']}, not {steps - 1}")
    return {**result, **info, "recovered": True}


def _tails(work: Path, nodes: list[str], chars: int = 1500) -> str:
    out = []
    for n in nodes:
        p = work / f"torchrun-{n}.out"
        if p.exists():
            out.append(f"--- {n} ---\n" + p.read_text(errors="replace")[-chars:])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.baseline.nodes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--nproc-per-node", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at-step", type=int, default=-1, help="-1: 13, 17, 11, 19, ... by trial")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--kill-store-host", action="store_true", help="lose nodes[0] (the rendezvous host)")
    ap.add_argument("--partition-first", action="store_true", help="cut the node off before the kill")
    ap.add_argument("--timeout", type=float, default=300.0, help="per trial, seconds")
    ap.add_argument("--workdir", type=Path, default=None, help="keep logs here (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.nodes < 2:
        ap.error("--nodes must be >= 2")
    data = REPO / DEFAULT_OUT
    build_corpus(data)  # idempotent
    names = [f"n{i}" for i in range(args.nodes)]
    offsets = [3, 7, 1, 9, 5]
    trials = []
    with (
        tempfile.TemporaryDirectory(prefix="phalanx-nodes-") as tmp,
        NetnsCluster(names) as cluster,
    ):
        base = args.workdir or Path(tmp)
        for i in range(args.trials):
            k = args.kill_at_step if args.kill_at_step >= 0 else min(args.steps - 3, 10 + offsets[i % 5])
            victim = names[0] if args.kill_store_host else names[1 + i % (args.nodes - 1)]
            trials.append(
                run_node_loss_trial(
                    cluster,
                    base / f"trial{i}",
                    nodes=names,
                    nproc_per_node=args.nproc_per_node,
                    steps=args.steps,
                    kill_node=victim,
                    kill_at_step=k,
                    ckpt_every=args.ckpt_every,
                    data=data,
                    allow_store_host=args.kill_store_host,
                    partition_first=args.partition_first,
                    timeout_s=args.timeout,
                )
            )
    downs = [t["downtime_s"] for t in trials if t.get("downtime_s") is not None]
    summary = {
        "node_loss_downtime_s": {"median": statistics.median(downs), "max": max(downs)} if downs else None,
        "trials": [{k: v for k, v in t.items() if k not in ("log", "outputs")} for t in trials],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The ``phalanx`` command.

phalanx nats [--host H] [--port P] [--store DIR]   run an embedded nats-server
phalanx service NAME                               run one service (failure-detector, ...)
phalanx run --nproc N [--spares K] [--job J] -- python train.py ...          one node
phalanx run --nnodes MIN[:MAX] --node-id NAME --nproc-per-node N [--spares-per-node K]
            --job J --rdzv-endpoint HOST:PORT [--bind ADDR] -- python train.py ...  each node
phalanx trace summary [--trace ID] [--spans FILE] [--jaeger URL]
phalanx cluster offer N --node X [--cluster local]          offer N more worker slots on node X
phalanx cluster reclaim X [--grace 10s] [--cluster local]   take node X back (its workers leave)
phalanx cluster show [--json] [--cluster local]             the local cluster's record
"""

from __future__ import annotations

import argparse
import asyncio
import os
import runpy
import signal
import sys
import uuid
from pathlib import Path

from phalanx.schemas import Elastic

SERVICES = {
    "failure-detector": "phalanx.services.failure_detector",
    "scheduler-signal": "phalanx.services.scheduler_signal",
    "elasticity-planner": "phalanx.services.elasticity_planner",
    "state-replication": "phalanx.services.state_replication",
}


def _cmd_nats(args: argparse.Namespace) -> int:
    from phalanx.natsserver import NatsServer

    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # delivered to sigwait, not fatal
    srv = NatsServer(port=args.port, store_dir=args.store, host=args.host).start()
    print(srv.url, flush=True)
    try:
        signal.sigwait(stop)
    finally:
        srv.stop()
    return 0


def _cmd_service(args: argparse.Namespace) -> int:
    if args.name not in SERVICES:
        print(f"unknown service {args.name!r}; one of {', '.join(SERVICES)}", file=sys.stderr)
        return 2
    sys.argv = [SERVICES[args.name]]
    runpy.run_module(SERVICES[args.name], run_name="__main__", alter_sys=True)
    return 0


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"2:4"`` -> (2, 4); a clear ValueError otherwise."""
    lo, _, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--nnodes must be MIN or MIN:MAX, got {text!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"--nnodes needs 1 <= MIN <= MAX, got {text!r}")
    return low, high


def elastic_settings(args: argparse.Namespace) -> Elastic:
    """The job's elasticity from ``phalanx run``'s options (a clear ValueError if inconsistent)."""
    from pydantic import ValidationError

    from phalanx.cluster import parse_grace

    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()] if args.sizes else []
    except ValueError:
        raise ValueError(
            f"--sizes must be a comma-separated list of world sizes, got {args.sizes!r}"
        ) from None
    try:
        return Elastic(
            max_world_size=args.max_nproc or 0,
            sizes=sizes,
            size_step=args.size_step,
            cooldown_s=parse_grace(args.cooldown, "--cooldown"),
            grace_s=parse_grace(args.grace, "--grace"),
            micro_batch=args.micro_batch,
            max_accum=args.max_accum,
            lr_rule=args.lr_rule,
            auto_grow=args.auto_grow,
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ValueError(f"elastic setting {where or ''}: {first['msg']}") from None


def _cmd_run(args: argparse.Namespace) -> int:
    from phalanx.runtime.launcher import LaunchConfig, LaunchError, run
    from phalanx.telemetry import setup_logging, setup_tracing, shutdown_tracing

    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not cmd:
        print("phalanx run: give the command after --", file=sys.stderr)
        return 2
    try:
        min_nodes, max_nodes = parse_nnodes(args.nnodes)
    except ValueError as exc:
        print(f"phalanx run: {exc}", file=sys.stderr)
        return 2
    if max_nodes > 1 and not args.node_id:
        print("phalanx run: a job that may span nodes needs --node-id (unique per node)", file=sys.stderr)
        return 2
    if max_nodes > 1 and not args.job:
        print("phalanx run: every node of a multi-node job must name it with --job", file=sys.stderr)
        return 2
    url = f"nats://{args.rdzv_endpoint}" if args.rdzv_endpoint else None
    try:
        elastic = elastic_settings(args)
    except ValueError as exc:
        print(f"phalanx run: {exc}", file=sys.stderr)
        return 2
    setup_logging("launcher")
    setup_tracing("phalanx-launcher")
    config = LaunchConfig(
        job=args.job or f"job-{uuid.uuid4().hex[:8]}",
        cmd=cmd,
        nproc=args.nproc,
        spares=args.spares,
        global_batch=args.global_batch,
        min_nproc=args.min_nproc,
        nats_url=url,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        node=args.node_id or "local",
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        bind=args.bind,
        join_timeout_s=args.join_timeout,
        elastic=elastic,
    )
    try:
        return asyncio.run(run(config, args.timeout))
    except (LaunchError, ValueError) as exc:
        print(f"phalanx run: {exc}", file=sys.stderr)
        return 2
    finally:
        shutdown_tracing()


def _cmd_trace(args: argparse.Namespace) -> int:
    from phalanx.tracesummary import load_spans, print_summary

    spans = load_spans(spans_file=args.spans, jaeger_url=args.jaeger, trace_id=args.trace)
    return print_summary(spans, trace_id=args.trace)


def _cmd_cluster(args: argparse.Namespace) -> int:
    from phalanx import cluster
    from phalanx.telemetry import setup_logging

    setup_logging("phalanx-cluster", level="CRITICAL")  # the one-line error below says it all
    prog = f"phalanx cluster {args.what}"
    try:
        if args.what == "offer":
            rec = asyncio.run(cluster.offer(args.slots, args.node, cluster=args.cluster))
            node = rec.state.node(args.node)
            print(
                f"cluster {args.cluster}: node {args.node} offers {node.slots if node else 0} slot(s) "
                f"(+{args.slots}), {rec.state.available_slots} in all (revision {rec.revision})"
            )
        elif args.what == "reclaim":
            grace = cluster.parse_grace(args.grace)
            rec = asyncio.run(cluster.reclaim(args.node, grace, cluster=args.cluster))
            notice = rec.preemption.id if rec.preemption else "?"
            print(
                f"cluster {args.cluster}: node {args.node} reclaimed, its workers must leave within "
                f"{grace:g} s (preemption {notice}, revision {rec.revision})"
            )
        else:
            rec = asyncio.run(cluster.read(args.cluster))
            print(rec.state.model_dump_json(indent=2) if args.json else cluster.describe(rec))
    except cluster.BadInput as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except cluster.ClusterError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="phalanx", description="Fault tolerance and elasticity for PyTorch training."
    )
    sub = p.add_subparsers(dest="command", required=True)
    n = sub.add_parser("nats", help="run an embedded nats-server with JetStream")
    n.add_argument("--port", type=int, default=4222)
    n.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (the one other nodes reach, for several)"
    )
    n.add_argument("--store", default=".phalanx/nats")
    n.set_defaults(fn=_cmd_nats)
    s = sub.add_parser("service", help="run one service")
    s.add_argument("name", choices=sorted(SERVICES))
    s.set_defaults(fn=_cmd_service)
    r = sub.add_parser("run", help="launch this node's ranks and hot spares for a training script")
    r.add_argument(
        "--nproc", "--nproc-per-node", dest="nproc", type=int, required=True, help="ranks on this node"
    )
    r.add_argument(
        "--spares", "--spares-per-node", dest="spares", type=int, default=0, help="hot spares on this node"
    )
    r.add_argument(
        "--nnodes", default="1", help="MIN[:MAX] nodes; the job starts when MIN have joined (default 1)"
    )
    r.add_argument("--node-id", help="this node's name in the job, unique per node (needed when MAX > 1)")
    r.add_argument(
        "--rdzv-endpoint",
        help="HOST:PORT of the NATS server the nodes meet through (default: NATS_URL)",
    )
    r.add_argument("--bind", help="address the store and gloo listen on (default: the one that reaches NATS)")
    r.add_argument("--job", default=os.environ.get("PHALANX_JOB"), help="the job's name (same on every node)")
    r.add_argument("--global-batch", type=int, default=32, help="samples per optimizer step, whole job")
    r.add_argument("--min-nproc", type=int, help="smallest world a shrink may leave (default: no shrink)")
    r.add_argument(
        "--max-nproc",
        type=int,
        default=0,
        help="largest world (ranks, whole job) a grow may reach (default: the starting world)",
    )
    r.add_argument("--sizes", help="allowed world sizes, e.g. 2,4,8 (default: any from min to max)")
    r.add_argument("--size-step", type=int, default=1, help="world sizes must be multiples of this")
    r.add_argument("--cooldown", default="10s", help="no grow sooner than this after a change (e.g. 30s)")
    r.add_argument("--grace", default="30s", help="time leaving ranks get when a notice gives none")
    r.add_argument("--micro-batch", type=int, default=0, help="samples per forward of one replica")
    r.add_argument(
        "--max-accum",
        type=int,
        default=0,
        help="most micro-batches per replica per step (memory/time cap; 0: none)",
    )
    r.add_argument(
        "--lr-rule",
        choices=["none", "linear", "sqrt"],
        default="none",
        help="learning-rate rule when the global batch cannot be held",
    )
    r.add_argument(
        "--no-auto-grow",
        dest="auto_grow",
        action="store_false",
        help="never grow on the planner's own initiative; only a policy's proposals grow the job",
    )
    r.add_argument("--log-dir", help="write each worker's output to DIR/<worker>.log")
    r.add_argument(
        "--join-timeout", type=float, default=10.0, help="seconds to wait for the planner's answer"
    )
    r.add_argument("--timeout", type=float, help="give up after this many seconds")
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    r.set_defaults(fn=_cmd_run)
    t = sub.add_parser("trace", help="inspect recovery traces")
    tsub = t.add_subparsers(dest="what", required=True)
    ts = tsub.add_parser("summary", help="phase table of the latest (or a chosen) incident")
    ts.add_argument("--trace", help="trace id (default: the latest incident)")
    ts.add_argument("--spans", default=os.environ.get("PHALANX_SPAN_FILE", ".phalanx/spans.jsonl"))
    ts.add_argument(
        "--jaeger",
        default=os.environ.get("PHALANX_JAEGER_URL"),
        help="Jaeger query base URL, e.g. http://localhost:16686",
    )
    ts.set_defaults(fn=_cmd_trace)
    c = sub.add_parser(
        "cluster", help="drive the local cluster: offer worker slots on a node, reclaim a node, show it"
    )
    csub = c.add_subparsers(dest="what", required=True)
    co = csub.add_parser("offer", help="offer N more worker slots on a node (beyond what its launchers run)")
    co.add_argument("slots", type=int, metavar="N", help="how many more slots (>= 1)")
    co.add_argument("--node", required=True, help="the node offering them (its launcher's --node-id)")
    cr = csub.add_parser("reclaim", help="take a node back: it offers nothing, its workers must leave")
    cr.add_argument("node", help="the node to take back (its launcher's --node-id)")
    cr.add_argument(
        "--grace",
        default="30s",
        help="time its workers get to leave: 10s, 500ms, 2m or seconds (default 30s)",
    )
    cs = csub.add_parser("show", help="print the cluster's nodes, slots and preemptions")
    cs.add_argument("--json", action="store_true", help="the record as stored (JSON) instead of a table")
    for cp in (co, cr, cs):
        cp.add_argument(
            "--cluster", default="local", help="the cluster's name, its key in the phalanx_cluster bucket"
        )
        cp.set_defaults(fn=_cmd_cluster)
    args = p.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())

"""The ``phalanx`` command.

phalanx nats [--port P] [--store DIR]              run an embedded nats-server
phalanx service NAME                               run one service (failure-detector, ...)
phalanx run --nproc N [--spares K] [--job J] -- python train.py ...
phalanx trace summary [--trace ID] [--spans FILE] [--jaeger URL]
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
    srv = NatsServer(port=args.port, store_dir=args.store).start()
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


def _cmd_run(args: argparse.Namespace) -> int:
    from phalanx.runtime.launcher import LaunchConfig, run
    from phalanx.telemetry import setup_logging, setup_tracing, shutdown_tracing

    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not cmd:
        print("phalanx run: give the command after --", file=sys.stderr)
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
        max_nproc=args.max_nproc,
        log_dir=Path(args.log_dir) if args.log_dir else None,
    )
    try:
        return asyncio.run(run(config, args.timeout))
    finally:
        shutdown_tracing()


def _cmd_trace(args: argparse.Namespace) -> int:
    from phalanx.tracesummary import load_spans, print_summary

    spans = load_spans(spans_file=args.spans, jaeger_url=args.jaeger, trace_id=args.trace)
    return print_summary(spans, trace_id=args.trace)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="phalanx", description="Fault tolerance and elasticity for PyTorch training."
    )
    sub = p.add_subparsers(dest="command", required=True)
    n = sub.add_parser("nats", help="run an embedded nats-server with JetStream")
    n.add_argument("--port", type=int, default=4222)
    n.add_argument("--store", default=".phalanx/nats")
    n.set_defaults(fn=_cmd_nats)
    s = sub.add_parser("service", help="run one service")
    s.add_argument("name", choices=sorted(SERVICES))
    s.set_defaults(fn=_cmd_service)
    r = sub.add_parser("run", help="launch ranks and hot spares for a training script")
    r.add_argument("--nproc", type=int, required=True)
    r.add_argument("--spares", type=int, default=0)
    r.add_argument("--job", default=os.environ.get("PHALANX_JOB"))
    r.add_argument("--global-batch", type=int, default=32)
    r.add_argument("--min-nproc", type=int)
    r.add_argument("--max-nproc", type=int)
    r.add_argument("--log-dir")
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
    args = p.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())

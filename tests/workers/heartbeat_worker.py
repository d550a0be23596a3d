"""A stand-in training rank for detector tests and ``bench.detect``: real process,
real heartbeats, no torch.

A training thread alternates COMPUTE and COLLECTIVE for ``--step-ms`` per step
(sleeping: the heartbeat loop does not depend on the GIL being free of compute),
while the asyncio loop publishes heartbeats with
:class:`phalanx.worker.heartbeat.HeartbeatPublisher` from a shared
:class:`phalanx.worker.status.RankStatus`, like a real rank's bus thread.

- ``--stall-after N``: after N steps the training thread blocks forever in
  ``--stall-phase`` (``compute``: a stalled rank; ``collective``: a victim waiting
  on it), while heartbeats go on;
- ``PHALANX_FAULTS`` (:mod:`phalanx.runtime.faults`, point ``step=N``) fires in
  COMPUTE, before the step's collective: ``stall:w3@step=10`` stalls w3 there;
- ``--idle``: a hot spare (rank -1, phase IDLE);
- SIGSTOP freezes everything (heartbeats stop); SIGTERM exits 0;
- with ``PHALANX_HEARTBEAT_SOCKET`` set (a launcher's, or a test's
  :class:`~phalanx.worker.digest.NodeDigestPublisher`) heartbeats go to that unix
  socket and reach the detector in the node's digest, as under ``phalanx run``.

Prints ``ready <pid>`` once its first heartbeat is out. Job and worker default to
the launcher's ``PHALANX_JOB``/``PHALANX_WORKER``/``PHALANX_ROLE``.

    python tests/workers/heartbeat_worker.py --job j1 --worker w0 --rank 0 --interval-ms 100
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import threading
import time

from phalanx.bus import Bus
from phalanx.contract import Phase
from phalanx.runtime.faults import FaultPlan
from phalanx.worker.heartbeat import HeartbeatPublisher
from phalanx.worker.status import RankStatus


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="NATS URL (default: NATS_URL)")
    p.add_argument("--job", default=os.environ.get("PHALANX_JOB", "j1"))
    p.add_argument("--worker", default=os.environ.get("PHALANX_WORKER", "w0"))
    p.add_argument("--rank", type=int, default=None, help="default: from the worker name, -1 for a spare")
    p.add_argument("--generation", type=int, default=1)
    p.add_argument("--interval-ms", type=float, default=None, help="default: PHALANX_HEARTBEAT_MS")
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--stall-after", type=int, default=None, metavar="N")
    p.add_argument("--stall-phase", choices=["compute", "collective"], default="compute")
    p.add_argument("--idle", action="store_true", help="a hot spare")
    args = p.parse_args()
    spare = args.idle or os.environ.get("PHALANX_ROLE") == "spare"
    args.idle = spare
    if args.rank is None:
        m = re.search(r"(\d+)$", args.worker)
        args.rank = -1 if spare or m is None else int(m.group(1))
    return args


def train(status: RankStatus, args: argparse.Namespace, stop: threading.Event) -> None:
    step_s = args.step_ms / 1e3
    faults = FaultPlan.from_env()
    while not stop.is_set():
        if args.stall_after is not None and status.step >= args.stall_after:
            status.enter(Phase(args.stall_phase))
            stop.wait()  # stuck: never finishes the step
            return
        t0 = time.monotonic()
        status.enter(Phase.COMPUTE)
        time.sleep(step_s * 0.8)
        faults.fire(status.worker, "step", status.step)
        status.enter(Phase.COLLECTIVE)
        time.sleep(step_s * 0.2)
        status.step_ms = (time.monotonic() - t0) * 1e3
        status.step += 1


async def main() -> None:
    args = parse()
    bus = await Bus.connect(args.url, name=f"worker-{args.job}-{args.worker}", ensure=False)
    status = RankStatus(
        job=args.job, worker=args.worker, rank=args.rank, generation=0 if args.idle else args.generation
    )
    interval = args.interval_ms / 1e3 if args.interval_ms else None
    hb = HeartbeatPublisher(bus, status, interval)
    stop = threading.Event()
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    if args.idle:
        status.enter(Phase.IDLE)
    else:
        threading.Thread(target=train, args=(status, args, stop), daemon=True, name="train").start()
    beating = asyncio.create_task(hb.run())
    while hb.seq == 0 and not beating.done():
        await asyncio.sleep(0.005)
    print(f"ready {os.getpid()}", flush=True)
    await done.wait()
    stop.set()
    beating.cancel()
    await bus.close()


if __name__ == "__main__":
    asyncio.run(main())

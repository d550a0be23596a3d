"""A rank's credentials turned against the bus: publish as fast as possible, for a
bounded time, on every subject the user may publish to (tests/e2e/test_flood.py).

Logs in as ``PHALANX_NATS_USER`` / ``PHALANX_NATS_PASSWORD``, subscribes to the
job's plans (``phalanx.cmd.<job>.plan``, which that user may read), first asks the
server for ``--consumers`` durable consumers on the jobs bucket, filtered to its own
job's plan key, under names of its choosing (what once used up the stream's consumer
limit for every job and the planner), counts what the server granted, then touches
``<out>.ready`` and at once cycles through the subjects of ``--subjects`` (JSON: the user's publish allow list, with
its deny list to skip; a wildcard token becomes ``flood``) with payloads up to each
limit: just under PHALANX_EVT's ``max_msg_size`` and just under the server's
``max_payload`` (the stream refuses those, core subscribers get them). Stops after
``--seconds`` by itself and writes what it did as JSON to ``--out``: its window
(wall clock), messages and bytes sent (and how many bytes by when), and when it saw
each generation's plan.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import time
from collections import Counter
from pathlib import Path

import nats
from nats.aio.msg import Msg

from phalanx.contract import Plan
from phalanx.contract.codec import decode
from phalanx.contract.permissions import JS_API, KV_STREAM, inbox_prefix
from phalanx.contract.proto import subject_matches as matches
from phalanx.contract.streams import JOBS_BUCKET


def targets(allow: list[str], deny: list[str]) -> list[str]:
    """One concrete subject per allowed pattern, none that a deny pattern refuses."""
    out = []
    for pattern in allow:
        subject = ".".join("flood" if t in ("*", ">") else t for t in pattern.split("."))
        if not any(matches(d, subject) for d in deny):
            out.append(subject)
    return list(dict.fromkeys(out))


async def fill_consumers(nc: nats.NATS, job: str, n: int, timeout_s: float = 5.0) -> dict[str, int]:
    """Ask for ``n`` durable pull consumers on the jobs bucket's stream at once, half by
    ``CONSUMER.CREATE`` and half by ``DURABLE.CREATE``: how many the server ``created``,
    answered with an ``error``, or left unanswered (``refused``: no permission)."""
    key = f"$KV.{JOBS_BUCKET}.{job}.plan"

    async def one(i: int) -> str:
        name = f"fill{i}_{secrets.token_hex(4)}"
        config = {
            "durable_name": name,
            "filter_subject": key,
            "ack_policy": "explicit",
            "deliver_policy": "last",
        }
        subject = (
            f"{JS_API}.CONSUMER.CREATE.{KV_STREAM}.{name}.{key}"
            if i % 2
            else f"{JS_API}.CONSUMER.DURABLE.CREATE.{KV_STREAM}.{name}"
        )
        request = {"stream_name": KV_STREAM, "config": config, "action": "create"}
        try:
            answer = await nc.request(subject, json.dumps(request).encode(), timeout=timeout_s)
        except nats.errors.TimeoutError:
            return "refused"
        return "error" if "error" in json.loads(answer.data) else "created"

    return dict(Counter(await asyncio.gather(*(one(i) for i in range(n)))))


async def flood(args: argparse.Namespace) -> dict[str, object]:
    user = os.environ["PHALANX_NATS_USER"]
    nc = await nats.connect(
        args.url,
        user=user,
        password=os.environ["PHALANX_NATS_PASSWORD"],
        inbox_prefix=inbox_prefix(user),
        name=f"flooder-{user}",
        pending_size=64 << 20,
    )
    perms = json.loads(args.subjects)
    subjects = targets(perms["allow"], perms.get("deny", []))
    plans: dict[int, float] = {}

    async def on_plan(raw: Msg) -> None:
        try:
            plan = decode(raw.data, raw.headers, Plan)
        except Exception:
            return
        plans.setdefault(plan.generation, time.time())

    await nc.subscribe(f"phalanx.cmd.{args.job}.plan", cb=on_plan)
    await nc.flush()
    consumers = await fill_consumers(nc, args.job, args.consumers) if args.consumers else {}
    Path(args.out).with_suffix(".ready").touch()
    payloads = [os.urandom(args.event_size), os.urandom(nc.max_payload - 4096)]
    sent = size = 0
    progress: list[tuple[float, int]] = []  # (wall time, bytes sent by then)
    start = time.time()
    stop = time.monotonic() + args.seconds
    while time.monotonic() < stop:
        for subject in subjects:
            payload = payloads[sent % len(payloads)]
            await nc.publish(subject, payload)
            sent += 1
            size += len(payload)
        if sent % 256 < len(subjects):
            await nc.flush(timeout=30)
            progress.append((time.time(), size))
    end = time.time()
    await nc.drain()
    return {
        "start": start,
        "end": end,
        "sent": sent,
        "bytes": size,
        "progress": progress,
        "subjects": subjects,
        "plans": plans,
        "consumers": consumers,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--subjects", required=True, help='{"allow": [...], "deny": [...]}')
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--event-size", type=int, default=(64 << 10) - 256)
    p.add_argument("--consumers", type=int, default=0, help="durable consumers to ask for first")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    report = asyncio.run(flood(args))
    Path(args.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()

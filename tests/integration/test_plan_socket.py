"""The node's plan over the local socket (phalanx.worker.plansocket, phalanx.launcher.handout):
a worker takes its part from its launcher only; the launcher sends it again to a worker
whose heartbeat is behind, and acknowledges the node's members once they hold it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from phalanx.contract import Heartbeat, NodeAck, NodePlan, Phase, encode
from phalanx.launcher.handout import Handout
from phalanx.worker.plansocket import PlanInbox

JOB = "sj"


def _part(generation: int) -> NodePlan:
    return NodePlan(
        job=JOB,
        generation=generation,
        world_size=4,
        store_prefix=f"{JOB}/gen{generation}",
        node="n1",
        ranks={"n1-w0": 0, "n1-w1": 1},
    )


def _hb(worker: str, plan: int) -> Heartbeat:
    return Heartbeat(
        job=JOB,
        worker=worker,
        rank=0,
        generation=0,
        step=0,
        step_ms=0,
        phase=Phase.COMPUTE,
        phase_ms=0,
        seq=0,
        pid=1,
        host="h",
        interval_ms=100,
        plan=plan,
    )


async def _until(pred: object, what: str) -> None:
    for _ in range(500):
        if pred():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_the_launcher_hands_out_resends_and_acknowledges(tmp_path: Path) -> None:
    acks: list[NodeAck] = []

    async def publish(ack: NodeAck) -> None:
        await asyncio.sleep(0.05)  # a publish takes a while: members that catch up meanwhile come next
        acks.append(ack)

    handout = Handout(JOB, "n1", tmp_path, publish, resend_s=0.0)
    got: dict[str, list[int]] = {"n1-w0": [], "n1-w1": []}
    inboxes = [
        PlanInbox(
            handout.path_of(w),
            lambda p, w=w: got[w].append(p.generation),
            launcher_pid=os.getpid(),
        )
        for w in got
    ]
    try:
        inboxes[0].start()  # n1-w1 has not started yet
        handout.hand_out(_part(2), list(got))
        await _until(lambda: got["n1-w0"] == [2], "w0 gets generation 2")
        assert got["n1-w1"] == []
        inboxes[1].start()
        handout.heard(_hb("n1-w1", 0))  # its first heartbeat: behind, so the plan goes again
        await _until(lambda: got["n1-w1"] == [2], "w1 gets it on its heartbeat")
        handout.heard(_hb("n1-w0", 2))
        await asyncio.sleep(0.01)  # its acknowledgement is on its way
        handout.heard(_hb("n1-w1", 2))
        await _until(lambda: len(acks) == 2, "the second member, in the next acknowledgement")
        assert acks[0].workers == ["n1-w0"]
        assert acks[-1].workers == ["n1-w0", "n1-w1"] and acks[-1].generation == 2
        handout.hand_out(_part(2), list(got), resend=True)  # the planner did not hear: say it again
        await _until(lambda: len(acks) == 3, "acknowledged again")
        assert acks[-1].workers == ["n1-w0", "n1-w1"]
    finally:
        for inbox in inboxes:
            inbox.stop()
        handout.close()


async def test_a_worker_refuses_a_plan_from_anyone_but_its_launcher(tmp_path: Path) -> None:
    got: list[NodePlan] = []
    path = tmp_path / "w.plan"
    inbox = PlanInbox(str(path), got.append)  # its launcher: this test's parent process
    inbox.start()
    try:
        payload, _ = encode(_part(9))
        forger = (
            "import socket,sys; s=socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM);"
            f"s.sendto(bytes.fromhex('{payload.hex()}'), {str(path)!r})"
        )
        subprocess.run([sys.executable, "-c", forger], check=True)
        await _until(lambda: inbox.refused == 1, "the forged plan refused")
        assert got == [] and inbox.received == 0
    finally:
        inbox.stop()

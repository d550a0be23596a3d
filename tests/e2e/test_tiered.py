"""Tiered checkpoints with real keeper processes (state-replication), killed with SIGKILL:
a keeper killed in the middle of a drain to the object store (a real S3 server), and a
whole two-node job killed and relaunched on the namespace cluster, which resumes from
the newest complete checkpoint with the weights it would have had."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch
from nats.aio.msg import Msg

from examples.train_gpt import command as train_command
from phalanx.bus import Bus
from phalanx.checkpoint import Checkpointer
from phalanx.checkpoint.catalog import Catalog
from phalanx.checkpoint.tiers import ObjectTier
from phalanx.contract import CheckpointEvent, decode
from phalanx.contract.subjects import CHECKPOINT
from phalanx.devstack.jobwatch import last_logged_step
from phalanx.devstack.localstack import LocalStack
from phalanx.devstack.s3server import S3Server
from tests.e2e.conftest import SMALL_GPT, netns_cluster, stack_env

pytestmark = pytest.mark.slow


class Events:
    def __init__(self) -> None:
        self.seen: list[CheckpointEvent] = []

    async def on_msg(self, raw: Msg) -> None:
        self.seen.append(decode(raw.data, raw.headers, CheckpointEvent))

    async def wait(self, tier: str, state: str, timeout_s: float) -> CheckpointEvent:
        deadline = time.monotonic() + timeout_s
        while True:
            for e in self.seen:
                if (e.tier, e.state) == (tier, state):
                    return e
            if time.monotonic() > deadline:
                raise AssertionError(f"no {tier} {state} event in {timeout_s}s: {self.seen}")
            await asyncio.sleep(0.02)


def test_a_keeper_killed_mid_drain_lists_nothing_partial_and_the_drain_resumes(
    tmp_path: Path,
    s3_server: S3Server,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k, v in s3_server.env().items():  # this process reads the bucket too
        monkeypatch.setenv(k, v)
    bucket = f"mid-{uuid.uuid4().hex[:8]}"
    s3_server.create_bucket(bucket)
    tiers = {
        **s3_server.env(),
        "PHALANX_CKPT_DISK": str(tmp_path / "disk"),
        "PHALANX_CKPT_SHARED": str(tmp_path / "shared"),
        "PHALANX_CKPT_OBJECT": f"s3://{bucket}/ckpt",
        "PHALANX_CKPT_REPLICAS": "0",
    }
    job = "midj"
    state = {"w": torch.arange(48 << 20, dtype=torch.float32)}  # 192 MiB
    # The object lane drains beside disk and shared, from the memory copy at once: unpaced,
    # moto took the whole upload before the shared copy was complete (CI). Paced at 16 MB/s
    # the first keeper's upload lasts at least 12 s, so the kill below lands in it.
    paced = {**tiers, "PHALANX_CKPT_RATE": "object=16M"}
    with LocalStack(tmp_path / "stack", services=(), env=stack_env(tmp_path_factory)) as stack:
        key = stack.start_keeper("n1", paced)

        async def scenario() -> None:
            bus = await Bus.connect(stack.url, name="test")
            events = Events()
            await bus.nc.subscribe(CHECKPOINT.format(job=job), cb=events.on_msg)
            try:
                rank = Checkpointer(job, node="n1", root=stack.shm_root)
                saved = time.monotonic()
                assert rank.save(state, 12) is not None
                await events.wait("shared", "complete", 30)
                await asyncio.sleep(0.3)
                print(f"keeper killed {time.monotonic() - saved:.1f}s after the save (upload >= 12 s)")
                stack.procs[key].send_signal(signal.SIGKILL)
                stack.procs[key].wait(10)
                obj = ObjectTier(f"s3://{bucket}/ckpt", endpoint=s3_server.endpoint)
                assert obj.manifests(job) == []  # nothing partial is listed
                entries = await (await Catalog.open(bus)).entries(job)
                assert "object" not in entries[12].tiers()
                assert not any(e.tier == "object" and e.state == "complete" for e in events.seen)

                stack.start_keeper("n1", tiers)  # adopts the held slot and its disk copy
                await events.wait("object", "complete", 90)
                (m,) = obj.manifests(job)
                assert m.step == 12 and obj.damage(m) == []
                infos = await asyncio.to_thread(rank.list)
                assert infos[0].step == 12 and infos[0].tiers["object"] == ["-"]
            finally:
                await bus.close()

        asyncio.run(scenario())


def test_a_whole_job_killed_and_relaunched_resumes_from_the_newest_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, corpus: Path
) -> None:
    work = tmp_path_factory.mktemp("relaunch")
    steps, every = 16, 6
    nodes = {"a": (2, 0), "b": (2, 0)}
    tiers = {"PHALANX_CKPT_DISK": str(work / "disk"), "PHALANX_CKPT_SHARED": str(work / "shared")}
    with (
        netns_cluster(["ctl", "a", "b"]) as cl,
        LocalStack(
            work / "stack",
            cluster=cl,
            services=("failure-detector", "elasticity-planner"),
            # every node dies at once: no holding the verdict back for a mass silence
            env={**stack_env(tmp_path_factory), "PHALANX_DETECTOR_MASS_HOLD_S": "0"},
        ) as stack,
    ):
        keepers = {node: stack.start_keeper(node, tiers) for node in nodes}

        # The job checkpoints every 6 steps; after step 7, once checkpoint 6 has its
        # replica, both nodes die, keepers too (5 steps before the next checkpoint: a
        # loaded machine that is slow to see the replica still kills before step 12). (The relaunch runs the same command: the
        # job's spec pins it.)
        log, out = work / "steps.jsonl", work / "relaunched.pt"
        cmd = train_command(
            steps, corpus, *SMALL_GPT, "--checkpoint-every", str(every), save=out, steps_log=log
        )
        lister = Checkpointer("rj", node="a", root=stack.shm_root)

        def replicated(step: int) -> bool:
            return any(i.step == step and len(i.tiers.get("memory", ())) == 2 for i in lister.list())

        killed = stack.run_nodes(
            "rj",
            cmd,
            nodes=nodes,
            steps_log=log,
            actions=[
                (
                    lambda r: last_logged_step(log) >= 7 and replicated(6),
                    lambda r: [cl.kill_node(n) for n in nodes],
                )
            ],
        )
        assert not out.exists(), "the first run must not have finished"
        assert stack.wait_ended("rj").action.value == "stop"  # its nodes were declared lost
        logged = log.read_text().splitlines()
        first = {int(s["step"]): s["loss"] for s in map(json.loads, logged)}

        # The nodes come back; their keepers re-adopt the slots, replicas and disk copies.
        keepers = {node: stack.start_keeper(node, tiers) for node in nodes}
        newest = Checkpointer("rj", node="a", root=stack.shm_root).latest()
        assert newest is not None and newest.step >= 6 and newest.step % every == 0, killed
        assert newest.step < max(first)
        origin = newest.origin
        (replica,) = set(newest.tiers["memory"]) - {origin}
        # The node that took it is lost after all: its memory and disk are gone.
        stack.procs[keepers[origin]].kill()
        stack.procs[keepers[origin]].wait()
        shutil.rmtree(stack.shm_root / origin, ignore_errors=True)
        shutil.rmtree(work / "disk" / origin, ignore_errors=True)
        stack.start_keeper(origin, tiers)  # comes back empty, and tells the catalog
        now = Checkpointer("rj", node=replica, root=stack.shm_root).latest()
        assert now is not None and now.step == newest.step and now.tiers["memory"] == [replica], now.tiers

        # Relaunched: nobody holds state, so rank 0 restores the newest checkpoint from the
        # replica (its own memory when rank 0 is on the replica's node, a peer otherwise).
        second = stack.run_nodes("rj", cmd, nodes=nodes)
        assert second.returncode == 0, second
        again = {
            int(s["step"]): s["loss"] for s in map(json.loads, log.read_text().splitlines()[len(logged) :])
        }
        assert min(again) == newest.step + 1 and max(again) == steps and out.exists()  # not from step 0
        # The steps both runs did after the checkpoint have bitwise the same losses: the job
        # resumed with the checkpoint's weights, optimizer state, data position and RNG.
        overlap = sorted(set(first) & set(again))
        assert overlap and overlap[0] == newest.step + 1, (sorted(first), sorted(again))
        assert [again[k] for k in overlap] == [first[k] for k in overlap]

        spans = [json.loads(line) for line in stack.span_file.read_text().splitlines() if line.strip()]
        served = {
            (s["name"], (s.get("attributes") or {}).get("phalanx.checkpoint.tier"))
            for s in spans
            if (s.get("attributes") or {}).get("phalanx.checkpoint.tier") not in (None, "", "none")
        }
        assert served and {tier for _, tier in served} <= {"memory", "peer"}, served  # never the shared tier

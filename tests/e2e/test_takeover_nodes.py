"""Drain takeover on the namespace cluster: the node that took a snapshot is killed
(every process of it, SIGKILL) after its replicas are complete and before its object
copy is; a keeper holding a replica finishes the object copy, exactly once, and the
catalog says which one did. Real keeper processes, nats-server and an S3 server (moto)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import torch
from nats.aio.msg import Msg

from phalanx.bus import Bus
from phalanx.checkpoint import Checkpointer
from phalanx.checkpoint.catalog import DONE, Catalog, Entry
from phalanx.checkpoint.tiers import ObjectTier, Tier
from phalanx.contract import CheckpointEvent, decode
from phalanx.contract.subjects import CHECKPOINT
from phalanx.devstack.localstack import LocalStack
from phalanx.devstack.s3server import S3Server
from tests.e2e.conftest import netns_cluster, stack_env

pytestmark = pytest.mark.slow

JOB = "tkj"
STEP = 12


class Events:
    def __init__(self) -> None:
        self.seen: list[CheckpointEvent] = []

    async def on_msg(self, raw: Msg) -> None:
        self.seen.append(decode(raw.data, raw.headers, CheckpointEvent))

    def of(self, tier: str, state: str = "complete") -> list[CheckpointEvent]:
        return [e for e in self.seen if (e.tier, e.state) == (tier, state)]

    async def wait(self, tier: str, count: int, timeout_s: float) -> list[CheckpointEvent]:
        deadline = time.monotonic() + timeout_s
        while len(got := self.of(tier)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} complete {tier} copies not within {timeout_s}s: {self.seen}")
            await asyncio.sleep(0.02)
        return got


async def settled(catalog: Catalog, timeout_s: float) -> Entry:
    """The checkpoint's catalog entry once its takeover claim is done."""
    deadline = time.monotonic() + timeout_s
    while True:
        e = (await catalog.entries(JOB))[STEP]
        if e.takeover is not None and e.takeover.state == DONE:
            return e
        if time.monotonic() > deadline:
            raise AssertionError(f"no done takeover claim within {timeout_s}s: {e}")
        await asyncio.sleep(0.1)


def test_a_node_killed_mid_drain_has_its_object_copy_finished_by_one_replica_holder(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path_factory.mktemp("takeover")
    # 256 MiB: replicated to two peers in about a second, seconds of upload to moto.
    state = {"w": torch.arange(64 << 20, dtype=torch.float32)}
    with (
        netns_cluster(["ctl", "a", "b", "c"]) as cl,
        S3Server(host=cl.host_ip) as s3,  # on the bridge: every node reaches it
        LocalStack(work / "stack", cluster=cl, services=(), env=stack_env(tmp_path_factory)) as stack,
    ):
        for k, v in s3.env().items():  # this process reads the bucket too
            monkeypatch.setenv(k, v)
        bucket = f"tk-{uuid.uuid4().hex[:8]}"
        s3.create_bucket(bucket)
        tiers = {
            **s3.env(),
            "PHALANX_CKPT_DISK": str(work / "disk"),
            "PHALANX_CKPT_SHARED": str(work / "shared"),
            "PHALANX_CKPT_OBJECT": f"s3://{bucket}/ckpt",
            "PHALANX_CKPT_REPLICAS": "2",  # b and c both hold it: both may race for the drain
            "PHALANX_CKPT_FSYNC": "0",
            "PHALANX_KEEPER_REFRESH_S": "0.5",
            "PHALANX_KEEPER_LOST_AFTER_S": "3",
        }
        for node in ("a", "b", "c"):
            stack.start_keeper(node, tiers)

        async def scenario() -> None:
            bus = await Bus.connect(stack.url, name="test")
            events = Events()
            await bus.nc.subscribe(CHECKPOINT.format(job=JOB), cb=events.on_msg)
            try:
                catalog = await Catalog.open(bus)
                rank = Checkpointer(JOB, node="a", root=stack.shm_root)
                assert await asyncio.to_thread(rank.save, state, STEP) is not None
                deadline = time.monotonic() + 60
                while {e.node for e in events.of("memory")} != {"a", "b", "c"}:
                    assert time.monotonic() < deadline, f"no replicas on b and c: {events.seen}"
                    await asyncio.sleep(0.01)
                # Mid-drain, checked through the catalog: the replicas are complete, the
                # object copy is not.
                assert "object" not in (await catalog.entries(JOB))[STEP].tiers(), (
                    "the object drain finished before the replicas: make the state larger"
                )
                cl.kill_node("a")
                assert not events.of("object"), "the object copy completed as the node was killed"

                (done,) = await events.wait("object", 1, 120)
                assert done.node in ("b", "c") and done.detail == "drain taken over from a"
                e = await settled(catalog, 30)
                assert e.takeover is not None and (e.takeover.node, e.takeover.origin) == (done.node, "a")
                (obj,) = [c for c in e.complete() if c.tier is Tier.OBJECT]
                assert obj.by == done.node  # the catalog names who drained it
                await asyncio.sleep(3.0)  # six refresh periods: the other holder had its turns
                assert len(events.of("object")) == 1, events.of("object")  # exactly once
                assert len(events.of("shared")) == 1, events.of("shared")  # by a, or by the taker

                store = ObjectTier(f"s3://{bucket}/ckpt", endpoint=s3.endpoint)
                (m,) = store.manifests(JOB)
                assert (m.step, m.origin) == (STEP, "a") and store.damage(m) == []
                infos = await asyncio.to_thread(Checkpointer(JOB, node=done.node, root=stack.shm_root).list)
                assert infos[0].step == STEP and infos[0].tiers["object"] == ["-"]
            finally:
                await bus.close()

        asyncio.run(scenario())

"""``phalanx cluster offer / reclaim / show`` against a real nats-server, and the real
scheduler-signal service turning the record into CapacityChanged / PreemptionNotice.

The CLI runs as a subprocess (``python -m phalanx.cli cluster ...``, NATS_URL in its
environment); what the service published is read back from the PHALANX_SCHED stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError
from phalanx.services.scheduler_signal.local import KvClusterSource
from phalanx.services.scheduler_signal.service import SchedulerSignal

from phalanx import cluster
from phalanx.bus import Bus
from phalanx.contract import CapacityChanged, Message, PreemptionNotice, decode
from phalanx.contract.streams import SCHED
from phalanx.devstack.natsserver import NatsServer, free_port
from phalanx.natsauth import NatsAuth

WAIT_S = 10.0


async def wait_for(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.02)


@dataclass
class Run:
    rc: int
    out: str
    err: str
    took_s: float


async def phalanx_cluster(url: str, *args: str, env: dict[str, str] | None = None) -> Run:
    """``phalanx cluster ARGS`` as a subprocess, without blocking the event loop."""
    full = {**os.environ, "NATS_URL": url, **(env or {})}
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "phalanx.cli",
        "cluster",
        *args,
        env=full,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return Run(proc.returncode, out.decode(), err.decode(), time.monotonic() - t0)


async def published(bus: Bus, cluster_name: str = "local") -> list[tuple[Message, str]]:
    """Every signal stored for ``cluster_name``, in order, with its Nats-Msg-Id."""
    out: list[tuple[Message, str]] = []
    seq = 1
    while True:
        try:
            raw = await bus.js.get_msg(
                SCHED.name, seq=seq, subject=f"phalanx.sched.{cluster_name}.>", next=True
            )
        except NotFoundError:
            return out
        kind = CapacityChanged if (raw.subject or "").endswith(".capacity") else PreemptionNotice
        out.append((decode(raw.data or b"", raw.headers, kind), (raw.headers or {}).get("Nats-Msg-Id", "")))
        seq = (raw.seq or seq) + 1


@pytest.fixture
def local_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """scheduler-signal from the environment sees the local cluster only."""
    for var in ("PHALANX_CLUSTER_FILE", "PHALANX_K8S", "KUBERNETES_SERVICE_HOST", "PHALANX_LOCAL_CLUSTER"):
        monkeypatch.delenv(var, raising=False)


@contextlib.asynccontextmanager
async def scheduler_signal(url: str) -> AsyncIterator[tuple[SchedulerSignal, KvClusterSource]]:
    """The real service, sources from the environment, until its watch has read the bucket."""
    bus = await Bus.connect(url, name="scheduler-signal")
    svc = SchedulerSignal(bus)
    (src,) = [s for s in svc.sources if isinstance(s, KvClusterSource)]
    await svc.start()
    try:
        await wait_for(lambda: src.synced, "the watch of phalanx_cluster to catch up")
        yield svc, src
    finally:
        await svc.stop()
        await bus.close()


# -- the CLI and the service ------------------------------------------------------------------------
async def test_offer_and_reclaim_become_signals_once(nats_url: str, bus: Bus, local_only: None) -> None:
    async with scheduler_signal(nats_url) as (svc, src):
        assert [s.name for s in svc.sources] == ["local"]
        assert await published(bus) == []  # an empty bucket says nothing

        run = await phalanx_cluster(nats_url, "offer", "2", "--node", "node-b")
        assert run.rc == 0, run.err
        assert "node node-b offers 2 slot(s)" in run.out
        record = await cluster.read(bus=bus)
        assert record.state.offered == {"node-b": 2} and record.revision > 0

        await wait_for(lambda: svc.published["capacity_changed"] == 1, "the capacity of the offer")
        ((cap, cap_id),) = await published(bus)
        assert isinstance(cap, CapacityChanged)
        assert (cap.cluster, cap.available_slots, cap.delta, cap.offered, cap.source) == (
            "local",
            2,
            2,
            {"node-b": 2},
            "local",
        )
        assert cap_id == f"local:capacity:kv{record.revision}"

        run = await phalanx_cluster(nats_url, "reclaim", "node-b", "--grace", "10s")
        assert run.rc == 0, run.err
        assert "reclaim-node-b-1" in run.out
        await wait_for(
            lambda: svc.published == {"capacity_changed": 2, "preemption_notice": 1}, "the reclaim's signals"
        )
        await wait_for(lambda: src.revisions == 2, "both revisions handled")
        signals = await published(bus)
        assert len(signals) == 3
        notices = [m for m, _ in signals if isinstance(m, PreemptionNotice)]
        caps = [m for m, _ in signals if isinstance(m, CapacityChanged)]
        assert len(notices) == 1 and len(caps) == 2
        notice = notices[0]
        assert (notice.cluster, notice.job, notice.workers, notice.nodes) == ("local", None, [], ["node-b"])
        assert (notice.reason, notice.source) == ("reclaim node-b", "local")
        assert 9 < notice.deadline_s <= 10
        assert (caps[1].available_slots, caps[1].delta, caps[1].offered) == (0, -2, {"node-b": 0})
        assert "local:preempt:reclaim-node-b-1" in {i for _, i in signals}

        show = await phalanx_cluster(nats_url, "show")
        assert show.rc == 0 and "node-b" in show.out and "reclaim-node-b-1" in show.out
        as_json = await phalanx_cluster(nats_url, "show", "--json")
        assert as_json.rc == 0
        assert cluster.ClusterState.model_validate_json(as_json.out).offered == {"node-b": 0}

    # A restarted service reads what it published back from the stream: nothing new.
    async with scheduler_signal(nats_url) as (svc2, src2):
        await wait_for(lambda: src2.revisions >= 1, "the record replayed to the new service")
        assert svc2.published == {"capacity_changed": 0, "preemption_notice": 0}
        assert len(await published(bus)) == 3


async def test_racing_offers_all_count(nats_url: str, bus: Bus) -> None:
    runs = asyncio.gather(
        phalanx_cluster(nats_url, "offer", "1", "--node", "node-c"),
        phalanx_cluster(nats_url, "offer", "2", "--node", "node-c"),
    )
    buses = [await Bus.connect(nats_url, name=f"racer-{i}", ensure=False) for i in range(6)]
    try:
        records = await asyncio.gather(*(cluster.offer(3, "node-c", bus=b) for b in buses))
    finally:
        for b in buses:
            await b.close()
    for run in await runs:
        assert run.rc == 0, run.err
    assert len({r.revision for r in records}) == len(records)
    final = await cluster.read(bus=bus)
    assert final.state.offered == {"node-c": 1 + 2 + 6 * 3}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["offer", "0", "--node", "node-b"], "offer at least 1 slot"),
        (["offer", "-3", "--node", "node-b"], "offer at least 1 slot"),
        (["offer", "2", "--node", "bad.name"], "bad node name 'bad.name'"),
        (["offer", "2", "--node", "node-b", "--cluster", "a b"], "bad cluster name"),
        (["offer", "two", "--node", "node-b"], "is not a valid integer"),
        (["reclaim", "node-b", "--grace=-5s"], "negative"),
        (["reclaim", "node-b", "--grace", "soon"], "not a duration"),
        (["reclaim", "x" * 65, "--grace", "1s"], "bad node name"),
    ],
)
async def test_bad_input_exits_2_and_changes_nothing(
    nats_url: str, bus: Bus, args: list[str], says: str
) -> None:
    await cluster.offer(2, "node-b", bus=bus)
    before = await cluster.read(bus=bus)
    run = await phalanx_cluster(nats_url, *args)
    assert run.rc == 2, (run.out, run.err)
    assert says in run.err and run.out == ""
    if not run.err.startswith("usage:"):  # argparse's own errors print the usage first
        assert run.err.count("\n") == 1 and run.err.startswith(f"phalanx cluster {args[0]}: ")
    after = await cluster.read(bus=bus)
    assert after.revision == before.revision and after.state == before.state


async def test_no_nats_server_is_a_clear_error_within_seconds(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    run = await phalanx_cluster(url, "offer", "1", "--node", "node-b")
    assert run.rc == 1
    assert "cannot reach NATS at" in run.err and "phalanx up" in run.err and "NATS_URL" in run.err
    assert run.err.count("\n") == 1 and run.out == ""
    assert run.took_s < 8


# -- NATS authorization: only admin writes the bucket; scheduler-signal watches it ---------------------------
async def test_only_admin_writes_the_cluster_and_the_scheduler_watches_it(
    tmp_path: Path, local_only: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    auth = NatsAuth.generate()
    conf = auth.write_config(tmp_path / "nats.conf")
    server = NatsServer(store_dir=tmp_path / "nats", config_file=conf).start()
    try:
        admin_env = auth.env("admin")
        with monkeypatch.context() as m:
            for k, v in admin_env.items():
                m.setenv(k, v)
            admin = await Bus.connect(server.url, name="admin")  # provisions streams and buckets
        try:
            with monkeypatch.context() as m:
                for k, v in auth.env("scheduler").items():
                    m.setenv(k, v)
                async with scheduler_signal(server.url) as (svc, _):
                    run = await phalanx_cluster(server.url, "offer", "2", "--node", "node-b", env=admin_env)
                    assert run.rc == 0, run.err
                    await wait_for(lambda: svc.published["capacity_changed"] == 1, "the scheduler's signal")
                    ((cap, _),) = await published(admin)
                    assert isinstance(cap, CapacityChanged) and cap.offered == {"node-b": 2}

                    before = await cluster.read(bus=admin)
                    refused = await phalanx_cluster(
                        server.url, "offer", "5", "--node", "node-b", env=auth.env("scheduler")
                    )
                    assert refused.rc == 1
                    assert "refused" in refused.err and "admin" in refused.err
                    after = await cluster.read(bus=admin)
                    assert after.revision == before.revision and after.state.offered == {"node-b": 2}
        finally:
            await admin.close()
    finally:
        server.cleanup()

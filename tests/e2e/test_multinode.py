"""Jobs that span nodes: one ``phalanx run`` per network namespace, NATS and the
services in a namespace of their own, real gloo between the nodes' addresses.

A node loss is ``kill -9`` of every process of its namespace (launcher, ranks and
spares); a partition is its link set down. Every same-size case must end with
weights bitwise equal to the fault-free run of the same world size, and nothing
may hang (each job has a deadline). Skipped, with the reason, where network
namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from examples.train_gpt import command as train_command
from phalanx.contract import Action, Plan
from phalanx.devstack.jobwatch import JobResult
from phalanx.devstack.localstack import LocalStack
from phalanx.devstack.netns import NetnsCluster
from tests.e2e.conftest import SMALL_GPT, STEPS, netns_cluster, stack_env
from tests.e2e.test_recovery import actions, assert_bitwise_equal, story

pytestmark = pytest.mark.slow

NODES = ["ctl", "a", "b", "c"]
# (ranks, spares) per node: world 4 on three nodes, a spare on each.
LAYOUT = {"a": (2, 1), "b": (1, 1), "c": (1, 1)}


@pytest.fixture(scope="module")
def cluster() -> Iterator[NetnsCluster]:
    with netns_cluster(NODES) as cl:
        yield cl


@pytest.fixture(scope="module")
def mstack(cluster: NetnsCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with LocalStack(
        tmp_path_factory.mktemp("mstack"),
        services=("failure-detector", "elasticity-planner"),
        env=stack_env(tmp_path_factory),
        cluster=cluster,
    ) as s:
        yield s


RunNodes = Callable[..., tuple[JobResult, dict[str, torch.Tensor] | None]]


@pytest.fixture(scope="module")
def run_nodes(mstack: LocalStack, corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> RunNodes:
    out = tmp_path_factory.mktemp("mn-weights")
    counter = iter(range(1_000_000))

    def run(
        layout: dict[str, tuple[int, int]] = LAYOUT, steps: int = STEPS, **kwargs: object
    ) -> tuple[JobResult, dict[str, torch.Tensor] | None]:
        job = f"mn{next(counter)}"
        save, steps_log = out / f"{job}.pt", out / f"{job}.steps"
        kwargs.setdefault("on_steps_log", None)
        if callable(report := kwargs.pop("on_steps_log")):
            report(steps_log)
        cmd = train_command(steps, corpus, *SMALL_GPT, save=save, steps_log=steps_log)
        kwargs.setdefault("timeout_s", 240)
        result = mstack.run_nodes(job, cmd, nodes=layout, global_batch=12, steps_log=steps_log, **kwargs)
        return result, (torch.load(save) if save.exists() else None)

    return run


@pytest.fixture(scope="module")
def reference4(run_nodes: RunNodes) -> dict[str, torch.Tensor]:
    result, weights = run_nodes()
    assert result.returncode == 0, (result.node_returncodes, result.decisions)
    assert weights is not None
    first = result.plans[0]
    assert first.world_size == 4 and set(first.nodes.values()) == {"a", "b", "c"}
    return weights


def node_of_store(cluster: NetnsCluster, plan: Plan) -> str:
    host = plan.store_addr.rpartition(":")[0]
    return next(n for n in NODES if cluster.ip(n) == host)


def final(result: JobResult) -> Plan:
    return max(result.plans, key=lambda p: p.generation)


def test_fault_free_run_spans_three_nodes(reference4: dict[str, torch.Tensor]) -> None:
    assert reference4  # the fixture checked the run; other tests compare against it


def test_rank_killed_is_replaced_by_a_spare_on_its_node(
    run_nodes: RunNodes, reference4: dict[str, torch.Tensor]
) -> None:
    result, weights = run_nodes(faults="kill:b-w0@step=5")
    assert actions(result) == [Action.START, Action.REPLACE]
    plan = final(result)
    lost_rank = result.plans[0].rank_of("b-w0")
    joiner = next(m.worker for m in plan.members if m.rank == lost_rank)
    assert plan.nodes[joiner] == "b", plan  # the node that holds the rank's prepared shards
    assert result.returncode == 0, result.node_returncodes
    assert_bitwise_equal(weights, reference4)


def test_whole_node_killed_is_replaced_by_spares_elsewhere(
    run_nodes: RunNodes, reference4: dict[str, torch.Tensor], cluster: NetnsCluster
) -> None:
    # b holds rank(s) but not rank 0 (which writes the steps log) nor, if it can
    # be helped, the store: the store's own loss is the next test.
    result, weights = run_nodes(actions=[(5, lambda r: cluster.kill_node(_victim(cluster, r, store=False)))])
    assert len(result.node_losses) == 1, result.node_losses
    lost = result.node_losses[0].node
    plan = final(result)
    assert lost not in plan.nodes.values() and plan.world_size == 4
    assert result.node_returncodes[lost] < 0  # killed, the others ended cleanly
    assert all(rc == 0 for n, rc in result.node_returncodes.items() if n != lost), result.node_returncodes
    assert_bitwise_equal(weights, reference4)


def test_node_hosting_the_store_killed_moves_the_rendezvous(
    run_nodes: RunNodes, reference4: dict[str, torch.Tensor], cluster: NetnsCluster
) -> None:
    result, weights = run_nodes(actions=[(5, lambda r: cluster.kill_node(_victim(cluster, r, store=True)))])
    assert len(result.node_losses) == 1, result.node_losses
    lost = result.node_losses[0].node
    first, last = result.plans[0], final(result)
    assert node_of_store(cluster, first) == lost, story(result)
    assert node_of_store(cluster, last) != lost and last.store_addr != first.store_addr, story(result)
    assert all(rc == 0 for n, rc in result.node_returncodes.items() if n != lost), result.node_returncodes
    assert_bitwise_equal(weights, reference4)


def test_partitioned_node_is_replaced_and_its_stale_ranks_exit_after_reconnecting(
    run_nodes: RunNodes, reference4: dict[str, torch.Tensor], cluster: NetnsCluster, mstack: LocalStack
) -> None:
    cut: list[str] = []

    def partition(r: JobResult) -> None:
        cut.append(_victim(cluster, r, store=False))
        cluster.partition(cut[0])

    def heal(r: JobResult) -> None:
        cluster.heal(cut[0])

    result, weights = run_nodes(actions=[(4, partition), (10, heal)])
    assert [n.node for n in result.node_losses] == cut
    # no socket error crosses a partition: the survivors were released from their
    # collective by cutting their own connections to the lost node's address (the
    # collective's 120 s backstop timeout would have made recovery wait that long)
    assert final(result).lost_hosts == [cluster.ip(cut[0])]
    logs = mstack.workdir / "logs" / result.job
    cutters = {p.stem for n in LAYOUT if n != cut[0] for p in (logs / n).glob("*.log")
               if '"connections_cut"' in p.read_text()}  # fmt: skip
    survivors = {m.worker for m in result.plans[0].members if result.plans[0].nodes[m.worker] != cut[0]}
    assert survivors <= cutters, (survivors, cutters)
    plan = final(result)
    assert cut[0] not in plan.nodes.values() and plan.world_size == 4
    # The cut-off launcher saw it was declared lost once it could hear again:
    # it fenced its own ranks and ended with 1; nothing of it trains on.
    assert result.node_returncodes[cut[0]] == 1, result.node_returncodes
    assert not cluster.pids(cut[0])
    generations = [p.generation for p in result.plans]
    assert generations == sorted(set(generations)), "a generation was forked or repeated"
    assert all(rc == 0 for n, rc in result.node_returncodes.items() if n != cut[0])
    assert_bitwise_equal(weights, reference4)


def test_launcher_killed_alone_takes_its_ranks_and_a_new_one_joins_as_spares(
    run_nodes: RunNodes, reference4: dict[str, torch.Tensor], cluster: NetnsCluster
) -> None:
    victim: list[str] = []
    again: list[subprocess.Popen[bytes]] = []
    launch: dict[str, bytes] = {}

    def kill_launcher(r: JobResult) -> None:
        node = _victim(cluster, r, store=False)
        victim.append(node)
        # the launcher is the namespace's `phalanx.cli run` process; its ranks are its children
        pid = next(p for p in cluster.pids(node) if b"phalanx.cli" in _proc(p, "cmdline"))
        launch["cmdline"], launch["environ"] = _proc(pid, "cmdline"), _proc(pid, "environ")
        os.kill(pid, signal.SIGKILL)

    def start_again(r: JobResult) -> None:
        argv = [a.decode() for a in launch["cmdline"].split(b"\0") if a]
        env = dict(e.decode().split("=", 1) for e in launch["environ"].split(b"\0") if b"=" in e)
        again.append(subprocess.Popen(cluster.argv(victim[0], argv), env=env))

    try:
        # started again at once: refused until the old launcher is declared lost, then spare capacity
        result, weights = run_nodes(actions=[(4, kill_launcher), (4, start_again)])
        node = victim[0]
        assert [n.node for n in result.node_losses] == [node]
        assert all(rc == 0 for n, rc in result.node_returncodes.items() if n != node), result.node_returncodes
        assert_bitwise_equal(weights, reference4)
        joins = [d.reason for d in result.decisions if d.action is Action.JOIN]
        assert any(f"node {node} joined" in j and "spare capacity" in j for j in joins), joins
        assert again[0].wait(30) == 0  # it ended with the job, as spare capacity
    finally:
        for p in again:
            if p.poll() is None:
                p.kill()
    # the dead launcher's ranks and spare died with it (parent-death signal)
    deadline = time.monotonic() + 10
    while cluster.pids(victim[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not cluster.pids(victim[0]), "processes of the dead launcher are still running"


STALL_S = 60.0  # issue 38: a minute of silence between the nodes and NATS
STALL_STEPS = 400  # ~50 ms each here: the ranks train through the first third of it, then end


def test_a_minute_with_the_bus_silent_to_every_node_changes_nothing(
    run_nodes: RunNodes, cluster: NetnsCluster, mstack: LocalStack
) -> None:
    """Every node's traffic to NATS blackholed for a minute (no reset, no error: a
    stalled bus as the nodes see it) while the ranks train on over gloo and the
    detector, beside NATS, hears nothing of any of them. That is the observer's
    problem, not a mass death: no node-loss verdict, no plan change. The training
    ends inside the stall: the launchers hold their workers' exits until the bus is
    back, and the job is recorded complete as a fault-free one is."""
    from phalanx.devstack.engine import ensure_tools

    ensure_tools(["iptables"])
    port = int(mstack.url.rsplit(":", 1)[1])
    nodes = list(LAYOUT)
    window: list[float] = []
    timers: list[threading.Timer] = []
    logs: list[Path] = []

    def heal() -> None:
        cluster.blackhole("ctl", port, nodes, on=False)
        window.append(time.time())

    def stall(r: JobResult) -> None:
        cluster.blackhole("ctl", port, nodes)
        window.append(time.time())
        timers.append(threading.Timer(STALL_S, heal))
        timers[0].start()

    try:
        result, weights = run_nodes(
            steps=STALL_STEPS, actions=[(4, stall)], timeout_s=240 + STALL_S, on_steps_log=logs.append
        )
        ended_after_the_heal = len(window) == 2
    finally:
        for t in timers:
            t.cancel()
        if len(window) == 1:
            heal()
    assert ended_after_the_heal, "the launchers ended within the stall, the planner never hearing"
    assert result.node_losses == [] and result.faults == [], story(result)
    assert actions(result) == [Action.START], story(result)
    assert result.decisions[-1].action is Action.COMPLETE, story(result)
    assert [p.generation for p in result.plans] == [1], story(result)
    assert all(rc == 0 for rc in result.node_returncodes.values()), result.node_returncodes
    assert weights is not None
    steps = [json.loads(line) for line in logs[0].read_text().splitlines()]
    held = [e for e in steps if window[0] < e["ts"] < window[1]]
    assert len(held) > 100 and {e["generation"] for e in held} == {1}, "the ranks did not train on"
    detector_log = (mstack.workdir / "failure-detector.log").read_text()
    assert '"mass_silence_hold"' in detector_log  # the path this test is for was taken


def _proc(pid: int, what: str) -> bytes:
    return Path(f"/proc/{pid}/{what}").read_bytes()


def _victim(cluster: NetnsCluster, result: JobResult, *, store: bool) -> str:
    """The store's node when ``store``; else a node of the current plan that holds
    neither rank 0 (it writes the steps log the actions are timed by) nor the store."""
    plan = final(result)
    store_node = node_of_store(cluster, plan)
    if store:
        return store_node
    rank0 = plan.nodes[next(m.worker for m in plan.members if m.rank == 0)]
    return next(n for n in LAYOUT if n not in (rank0, store_node))


# HSDP on a (2, 2) mesh, a replica group per node, the spares on a third node.
SHARDED = {"a": (2, 0), "b": (2, 0), "c": (0, 2)}


@pytest.fixture(scope="module")
def run_sharded(mstack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> RunNodes:
    from tests.e2e.test_sharded import PORT
    from tests.e2e.test_sharded import STEPS as SHARDED_STEPS

    out = tmp_path_factory.mktemp("mn-sharded")
    counter = iter(range(1_000_000))

    def run(**kwargs: object) -> tuple[JobResult, dict[str, torch.Tensor] | None]:
        job = f"mns{next(counter)}"
        save, steps_log = out / f"{job}.pt", out / f"{job}.steps"
        cmd = [*PORT, "--steps", str(SHARDED_STEPS), "--save", str(save), "--steps-log", str(steps_log)]
        result = mstack.run_nodes(
            job, cmd, nodes=SHARDED, global_batch=64, steps_log=steps_log, timeout_s=240,
            launcher_args=["--group-size", "2"], **kwargs,
        )  # fmt: skip
        return result, (torch.load(save) if save.exists() else None)

    return run


def test_a_node_holding_a_whole_replica_group_is_replaced_from_the_other_group(
    run_sharded: RunNodes, cluster: NetnsCluster
) -> None:
    from tests.e2e.test_sharded import assert_one_shard_moved

    reference, ref_weights = run_sharded()
    assert reference.returncode == 0, (reference.node_returncodes, reference.decisions)
    # the placement: each replica group on one node, the two groups on different nodes
    assert len(set(_groups_nodes(reference.plans[0]))) == 2, reference.plans[0]
    assert "placement" not in reference.decisions[0].reason  # every shard has a replica on each node

    def kill_group_1(r: JobResult) -> None:
        cluster.kill_node(_groups_nodes(r.plans[0])[1])  # not rank 0's: it writes the steps log

    result, weights = run_sharded(actions=[(5, kill_group_1)])
    lost = _groups_nodes(result.plans[0])[1]
    assert [n.node for n in result.node_losses] == [lost], story(result)
    assert actions(result) == [Action.START, Action.REPLACE], story(result)
    plan = final(result)
    assert _groups_nodes(plan) == (_groups_nodes(result.plans[0])[0], "c"), plan  # group 1 now on c
    assert result.returncode == 0, result.node_returncodes
    assert_bitwise_equal(weights, ref_weights)
    joiners = {m.worker for m in plan.members if plan.nodes[m.worker] == "c"}
    assert len(joiners) == 2
    assert_one_shard_moved(result, joiners)


def _groups_nodes(plan: Plan) -> tuple[str, ...]:
    """The node of each replica group of 2 (both its ranks on it, or a failure)."""
    by_rank = [plan.nodes[m.worker] for m in sorted(plan.members, key=lambda m: m.rank)]
    assert all(by_rank[g] == by_rank[g + 1] for g in range(0, len(by_rank), 2)), by_rank
    return tuple(by_rank[::2])


# -- an unmodified torchrun script across nodes: restart recovery -------------------------
@pytest.fixture(scope="module")
def torchrun4(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict[str, torch.Tensor]]:
    """torchrun's weights, 4 workers on this host, after the same fault: a worker killed
    so that every worker restarts from the checkpoint of step ``resume``. (Not the
    fault-free run's: DDP's first iteration after a restart buckets the gradients anew,
    and with four ranks another bucket layout sums them in another order -- torchrun's
    own restart ends an ulp away from its fault-free run too.)"""
    from tests.e2e.test_unmodified import torchrun_restarted

    out = tmp_path_factory.mktemp("torchrun4")
    done: dict[int, dict[str, torch.Tensor]] = {}

    def weights(resume: int) -> dict[str, torch.Tensor]:
        if resume not in done:
            done[resume] = torch.load(torchrun_restarted(out, f"ref{resume}", nproc=4, kill_at=resume + 4))
        return done[resume]

    return weights


@pytest.mark.parametrize("what", ["node", "launcher"])
def test_unmodified_script_survives_a_lost_node_or_launcher_by_restart(
    what: str,
    mstack: LocalStack,
    cluster: NetnsCluster,
    torchrun4: Callable[[int], dict[str, torch.Tensor]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from tests.e2e.test_unmodified import read_events, script_args

    out = tmp_path_factory.mktemp(f"unmodified-{what}")
    args, events, save = script_args(out, "u")
    victim: list[str] = []

    def strike(r: JobResult) -> None:
        node = _victim(cluster, r, store=False)
        victim.append(node)
        if what == "node":
            cluster.kill_node(node)
        else:  # the launcher alone: its fork server and workers die with it (parent-death signal)
            pid = next(p for p in cluster.pids(node) if b"phalanx.cli" in _proc(p, "cmdline"))
            os.kill(pid, signal.SIGKILL)

    result = mstack.run_nodes(
        f"unmod-{what}", [sys.executable, *args], nodes=LAYOUT, global_batch=64, steps_log=events,
        actions=[(14, strike)], timeout_s=240,
    )  # fmt: skip
    assert [n.node for n in result.node_losses] == victim, result.node_losses
    assert all(rc == 0 for n, rc in result.node_returncodes.items() if n != victim[0]), (
        result.node_returncodes
    )
    plan = final(result)
    assert plan.world_size == 4 and victim[0] not in plan.nodes.values()
    # The survivors die of the broken collective too; if one's exit is judged before the
    # node's loss, the same members restart first (REFORM), then the node's ranks move.
    # An old generation's process whose exit is judged after that is held, not acted on
    # ("generation N already restarts every member"): the last change is the REPLACE.
    changes = [a for a in actions(result) if a is not Action.HOLD]
    assert changes[-1] is Action.REPLACE, [d.reason for d in result.decisions]
    # ... once: the exits of the old generation's processes judged after that re-form are
    # no fault (it restarts them already), so they spend no restart.
    assert actions(result).count(Action.REFORM) <= 1, [d.reason for d in result.decisions]
    starts = [e for e in read_events(events) if e["event"] == "start"]
    last = max(e["attempt"] for e in starts)
    again = [e for e in starts if e["attempt"] == last]
    assert last > 0 and sorted(e["rank"] for e in again) == [0, 1, 2, 3], "every member restarts"
    (resume,) = {e["resume"] for e in again}  # the script's own checkpoint (steps are ms: 10 or 20)
    assert resume in (10, 20)
    assert_bitwise_equal(torch.load(save), torchrun4(resume))
    deadline = time.monotonic() + 10
    while cluster.pids(victim[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not cluster.pids(victim[0]), "processes of the lost node are still running"

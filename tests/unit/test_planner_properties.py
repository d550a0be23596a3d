"""Properties of the planner's reducer (services/elasticity_planner/reducer.py), over
random sequences of inputs: registrations, crashes and hangs, collective errors, exits,
acknowledgements, timers coming due, nodes joining and lost, cluster offers and
reclaims, proposals, leader changes. After every step:

- generations never decrease, and each new plan is a newer generation;
- the fencing tokens of committed plans never decrease (sealed as the service does);
- a committed plan's members are workers that registered (in that run);
- a worker removed (fenced) or gone from a plan is never in a later plan of the run.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from phalanx.services.elasticity_planner import events as ev
from phalanx.services.elasticity_planner.failure_policy import ReplaceOrShrink
from phalanx.services.elasticity_planner.journal import seal
from phalanx.services.elasticity_planner.reducer import Reducer
from phalanx.services.elasticity_planner.scaling_policy import GrowIntoSpares

from phalanx.contract import (
    CapacityChanged,
    Elastic,
    FaultCause,
    JobState,
    NodeLost,
    PreemptionNotice,
    Proposal,
    RankFailed,
    RankHung,
    Role,
)
from tests.unit.planner_inputs import JOB, T0, comm_error, exited, join, registered, spec

REDUCER = Reducer(
    ReplaceOrShrink(comm_grace_s=1.0, max_reforms=2, reform_backoff_max_s=4.0, spare_wait_s=3.0),
    GrowIntoSpares(spawn_timeout_s=20.0),
)
KINDS = (
    "register",
    "fail",
    "hang",
    "comm",
    "exit",
    "ack",
    "timer",
    "join",
    "node_lost",
    "capacity",
    "preempt",
    "propose",
    "leader",
    "respec",
)
Action = tuple[str, int, int, float]
ACTIONS = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 31), st.integers(0, 31), st.floats(0.0, 8.0)),
    max_size=80,
)


class Model:
    """Drives the reducer the way the service does, and checks the invariants after each step."""

    def __init__(self) -> None:
        elastic = Elastic(max_world_size=4, cooldown_s=2.0)
        first = spec(2, 2, launcher="L0", max_nodes=3, min_world_size=1, elastic=elastic)
        self.settings = first
        self.now = T0
        self.token = 1
        self.seq = 0
        self.runs = 0
        self.state: JobState | None = None
        self.registered: set[str] = set()  # workers that registered in the current run
        self.gone: set[str] = set()  # removed or left in the current run
        self.step(join(first, run=self.new_run()))
        for w, role in (("w0", Role.RANK), ("w1", Role.RANK), ("w2", Role.SPARE), ("w3", Role.SPARE)):
            self.step(registered(w, role, run="r-1", ts=self.now))  # generation 1 runs

    def new_run(self) -> str:
        self.runs += 1
        return f"r-{self.runs}"

    def workers(self) -> list[str]:
        s = self.state
        return [w for n in s.nodes.values() for w in n.workers] if s else []

    def step(self, event: ev.Event) -> None:
        before = self.state
        state, _ = REDUCER.step(before, event, self.now)
        if state is not None and before is not None and state.run != before.run:
            self.registered, self.gone = set(), set()
        if isinstance(event, ev.Registration) and state is not None and event.msg.launch == state.run:
            self.registered.add(event.msg.worker)
        if state is not None and state.plan is not None and (before is None or state.plan != before.plan):
            old = before.plan if before is not None else None
            plan = state.plan = seal(state.plan, self.token, {})
            assert plan.generation > (before.generation if before else 0)
            assert old is None or plan.token >= old.token
            members = {m.worker for m in plan.members}
            assert members <= self.registered, (members, self.registered)
            assert not members & self.gone, (members, self.gone)
            assert not members & set(plan.removed)
            self.gone |= set(plan.removed) | set(plan.leaving)
            if old is not None and old.launch == plan.launch:
                self.gone |= {m.worker for m in old.members} - members - set(plan.spares)
        if before is not None and state is not None:
            assert state.generation >= before.generation
        self.state = state

    def act(self, action: Action) -> None:
        kind, i, j, dt = action
        self.now += dt
        s = self.state
        workers = self.workers()
        pick = workers[i % len(workers)] if workers else "w0"
        gen = s.generation if s else 0
        rank = (s.plan.rank_of(pick) if s and s.plan else None) or 0
        if kind == "register" and s is not None:
            role = Role.RANK if j % 2 else Role.SPARE
            self.step(registered(pick, role, run=s.run if j % 7 else "r-stale", ts=self.now))
        elif kind in ("fail", "hang"):
            cls = RankFailed if kind == "fail" else RankHung
            msg = cls(
                job=JOB,
                ts=self.now,
                incident=f"inc-{j % 12}",
                worker=pick,
                rank=rank,
                generation=gen,
                cause=FaultCause.PROCESS_EXIT if kind == "fail" else FaultCause.STEP_STALL,
                fault_at=self.now - 1,
                detected_at=self.now,
            )
            self.step(ev.Failure(msg=msg) if isinstance(msg, RankFailed) else ev.Hang(msg=msg))
        elif kind == "comm" and s is not None and s.plan is not None:
            member = s.plan.members[i % len(s.plan.members)]
            self.step(comm_error(member.worker, member.rank, gen if j % 5 else gen - 1, self.now, run=s.run))
        elif kind == "exit" and s is not None:
            node = s.node_of(pick) or "local"
            self.step(exited(pick, code=0 if j % 16 == 0 else 1, node=node, ts=self.now))
        elif kind == "ack":
            self.step(ev.AllAcked(job=JOB, generation=gen if j % 4 else gen - 1))
        elif kind == "timer" and s is not None and s.timers:
            name = sorted(s.timers)[i % len(s.timers)]
            self.now = max(self.now, s.timers[name])
            self.step(ev.TimerFired(job=JOB, name=name))
        elif kind == "join":
            node = f"n{i % 3}"
            names = [f"{node}-w{k}" for k in range(2)]
            s2 = self.settings.model_copy(
                update={"node": node, "launcher": f"L{i}", "workers": names, "ranks": 1, "ts": self.now}
            )
            self.step(ev.JoinRequest(msg=s2, run=f"r-unused-{i}"))
        elif kind == "node_lost" and s is not None and s.nodes:
            node = sorted(s.nodes)[i % len(s.nodes)]
            lost = NodeLost(
                job=JOB,
                ts=self.now,
                incident=f"node-{node}-{j % 3}",
                node=node,
                launcher=s.nodes[node].launcher,
                workers=s.nodes[node].workers,
                cause=FaultCause.HEARTBEAT_LOST,
                fault_at=self.now - 1,
                detected_at=self.now,
            )
            self.step(ev.NodeLoss(msg=lost))
        elif kind == "capacity" and s is not None and s.nodes:
            self.seq += 1
            node = sorted(s.nodes)[i % len(s.nodes)]
            offer = CapacityChanged(
                cluster="c", available_slots=j % 4, delta=1, source="test", ts=self.now, offered={node: j % 4}
            )
            self.step(ev.Capacity(msg=offer, seq=self.seq))
        elif kind == "preempt":
            self.seq += 1
            notice = PreemptionNotice(
                cluster="c", job=JOB, workers=[pick], deadline_s=5.0, source="test", ts=self.now
            )
            self.step(ev.Preemption(msg=notice, seq=self.seq))
        elif kind == "propose":
            proposal = Proposal(job=JOB, ts=self.now, id=f"p{i}", policy="prop", world_size=j % 5 + 1)
            self.step(ev.Proposed(msg=proposal))
        elif kind == "leader" and s is not None:
            self.token += 1 + j
            self.step(ev.Resumed(job=JOB))
        elif kind == "respec":  # a new run of the job once this one ended (refused while it runs)
            again = self.settings.model_copy(update={"launcher": f"L0-{i}", "ts": self.now})
            self.step(ev.JoinRequest(msg=again, run=self.new_run()))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ACTIONS)
def test_plans_only_move_forward_with_registered_workers_and_never_take_back_the_removed(
    actions: list[Action],
) -> None:
    model = Model()
    for action in actions:
        model.act(action)


def test_the_model_reaches_new_generations() -> None:
    """The properties are not vacuous: the job starts, and a crash commits a new generation."""
    model = Model()
    assert (
        model.state is not None
        and model.state.generation == 1
        and model.registered == {"w0", "w1", "w2", "w3"}
    )
    model.act(("fail", 1, 1, 1.0))  # w1 crashes: a spare takes its rank
    assert model.state is not None and model.state.generation == 2 and "w1" in model.gone

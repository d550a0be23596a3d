"""What one node needs of a plan, and plans as deltas: the control plane at 16k ranks.

A :class:`~phalanx.contract.Plan` names every member; at 16,384 ranks it is tens of
kilobytes even as runs, and 18,000 processes reading it for every generation would be
gigabytes through NATS. So the plan travels in three forms:

- the whole :class:`Plan`, committed in the job's record and published on
  ``phalanx.cmd.<job>.plan`` for the services (detector, keepers, policies);
- a :class:`PlanDelta` on ``phalanx.cmd.<job>.delta`` for the launchers, one message
  whatever the job's size: the generation's settings, and who moved, joined or left
  relative to generation ``base`` (:func:`plan_delta`);
- a :class:`NodePlan`, the node's own part (its workers' ranks, the store to meet
  on, the lost hosts), which each launcher derives (:func:`apply_delta`, or
  :func:`node_plan` from the record when it holds no base) and hands to its ranks
  over a local socket.

Ranks and launchers read the generation the same way from either form:
``generation``, ``token``, ``world_size``, ``rank_of``, ``supersedes``, the store fields.

>>> view = node_plan(plan, "n1", {"n1-w0", "n1-w1"})
>>> view.rank_of("n1-w1")
5
>>> apply_delta(view, plan_delta(plan, next_plan), {"n1-w0", "n1-w1"})  # None: read the record
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator

from phalanx.contract._base import JobMessage
from phalanx.contract.codec import DecodeError, decode_map, headers_for
from phalanx.contract.jobrecord import JobRecord
from phalanx.contract.messages import BatchPlan, NodeId, Plan, WorkerId
from phalanx.contract.runs import MAX_EXPANDED, Names, from_runs, split_name

MAX_DELTA_ENTRIES = 1024
"""Moves plus joined runs a delta may carry; a bigger change (the first generation, a
large grow) is sent as ``full``: every launcher reads the record once."""
MAX_NODE_WORKERS = 4096


class _Generation(JobMessage):
    """The settings of one generation that every node shares."""

    generation: int = Field(ge=1)
    token: int = Field(default=0, ge=0, description="Fencing token of the planner that committed it.")
    launch: str = Field(default="", max_length=64, description="The job-level run this plan belongs to.")
    reason: str = Field(default="", max_length=4000)
    incident: str | None = Field(default=None, max_length=300)
    world_size: int = Field(ge=1, le=MAX_EXPANDED)
    group_size: int = Field(default=1, ge=1, le=65536)
    store_prefix: str = Field(max_length=300)
    store_secret: str = Field(default="", max_length=64, pattern=r"^[A-Za-z0-9_-]*$", repr=False)
    store_addr: str = Field(default="", max_length=300)
    store_addrs: list[Annotated[str, Field(max_length=300)]] = Field(default_factory=list, max_length=64)
    lost_launchers: list[str] = Field(default_factory=list, max_length=65536)
    lost_hosts: list[str] = Field(default_factory=list, max_length=65536)
    trace: dict[str, str] = Field(default_factory=dict, max_length=4)
    planned: bool = False
    leave_by: float = Field(default=0.0, ge=0)
    batch: BatchPlan | None = None
    shrunk: list[int] = Field(default_factory=list, max_length=4096)

    def supersedes(self, other: _Generation | Plan | None) -> bool:
        """:meth:`Plan.supersedes <phalanx.contract.Plan.supersedes>`'s order: token, then generation."""
        if other is None:
            return True
        if other.job != self.job:
            raise ValueError(f"plans of jobs {self.job!r} and {other.job!r} are not ordered")
        return (self.token, self.generation) > (other.token, other.generation)


def _header(plan: Plan) -> dict[str, Any]:
    return {
        "job": plan.job,
        "ts": plan.ts,
        "generation": plan.generation,
        "token": plan.token,
        "launch": plan.launch,
        "reason": plan.reason,
        "incident": plan.incident,
        "world_size": plan.world_size,
        "group_size": plan.group_size,
        "store_prefix": plan.store_prefix,
        "store_secret": plan.store_secret,
        "store_addr": plan.store_addr,
        "store_addrs": plan.store_addrs,
        "lost_launchers": plan.lost_launchers,
        "lost_hosts": plan.lost_hosts,
        "trace": plan.trace,
        "planned": plan.planned,
        "leave_by": plan.leave_by,
        "batch": plan.batch,
        "shrunk": plan.shrunk,
    }


_UNCHANGED_AS_NONE = ("store_addrs", "lost_launchers", "lost_hosts")


class NodePlan(_Generation):
    """One node's part of a generation: what its launcher and ranks act on."""

    KIND = "node_plan"
    node: NodeId = Field(default="", max_length=64)
    ranks: dict[WorkerId, int] = Field(
        default_factory=dict, max_length=MAX_NODE_WORKERS, description="This node's members: worker -> rank."
    )
    removed: list[WorkerId] = Field(default_factory=list, max_length=MAX_NODE_WORKERS)
    leaving: list[WorkerId] = Field(default_factory=list, max_length=MAX_NODE_WORKERS)

    @field_validator("ranks")
    @classmethod
    def _in_world(cls, ranks: dict[str, int]) -> dict[str, int]:
        if any(r < 0 for r in ranks.values()) or len(set(ranks.values())) != len(ranks):
            raise ValueError("ranks must be distinct and >= 0")
        return ranks

    def rank_of(self, worker: WorkerId) -> int | None:
        return self.ranks.get(worker)


class PlanDelta(_Generation):
    """A generation as a change of generation ``base`` (0: of none): one message for
    every launcher, a few hundred bytes when a few ranks change.

    ``moves``: ``[old_rank, count, new_rank]``, members of ``base`` kept (renumbered);
    ``joined``: ``[prefix, first, count, rank]``, new members (``prefix<first>`` takes
    ``rank``, and so on); ``full``: too big a change, read the record. A member of
    ``base`` in no move is no member any more."""

    KIND = "plan_delta"
    base: int = Field(ge=0)
    full: bool = False
    # The lists that rarely change travel only when they do (None: as in ``base``).
    store_addrs: list[Annotated[str, Field(max_length=300)]] | None = Field(default=None, max_length=64)  # type: ignore[assignment]
    lost_launchers: list[str] | None = Field(default=None, max_length=65536)  # type: ignore[assignment]
    lost_hosts: list[str] | None = Field(default=None, max_length=65536)  # type: ignore[assignment]
    moves: list[tuple[int, int, int]] = Field(default_factory=list, max_length=MAX_DELTA_ENTRIES)
    joined: list[tuple[str, int, int, int]] = Field(default_factory=list, max_length=MAX_DELTA_ENTRIES)
    removed: Names = Field(default_factory=list)
    leaving: Names = Field(default_factory=list)

    @field_validator("moves")
    @classmethod
    def _moves(cls, moves: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        if any(old < 0 or count < 1 or new < 0 for old, count, new in moves):
            raise ValueError("a move is [old_rank >= 0, count >= 1, new_rank >= 0]")
        return moves

    @field_validator("joined")
    @classmethod
    def _joined(cls, joined: list[tuple[str, int, int, int]]) -> list[tuple[str, int, int, int]]:
        for _, first, count, rank in joined:
            if rank < 0 or count < 1 or first < -1 or (first == -1 and count != 1):
                raise ValueError("a joined run is [prefix, first >= 0 (or -1 once), count >= 1, rank >= 0]")
        return joined


def node_plan(plan: Plan, node: str, workers: Collection[str]) -> NodePlan:
    """``plan``'s part for ``node``, whose workers are ``workers`` (the launcher's own list:
    removed workers are in no plan's ``nodes`` any more)."""
    return NodePlan(
        **_header(plan),
        node=node,
        ranks={m.worker: m.rank for m in plan.members if m.worker in workers},
        removed=[w for w in plan.removed if w in workers],
        leaving=[w for w in plan.leaving if w in workers],
    )


def record_node_plan(data: bytes, node: str, workers: Collection[str]) -> NodePlan | None:
    """``node``'s part of the plan in a job record as stored (``phalanx_jobs/<job>.plan``),
    read run by run: a launcher's read of a 16,384-rank record costs its runs (one per
    node), not 16,384 members. The header fields are validated as a :class:`NodePlan`'s;
    a malformed record raises :class:`~phalanx.contract.DecodeError` (None: no plan yet)."""
    _, record = decode_map(data, headers_for(JobRecord), JobRecord)
    plan = record.get("plan")
    if plan is None:
        return None
    if not isinstance(plan, dict) or not isinstance(plan.get("members"), list):
        raise DecodeError("a job record whose plan has no members list", JobRecord.KIND)
    mine: dict[str, list[tuple[int, str]]] = {}
    for w in workers:
        prefix, n = split_name(w)
        mine.setdefault(prefix, []).append((n, w))
    ranks: dict[str, int] = {}
    rank = 0
    try:
        for run in plan["members"]:
            if isinstance(run, dict):  # the spelled-out form
                if run["worker"] in workers:
                    ranks[run["worker"]] = int(run["rank"])
                rank += 1
                continue
            name, first, count = (run, -1, 1) if isinstance(run, str) else run
            if (
                not isinstance(name, str)
                or not isinstance(first, int)
                or not isinstance(count, int)
                or count < 1
            ):
                raise ValueError(f"bad run {run!r:.80}")
            if first < 0:
                if name in workers:
                    ranks[name] = rank
            else:
                for n, w in mine.get(name, ()):
                    if first <= n < first + count:
                        ranks[w] = rank + n - first
            rank += count
            if rank > MAX_EXPANDED:
                raise ValueError(f"members expand past {MAX_EXPANDED}")
        header = {k: plan[k] for k in _Generation.model_fields if k in plan and k != "world_size"}
        removed = [w for w in from_runs(plan.get("removed", [])) if w in workers]
        leaving = [w for w in from_runs(plan.get("leaving", [])) if w in workers]
        return NodePlan.model_validate(
            {
                **header,
                "world_size": rank,
                "node": node,
                "ranks": ranks,
                "removed": removed,
                "leaving": leaving,
            }
        )
    except (ValueError, TypeError, KeyError) as exc:  # pydantic's ValidationError is a ValueError
        raise DecodeError(f"a job record's plan is malformed: {exc}", JobRecord.KIND) from exc


def worker_plan(plan: Plan, worker: str) -> NodePlan:
    """``plan`` as one worker without a launcher sees it (it follows the whole plan)."""
    return node_plan(plan, plan.nodes.get(worker, ""), {worker})


def plan_delta(prev: Plan | None, plan: Plan) -> PlanDelta:
    """``plan`` as a change of ``prev`` (the plan the launchers were sent before)."""
    header = _header(plan)
    if prev is None or prev.job != plan.job or prev.launch != plan.launch:
        return PlanDelta(**header, base=0, full=True)
    old = {m.worker: m.rank for m in prev.members}
    moves: list[list[int]] = []
    joined: list[list[Any]] = []
    for m in sorted(plan.members, key=lambda m: m.rank):
        was = old.get(m.worker)
        if was is not None:
            last = moves[-1] if moves else None
            if last is not None and last[0] + last[1] == was and last[2] + last[1] == m.rank:
                last[1] += 1
            else:
                moves.append([was, 1, m.rank])
            continue
        prefix, first = split_name(m.worker)
        last_j = joined[-1] if joined else None
        if (
            last_j is not None
            and first >= 0
            and last_j[0] == prefix
            and last_j[1] >= 0
            and last_j[1] + last_j[2] == first
            and last_j[3] + last_j[2] == m.rank
        ):
            last_j[2] += 1
        else:
            joined.append([prefix, first, 1, m.rank])
    expanded = sum(j[2] for j in joined)
    if len(moves) + len(joined) > MAX_DELTA_ENTRIES or expanded > MAX_NODE_WORKERS:
        return PlanDelta(**header, base=prev.generation, full=True)
    for name in _UNCHANGED_AS_NONE:
        if getattr(prev, name) == header[name]:
            header[name] = None
    return PlanDelta(
        **header,
        base=prev.generation,
        moves=[(a, b, c) for a, b, c in moves],
        joined=[(p, f, c, r) for p, f, c, r in joined],
        removed=plan.removed,
        leaving=plan.leaving,
    )


def apply_delta(view: NodePlan | None, delta: PlanDelta, workers: Collection[str]) -> NodePlan | None:
    """The node's part of ``delta``'s generation, from its part of ``delta.base``; None when
    it cannot be had that way (no base held, another base, a ``full`` delta): read the record."""
    if (
        view is None
        or delta.full
        or delta.base != view.generation
        or delta.job != view.job
        or delta.launch != view.launch
        or delta.token < view.token
    ):
        return None
    moves = sorted(delta.moves)
    starts = [m[0] for m in moves]
    ranks: dict[str, int] = {}
    for worker, was in view.ranks.items():
        i = bisect.bisect_right(starts, was) - 1
        if i >= 0:
            start, count, new = moves[i]
            if was < start + count:
                ranks[worker] = new + (was - start)
    for prefix, first, count, rank in delta.joined:
        if first < 0:
            if prefix in workers:
                ranks[prefix] = rank
            continue
        for i in range(min(count, MAX_NODE_WORKERS)):
            if (name := f"{prefix}{first + i}") in workers:
                ranks[name] = rank + i
    if any(r >= delta.world_size for r in ranks.values()):
        return None  # not a delta of this world: read the record
    try:
        fields = {k: getattr(delta, k) for k in _Generation.model_fields}  # instances: not validated again
        for name in _UNCHANGED_AS_NONE:
            if fields[name] is None:
                fields[name] = getattr(view, name)
        return NodePlan(
            **fields,
            node=view.node,
            ranks=ranks,
            removed=[w for w in delta.removed if w in workers],
            leaving=[w for w in delta.leaving if w in workers],
        )
    except ValidationError:
        return None  # two workers on one rank: not a delta of the view held; read the record


class NodeAck(JobMessage):
    """A launcher: these workers of its node hold generation ``generation`` (one message
    per node and generation instead of one per rank)."""

    KIND = "node_ack"
    node: NodeId = Field(max_length=64)
    generation: int = Field(ge=1)
    workers: Names = Field(default_factory=list)

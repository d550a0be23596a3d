"""``phalanx report JOB -o run.png``: a picture of one run, drawn after the fact.

Everything comes from what the run left in JetStream: the launchers' step records
(``phalanx.evt.<job>.steps``: every rank's step time and loss), the committed plans
(generations and resizes), the detector's verdicts, the planner's decisions, the
members' acknowledgements and the ranks' ``RecoveryDone`` (phase durations). With
the traces (a span file or Jaeger, loaded by :mod:`phalanx.tracesummary`), each
incident's phases are the trace's instead of the events' estimate.

:func:`load_run` gathers a :class:`RunReport` (plain data, testable);
:func:`render` draws it with matplotlib (Agg): step time and loss over time, every
incident and resize as a band from its start to the last rank's first step, every
generation as a line, and one stacked bar of phase durations per incident.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.bus import Bus
from phalanx.contract import (
    Message,
    NodeLost,
    Plan,
    PlanAck,
    PlanDecision,
    RankFailed,
    RankHung,
    RecoveryDone,
    StepRecord,
    StepStats,
)
from phalanx.contract.streams import COMMANDS, EVENTS, StreamSpec
from phalanx.contract.subjects import PLAN
from phalanx.tracesummary import PHASES, SpanRecord, incidents

__all__ = ["Generation", "RunIncident", "RunReport", "load_run", "read_stream", "render"]


@dataclass(frozen=True)
class Generation:
    generation: int
    at: float  # wall time the plan was made
    world_size: int
    members: dict[int, str]  # rank -> worker
    reason: str
    incident: str | None
    planned: bool


@dataclass
class RunIncident:
    """A fault and its recovery, or a planned resize, as the run's events tell it."""

    incident: str
    kind: str  # "fault", or the resize: "grow", "shrink", ...
    action: str  # the planner's decision: replace, shrink, reform, grow, ...
    generation: int  # the generation it led to
    reason: str
    cause: str  # process_exit, heartbeat_lost, ... ("" for a planned change)
    workers: list[str]  # the workers lost (faults)
    start: float  # wall time: the fault (detector's estimate), or the plan of a resize
    end: float | None  # wall time the last member reported its first step in the new generation
    phases_ms: dict[str, float] = field(default_factory=dict)
    """Duration of each phase: from the trace when given, else from the events
    (detect, plan and notify from verdict, plan and acknowledgement times; the ranks'
    phases, the slowest rank's, from their ``RecoveryDone``)."""
    trace_id: str | None = None
    trace_downtime_ms: float | None = None

    @property
    def downtime_ms(self) -> float | None:
        """Start -> the last member's first step done (reported), from the events."""
        return None if self.end is None else (self.end - self.start) * 1e3


@dataclass
class RunReport:
    job: str
    steps: list[StepRecord]
    generations: list[Generation]
    incidents: list[RunIncident]
    decisions: list[PlanDecision]

    @property
    def workers(self) -> list[str]:
        return sorted({s.worker for s in self.steps})

    @property
    def t0(self) -> float:
        """Wall time the run's picture starts at (its first plan or step)."""
        times = [g.at for g in self.generations] + [s.at - s.step_ms / 1e3 for s in self.steps]
        return min(times, default=0.0)


async def read_stream(bus: Bus, stream: StreamSpec, subject: str, timeout_s: float = 5.0) -> list[Message]:
    """Every message on ``subject`` (a filter) still in ``stream``, oldest first, decoded
    (what fails to decode is left out): :meth:`phalanx.bus.streams.Streams.history`."""
    return [s.msg for s in await bus.streams.history(subject, Message, stream=stream, timeout_s=timeout_s)]


async def load_run(bus: Bus, job: str, *, spans: list[SpanRecord] | None = None) -> RunReport:
    """The run of ``job`` from the events stream (and the traces in ``spans``, if given)."""
    events = await read_stream(bus, EVENTS, f"phalanx.evt.{job}.>")
    plans = [m for m in await read_stream(bus, COMMANDS, PLAN.format(job=job)) if isinstance(m, Plan)]
    steps: dict[tuple[str, int, int], StepRecord] = {}
    faults: dict[str, RankFailed | RankHung | NodeLost] = {}
    decisions: list[PlanDecision] = []
    acks: dict[int, float] = {}  # generation -> last acknowledgement
    done: dict[int, list[RecoveryDone]] = defaultdict(list)
    for m in events:
        if isinstance(m, StepStats):
            for r in m.steps:  # a step redone by a newer incarnation replaces the older record
                steps[(r.worker, r.generation, r.step)] = r
        elif isinstance(m, RankFailed | RankHung | NodeLost):
            faults.setdefault(m.incident, m)
        elif isinstance(m, PlanDecision):
            decisions.append(m)
        elif isinstance(m, PlanAck):
            acks[m.generation] = max(acks.get(m.generation, 0.0), m.ts)
        elif isinstance(m, RecoveryDone):
            done[m.generation].append(m)

    by_gen: dict[int, Plan] = {}
    for p in plans:  # re-published until acknowledged: the first of each generation
        by_gen.setdefault(p.generation, p)
    generations = [
        Generation(
            p.generation,
            p.ts,
            p.world_size,
            {m.rank: m.worker for m in p.members},
            p.reason,
            p.incident,
            p.planned,
        )
        for _, p in sorted(by_gen.items())
    ]
    traced = {str(i.attributes.get("phalanx.incident", "")): i for i in incidents(spans or [])}
    out: list[RunIncident] = []
    for p in sorted(by_gen.values(), key=lambda p: p.generation):
        if not p.incident or p.generation == 1:
            continue
        decision = next(
            (d for d in decisions if d.generation == p.generation and d.incident == p.incident), None
        )
        fault = faults.get(p.incident)
        reports = done.get(p.generation, [])
        phases: dict[str, float] = {}
        if fault is not None:
            phases["detect"] = (fault.detected_at - fault.fault_at) * 1e3
            phases["plan"] = max(0.0, (p.ts - fault.detected_at) * 1e3)
        if p.generation in acks:
            phases["notify"] = max(0.0, (acks[p.generation] - p.ts) * 1e3)
        for rep in reports:
            for k, v in rep.phases_ms.items():
                phases[k] = max(phases.get(k, 0.0), v)
        inc = RunIncident(
            incident=p.incident,
            kind="fault" if fault is not None else (decision.action.value if decision else "change"),
            action=decision.action.value if decision else "",
            generation=p.generation,
            reason=decision.reason if decision else p.reason,
            cause=fault.cause.value if fault is not None else "",
            workers=(fault.workers if isinstance(fault, NodeLost) else [fault.worker]) if fault else [],
            start=fault.fault_at if fault is not None else p.ts,
            end=max((r.ts for r in reports), default=None),
            phases_ms=phases,
        )
        t = traced.get(p.incident)
        if t is not None:
            inc.trace_id, inc.trace_downtime_ms = t.trace_id, t.downtime_ms
            # the trace's phases win; a trace missing some (a process whose spans went
            # elsewhere or were not exported yet) keeps the events' estimate for those
            inc.phases_ms = {**phases, **{r.phase: r.dur_ms for r in t.rows}}
        out.append(inc)
    return RunReport(
        job=job,
        steps=sorted(steps.values(), key=lambda r: (r.at, r.worker)),
        generations=generations,
        incidents=out,
        decisions=decisions,
    )


_PHASE_COLORS = dict(
    zip(
        ("signal", *PHASES),
        ("#9e9e9e", "#e41a1c", "#ff7f00", "#ffbf00", "#984ea3", "#377eb8", "#4daf4a", "#a65628", "#f781bf"),
        strict=True,
    )
)


def render(run: RunReport, out: Path) -> None:
    """Draw ``run`` into the PNG ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_inc = len(run.incidents)
    heights = [3.0, 3.0, max(1.2, 0.55 * n_inc + 0.8)]
    fig, (ax_t, ax_l, ax_p) = plt.subplots(
        3, 1, figsize=(12, sum(heights) + 1.2), gridspec_kw={"height_ratios": heights}
    )
    t0 = run.t0
    fig.suptitle(f"Phalanx run {run.job}: {len(run.steps)} step records, {n_inc} incident(s)", fontsize=13)

    workers = run.workers
    cmap = plt.get_cmap("tab10" if len(workers) <= 10 else "tab20")
    has_loss = any(s.loss is not None for s in run.steps)
    aggregate = len(workers) > 8
    nan = float("nan")
    for i, w in enumerate(workers):
        pts = [s for s in run.steps if s.worker == w]
        ranks = sorted({s.rank for s in pts})
        label = f"{w} (rank {'/'.join(map(str, ranks))})"
        # A line per generation: no line drawn across a recovery or a resize.
        x: list[float] = []
        y: list[float] = []
        ly: list[float] = []
        for k, s in enumerate(pts):
            if k and s.generation != pts[k - 1].generation:
                x.append(nan)
                y.append(nan)
                ly.append(nan)
            x.append(s.at - t0)
            y.append(s.step_ms)
            ly.append(nan if s.loss is None else s.loss)
        if not aggregate:
            color = cmap(i % cmap.N)
            ax_t.plot(x, y, ".-", ms=3, lw=0.8, color=color, label=label)
            if any(s.loss is not None for s in pts):
                ax_l.plot(x, ly, ".-", ms=3, lw=0.8, color=color, label=label)
    if aggregate:  # many ranks: the mean (and the slowest) per step
        by_step: dict[tuple[int, int], list[StepRecord]] = defaultdict(list)
        for s in run.steps:
            by_step[(s.generation, s.step)].append(s)
        rows = sorted(by_step.values(), key=lambda rs: max(r.at for r in rs))
        x = [max(r.at for r in rs) - t0 for rs in rows]
        ax_t.plot(x, [sum(r.step_ms for r in rs) / len(rs) for rs in rows], lw=1, label="mean over ranks")
        ax_t.plot(x, [max(r.step_ms for r in rs) for rs in rows], lw=0.8, alpha=0.6, label="slowest rank")
        lx = [(xx, [r.loss for r in rs if r.loss is not None]) for xx, rs in zip(x, rows, strict=True)]
        lx = [(xx, ls) for xx, ls in lx if ls]
        if lx:
            ax_l.plot([a for a, _ in lx], [sum(ls) / len(ls) for _, ls in lx], lw=1, label="mean over ranks")

    for ax in (ax_t, ax_l):
        for g in run.generations:
            ax.axvline(g.at - t0, color="0.55", ls=":", lw=0.9)
        for inc in run.incidents:
            end = inc.end if inc.end is not None else inc.start
            ax.axvspan(inc.start - t0, max(end, inc.start) - t0, color=_color(inc), alpha=0.18, lw=0)
            ax.axvline(inc.start - t0, color=_color(inc), lw=1.2)
        ax.grid(alpha=0.3)
    # Labels once, on the top axes: generations at the bottom edge, incidents at the top.
    trans = ax_t.get_xaxis_transform()
    for g in run.generations:
        ax_t.text(
            g.at - t0,
            0.02,
            f" gen {g.generation}: {g.world_size} ranks",
            transform=trans,
            fontsize=7,
            color="0.35",
            rotation=90,
            va="bottom",
            ha="right",
        )
    for k, inc in enumerate(run.incidents, 1):
        ax_t.text(
            inc.start - t0,
            0.98,
            f" #{k} {_title(inc)}",
            transform=trans,
            fontsize=8,
            color=_color(inc),
            va="top",
            ha="left",
            bbox={"fc": "white", "ec": "none", "alpha": 0.7, "pad": 1},
        )
    ax_t.set_ylabel("step time (ms)")
    ax_t.set_title(
        "Step time per rank (red band: fault -> last rank's first step; blue: resize)", fontsize=10
    )
    ax_l.set_ylabel("loss")
    ax_l.set_xlabel("time since the run started (s)")
    ax_l.set_title("Loss per rank" if has_loss else "Loss (not reported by the training loop)", fontsize=10)
    ax_l.sharex(ax_t)
    if workers:
        ax_t.legend(fontsize=7, loc="upper right", ncol=min(4, max(1, len(workers) // 3 + 1)))
    if has_loss:
        ax_l.legend(fontsize=7, loc="upper right", ncol=min(4, max(1, len(workers) // 3 + 1)))

    # One stacked bar per incident: how long each phase took.
    if run.incidents:
        labels = []
        seen: set[str] = set()
        for k, inc in enumerate(run.incidents):
            left = 0.0
            for phase in ("signal", *PHASES):
                dur = inc.phases_ms.get(phase)
                if dur is None:
                    continue
                ax_p.barh(
                    k,
                    dur,
                    left=left,
                    color=_PHASE_COLORS[phase],
                    edgecolor="white",
                    lw=0.5,
                    label=phase if phase not in seen else None,
                )
                seen.add(phase)
                left += dur
            down = inc.trace_downtime_ms if inc.trace_downtime_ms is not None else inc.downtime_ms
            if down is not None:
                ax_p.text(left, k, f"  downtime {down:.0f} ms", va="center", fontsize=8)
            labels.append(f"#{k + 1} gen {inc.generation} {inc.kind if inc.kind != 'fault' else inc.action}")
        ax_p.set_yticks(range(len(labels)), labels, fontsize=8)
        ax_p.invert_yaxis()
        src = "traces" if any(i.trace_id for i in run.incidents) else "events"
        ax_p.set_title(
            f"Recovery phases per incident, from the {src}: durations in ms, stacked"
            " (phases overlap, so the sum exceeds the downtime)",
            fontsize=10,
        )
        ax_p.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=9, frameon=False)
        ax_p.margins(x=0.25)
        ax_p.grid(axis="x", alpha=0.3)
    else:
        ax_p.set_axis_off()
        ax_p.text(0.5, 0.5, "no incident in this run", ha="center", va="center", transform=ax_p.transAxes)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _color(inc: RunIncident) -> str:
    return "tab:red" if inc.kind == "fault" else "tab:blue"


def _title(inc: RunIncident) -> str:
    if inc.kind == "fault":
        return f"{inc.action} {','.join(inc.workers)} ({inc.cause})"
    return f"{inc.kind} -> gen {inc.generation}"

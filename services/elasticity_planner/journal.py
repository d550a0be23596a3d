"""A journal of the planner's inputs, and their replay through the reducer.

When ``PHALANX_PLANNER_JOURNAL`` names a file, the leader appends one JSON line
per input it committed: the job, the typed event (:mod:`.events`), the time it
was handled (``now``) and the plan that step committed, if any. It also writes
each job's state whenever it (re)loads the record (election, a lost
compare-and-set), and first the policies' settings. :func:`replay` feeds the
same inputs to a fresh :class:`~.reducer.Reducer` and returns each committed plan
beside the one replay computed: the reducer is a pure function of (state, event,
now), so they must be equal but for what the service stamps at commit
(:data:`STAMPED`: the fencing token, the generation's random rendezvous secret,
the trace context).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from pathlib import Path
from typing import Any

from phalanx.services.elasticity_planner.events import EVENT, Event
from phalanx.services.elasticity_planner.failure_policy import ReplaceOrShrink
from phalanx.services.elasticity_planner.reducer import Reducer
from phalanx.services.elasticity_planner.scaling_policy import GrowIntoSpares

from phalanx.contract import JobState, Plan

STAMPED = frozenset({"token", "store_secret", "trace"})


def seal(plan: Plan, token: int, trace: dict[str, str]) -> Plan:
    """The plan as committed: the leader's fencing token, a fresh random rendezvous secret
    (the generation's members' own, see ``Plan.store_secret``) and the incident's trace."""
    return plan.model_copy(update={"token": token, "store_secret": secrets.token_urlsafe(24), "trace": trace})


class Journal:
    """Appends lines to ``path`` (flushed each, so a killed planner leaves whole lines)."""

    def __init__(self, path: str | Path, reducer: Reducer) -> None:
        self.path = Path(path)
        self._file = self.path.open("a", encoding="utf-8")
        policies: dict[str, Any] = {"spec_max_age_s": reducer.spec_max_age_s}
        for name, policy in (("failure", reducer.failure), ("scaling", reducer.scaling)):
            if dataclasses.is_dataclass(policy) and not isinstance(policy, type):
                policies[name] = {"type": type(policy).__name__, **dataclasses.asdict(policy)}
        self._write({"policies": policies})

    def _write(self, line: dict[str, Any]) -> None:
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()

    def loaded(self, job: str, state: JobState | None) -> None:
        plan = state.plan if state is not None else None
        self._write(
            {
                "job": job,
                "state": state.model_dump(mode="json") if state is not None else None,
                "plan": plan.model_dump(mode="json") if plan is not None else None,
            }
        )

    def stepped(self, job: str, event: Event, now: float, committed: Plan | None) -> None:
        self._write(
            {
                "job": job,
                "now": now,
                "event": event.model_dump(mode="json"),
                "plan": committed.model_dump(mode="json") if committed is not None else None,
            }
        )

    def close(self) -> None:
        self._file.close()


def read(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line]


def reducer_for(lines: list[dict[str, Any]]) -> Reducer:
    """The reducer the journal was written with (the default policies with its settings)."""
    cfg: dict[str, Any] = next((line["policies"] for line in lines if "policies" in line), {})
    failure = {k: v for k, v in cfg.get("failure", {}).items() if k != "type"}
    scaling = {k: v for k, v in cfg.get("scaling", {}).items() if k != "type"}
    return Reducer(ReplaceOrShrink(**failure), GrowIntoSpares(**scaling), cfg.get("spec_max_age_s", 300.0))


def unstamped(plan: Plan) -> dict[str, Any]:
    return plan.model_dump(mode="json", exclude=set(STAMPED))


def replay(lines: list[dict[str, Any]], reducer: Reducer | None = None) -> list[tuple[Plan, Plan | None]]:
    """Replay the journal; for every committed plan, (the recorded plan, replay's plan)."""
    reducer = reducer or reducer_for(lines)
    states: dict[str, JobState | None] = {}
    pairs: list[tuple[Plan, Plan | None]] = []
    for line in lines:
        if "policies" in line:
            continue
        job = line["job"]
        if "state" in line:
            state = JobState.model_validate(line["state"]) if line["state"] is not None else None
            if state is not None and line["plan"] is not None:
                state.plan = Plan.model_validate(line["plan"])
            states[job] = state
            continue
        new, _ = reducer.step(states.get(job), EVENT.validate_python(line["event"]), line["now"])
        if line["plan"] is not None:
            recorded = Plan.model_validate(line["plan"])
            pairs.append((recorded, new.plan if new is not None else None))
            if new is not None:
                new.plan = recorded  # what the service stamped, for the steps that follow
        states[job] = new
    return pairs

"""Restart recovery on one node: which workers a new generation ends and starts.

An unmodified torchrun script cannot re-form its process group, so every member of a
new generation is a fresh process, started for it (as torchrun's agent restarts its
worker group); :func:`members_to_restart` says which of the node's workers that
means, :func:`end_then_start` ends the old ones and then starts the new.
"""

from __future__ import annotations

from collections.abc import Callable

from phalanx.contract import NodePlan, Role
from phalanx.launcher.children import Worker, end_all


def members_to_restart(workers: dict[str, Worker], plan: NodePlan) -> tuple[list[Worker], list[str]]:
    """The live workers to end (marked ``restarting``) and the members to start for ``plan``.

    A rank still waiting for its first plan takes this one (``generation`` 0 -> the
    plan's); a worker already running it, or that ran it to its end, stays as it is;
    every other member -- one of an older generation, a spare given a rank -- is ended
    and started afresh, as is a member with no live process.
    """
    stale: list[Worker] = []
    start: list[str] = []
    for name in plan.ranks:
        w = workers.get(name)
        alive = w is not None and w.proc.poll() is None
        if w is not None and alive and w.generation == 0:
            w.generation = plan.generation
        if w is not None and w.generation == plan.generation:
            continue
        if w is not None and alive:
            w.restarting = True
            stale.append(w)
        start.append(name)
    return stale, start


async def end_then_start(
    stale: list[Worker], grace_s: float, current: Callable[[], bool], start: Callable[[], None]
) -> None:
    """End ``stale`` (:func:`~phalanx.launcher.children.end_all`); then call ``start`` if
    the plan is still ``current`` (a newer one restarts them itself)."""
    for w in stale:
        if w.role is Role.SPARE:
            w.proc.kill()  # it never ran the script: nothing to let it finish
    await end_all([w.proc for w in stale], grace_s)
    if current():
        start()

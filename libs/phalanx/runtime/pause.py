"""``job.pause(max_s)``: a part of a step where the ranks may drift up to ``max_s``
seconds apart -- rank 0's evaluation pass or ``torch.save`` while the others wait
for it. Every rank enters it at the same point of the same step, as it would a
collective::

    if (step + 1) % 500 == 0:
        with job.pause(max_s=120):
            if job.rank == 0:
                evaluate(model.module)

Why it is needed: a rank that stays in compute while its peers wait for it in a
collective is judged by their pace (the failure detector's straggler rule), and a
gradient all-reduce waits only a few of its recent durations; a pause one rank takes
alone is a hang to both.

Inside, the rank reports itself in a collective bounded by ``max_s`` (so the rank
that takes longest is no straggler); on leaving, it waits for every member under
what is left of that bound, on the generation's communicator. A rank still inside
once its peers gave up is judged hung (``collective_hang``), a stopped or dead one
is found as anywhere else (its peers' wait ends when the plan reaches them), and a
failed wait is recovered from after the step, which stands. The pause is left out
of the step's time, so the learned bounds stay those of training.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from phalanx.contract import Phase
from phalanx.runtime.comm import CommError

if TYPE_CHECKING:
    from phalanx.runtime.session import Member


class Pauses:
    """One rank's pauses in the step in flight (:meth:`begin` .. :meth:`end`): how long
    they took (left out of the step's time) and the error of a wait that failed
    (recovered from after the step). Outside a step, a pause does nothing."""

    def __init__(self, job: Member) -> None:
        self.job = job
        self.seconds = 0.0
        self.failed: CommError | None = None
        self._step: int | None = None  # the step in flight
        self._floor_s = 0.0

    def begin(self, step: int, floor_s: float) -> None:
        """Step ``step`` starts; the wait at a pause's end takes at least ``floor_s``."""
        self.seconds, self.failed, self._step, self._floor_s = 0.0, None, step, floor_s

    def end(self) -> None:
        self._step = None

    def pause(self, max_s: float) -> contextlib.AbstractContextManager[None]:
        """One pause of at most ``max_s`` seconds (the module doc)."""
        if not max_s > 0:
            raise ValueError(f"job.pause(max_s={max_s!r}): max_s must be > 0 seconds")
        return contextlib.nullcontext() if self._step is None else self._pause(max_s, self._step)

    @contextlib.contextmanager
    def _pause(self, max_s: float, step: int) -> Iterator[None]:
        job, start = self.job, time.perf_counter()
        enter = functools.partial(job.status.enter_collective, max_s)
        enter()
        if job.faults.fire(job.worker, "pause", step, enter_collective=enter):  # PHALANX_FAULTS pause=N
            job.comm.release()  # an injected break: the wait below fails
        try:
            yield
        except BaseException:
            job.status.enter(Phase.COMPUTE)
            raise
        try:
            left = max_s - (time.perf_counter() - start)
            job.comm.barrier(left if left > self._floor_s else self._floor_s)
        except CommError as err:
            if self.failed is None:
                self.failed = err
        finally:
            self.seconds += time.perf_counter() - start
            job.status.enter(Phase.COMPUTE)

"""The grammars of the settings that are more than a number or a name.

Here, below everything that uses them, so that a bad value is refused when a process
reads its settings, and the checkpoint tiers (:class:`RetentionPolicy`) and the fault
injector (:class:`Fault`) take the parsed value instead of parsing again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_JOB = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FAULT = re.compile(
    r"^(kill|stop|stall|exit|break|wedge):([A-Za-z0-9_-]+)@(step|reduce|recovery|rendezvous|transfer|collective)=(\d+)$"
)
_NOT_AT_RECOVERY = ("wedge",)  # wedge: inside a collective (a step's, a rendezvous', a transfer's)


def parse_job_uids(text: str) -> dict[str, int]:
    """``job=uid[,job=uid...]`` (``PHALANX_CKPT_JOB_UIDS``): the uid each job's ranks run
    as on this node, which must own its directories; a ValueError saying what is wrong.

    >>> parse_job_uids("sample=20001, eval=20002")
    {'sample': 20001, 'eval': 20002}
    """
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        job, sep, uid = part.partition("=")
        if not sep or not _JOB.match(job.strip()) or not uid.strip().isdigit() or job.strip() in out:
            raise ValueError(f"job uids {text!r}: expected 'job=uid[,job=uid...]', got {part!r}")
        out[job.strip()] = int(uid)
    return out


@dataclass(frozen=True)
class RetentionPolicy:
    """Which checkpoints a tier keeps (``PHALANX_CKPT_KEEP_*``): the newest ``keep_last``,
    and every one whose step is a multiple of ``keep_every`` (0: none such).

    >>> RetentionPolicy.parse("last=2,every=100").expired([0, 50, 100, 150, 200, 250])
    [50, 150]
    >>> RetentionPolicy.parse("3").expired([1, 2, 3, 4])
    [1]
    """

    keep_last: int
    keep_every: int = 0

    def __post_init__(self) -> None:
        if self.keep_last < 1 or self.keep_every < 0:
            raise ValueError(f"retention keeps at least the newest 1 and every >= 0, got {self}")

    @classmethod
    def parse(cls, text: str) -> RetentionPolicy:
        """``N`` or ``last=N[,every=M]``; a ValueError saying what is wrong otherwise."""
        fields: dict[str, int] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep:
                key, value = "last", key
            if key not in ("last", "every") or key in fields:
                raise ValueError(f"retention {text!r}: expected 'N' or 'last=N,every=M'")
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"retention {text!r}: {value!r} is not a whole number") from None
        if "last" not in fields:
            raise ValueError(f"retention {text!r}: 'last=N' is required")
        try:
            return cls(fields["last"], fields.get("every", 0))
        except ValueError as exc:
            raise ValueError(f"retention {text!r}: {exc}") from None

    def expired(self, steps: list[int]) -> list[int]:
        ordered = sorted(set(steps))
        keep = set(ordered[-self.keep_last :])
        if self.keep_every:
            keep |= {s for s in ordered if s % self.keep_every == 0}
        return [s for s in ordered if s not in keep]


@dataclass(frozen=True)
class Fault:
    """One fault to strike (``PHALANX_FAULTS``; :mod:`phalanx.runtime.faults` strikes it)."""

    action: str
    worker: str
    point: str
    value: int


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """``action:worker@point=N``, comma-separated (points: ``step``, ``reduce``, ``recovery``,
    ``rendezvous``, ``transfer``, ``collective``: :mod:`phalanx.runtime.faults`); a
    ValueError naming the bad entry (``wedge`` strikes inside a collective, never at
    ``recovery``).

    >>> parse_faults("kill:w2@step=5, stop:w1@recovery=2")
    (Fault(action='kill', worker='w2', point='step', value=5), Fault(action='stop', worker='w1', point='recovery', value=2))
    """
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = _FAULT.match(part)
        if not m or (m[1] in _NOT_AT_RECOVERY and m[3] == "recovery"):
            raise ValueError(
                f"bad fault {part!r}: want action:worker@step=N, @reduce=N, or @recovery=G, @rendezvous=G,"
                " @transfer=G, @collective=G (wedge: not at recovery)"
            )
        faults.append(Fault(m[1], m[2], m[3], int(m[4])))
    return tuple(faults)

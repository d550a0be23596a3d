"""The grammars of the settings that are more than a number or a name.

Here, below everything that uses them, so that a bad value is refused when a process
reads its settings, and the checkpoint tiers (:class:`TierPolicy`, :class:`RetentionPolicy`)
and the fault injector (:class:`Fault`) take the parsed value instead of parsing again.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

_JOB = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FAULT = re.compile(
    r"^(kill|stop|stall|spin|exit|break|wedge):([A-Za-z0-9_-]+)@(step|reduce|pause|recovery|rendezvous|transfer|collective)=(\d+)$"
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
    """Which checkpoints a tier keeps (its ``last`` and ``pin`` in :class:`TierPolicy`): the
    newest ``keep_last``, and every one whose step is a multiple of ``keep_every`` (0: none
    such).

    >>> RetentionPolicy(2, 100).expired([0, 50, 100, 150, 200, 250])
    [50, 150]
    >>> RetentionPolicy(3).expired([1, 2, 3, 4])
    [1]
    """

    keep_last: int
    keep_every: int = 0

    def __post_init__(self) -> None:
        if self.keep_last < 1 or self.keep_every < 0:
            raise ValueError(f"retention keeps at least the newest 1 and every >= 0, got {self}")

    def expired(self, steps: list[int]) -> list[int]:
        ordered = sorted(set(steps))
        keep = set(ordered[-self.keep_last :])
        if self.keep_every:
            keep |= {s for s in ordered if s % self.keep_every == 0}
        return [s for s in ordered if s not in keep]


TIERS = ("memory", "disk", "shared", "object")
"""The checkpoint tiers by name (:class:`phalanx.checkpoint.tiers.Tier`): ``memory``, then
the durable ones in drain order (``DRAIN_ORDER``)."""
DEFAULT_LAST = {"memory": 2, "disk": 5, "shared": 5, "object": 3}
"""How many of the newest checkpoints a tier keeps unless the policy says (its ``last``)."""
_FIELDS = ("every", "last", "pin")


@dataclass(frozen=True)
class TierRule:
    """One tier's part of a :class:`TierPolicy`: it takes each checkpoint whose step is a
    multiple of ``every`` and keeps what ``retention`` says."""

    every: int
    retention: RetentionPolicy

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"a tier takes a checkpoint every >= 1 steps, got every={self.every}")

    @classmethod
    def default(cls, tier: str) -> TierRule:
        """What a tier the policy does not name gets: every checkpoint, today's retention."""
        return cls(1, RetentionPolicy(DEFAULT_LAST[tier]))


@dataclass(frozen=True)
class TierPolicy:
    """Which checkpoints go to which tier, and what each tier keeps
    (``PHALANX_CKPT_TIERS``), in one value checked when a keeper or a rank starts.

    ``tier:field=N[,field=N...]``, one entry per tier, separated by ``;``; the fields:

    - ``every=N``: the tier takes a checkpoint only when its step is a multiple of N
      (default 1: every one). Memory's is the ranks' snapshot interval
      (:attr:`snapshot_every`); a durable tier's must be a multiple of memory's;
    - ``last=N``: the tier keeps the newest N it took (defaults: memory 2, disk 5,
      shared 5, object 3);
    - ``pin=M``: and keeps, besides, every one whose step is a multiple of M (a
      multiple of the tier's ``every``; default: none; durable tiers only: memory keeps
      only its newest).

    A tier the policy does not name takes every checkpoint and keeps its default; unset,
    the policy is today's behaviour: every checkpoint to every configured tier.

    >>> p = TierPolicy.parse("memory:every=50,last=2; disk:every=200,last=5; object:every=1000,last=3,pin=10000")
    >>> p.snapshot_every, p.tiers_for(400, ["disk", "shared", "object"]), p.tiers_for(1000, ["disk", "object"])
    (50, ('disk', 'shared'), ('disk', 'object'))
    >>> p.retention()["object"], p.retention()["shared"]
    (RetentionPolicy(keep_last=3, keep_every=10000), RetentionPolicy(keep_last=5, keep_every=0))
    >>> str(p)
    'memory:every=50,last=2; disk:every=200,last=5; object:every=1000,last=3,pin=10000'
    >>> TierPolicy.parse("disk:every=75; memory:every=50")
    Traceback (most recent call last):
    ...
    ValueError: tier policy: disk's every=75 is not a multiple of memory's every=50 (ranks snapshot only every 50 steps)
    """

    rules: tuple[tuple[str, TierRule], ...] = ()
    """The tiers the policy names, each with its rule, in :data:`TIERS` order."""

    def __post_init__(self) -> None:
        named = [tier for tier, _ in self.rules]
        for tier in named:
            if tier not in TIERS:
                raise ValueError(f"tier policy: unknown tier {tier!r} (the tiers: {', '.join(TIERS)})")
            if named.count(tier) > 1:
                raise ValueError(f"tier policy: {tier} is named twice")
        object.__setattr__(self, "rules", tuple(sorted(self.rules, key=lambda r: TIERS.index(r[0]))))
        memory = self.rule("memory")
        if memory.retention.keep_every:
            raise ValueError(
                f"tier policy: memory's pin={memory.retention.keep_every}: memory keeps only its newest"
                " (pin checkpoints in a durable tier)"
            )
        for tier, rule in self.rules:
            if tier != "memory" and rule.every % memory.every:
                raise ValueError(
                    f"tier policy: {tier}'s every={rule.every} is not a multiple of memory's every={memory.every}"
                    f" (ranks snapshot only every {memory.every} steps)"
                )
            pin = rule.retention.keep_every
            if pin and pin % rule.every:
                raise ValueError(
                    f"tier policy: {tier}'s pin={pin} is not a multiple of its every={rule.every}"
                    " (it takes no other steps to pin)"
                )

    @classmethod
    def parse(cls, text: str) -> TierPolicy:
        """``tier:field=N[,field=N...][; ...]``; a ValueError naming the bad entry and why."""
        rules: list[tuple[str, TierRule]] = []
        for entry in filter(None, (e.strip() for e in text.split(";"))):
            tier, sep, body = (x.strip() for x in entry.partition(":"))
            if not sep or not body:
                raise ValueError(
                    f"tier policy: {entry!r}: expected 'tier:field=N[,field=N...]' (fields: {', '.join(_FIELDS)})"
                )
            if tier not in TIERS:
                raise ValueError(
                    f"tier policy: {entry!r}: unknown tier {tier!r} (the tiers: {', '.join(TIERS)})"
                )
            if any(t == tier for t, _ in rules):
                raise ValueError(f"tier policy: {entry!r}: {tier} is named twice")
            fields: dict[str, int] = {}
            for part in (p.strip() for p in body.split(",")):
                key, sep, value = (x.strip() for x in part.partition("="))
                if not sep:
                    raise ValueError(f"tier policy: {entry!r}: {part!r} is not field=N")
                if key not in _FIELDS:
                    raise ValueError(
                        f"tier policy: {entry!r}: unknown field {key!r} (the fields: {', '.join(_FIELDS)})"
                    )
                if key in fields:
                    raise ValueError(f"tier policy: {entry!r}: {key} is given twice")
                if not (value.isascii() and value.isdigit()) or int(value) < 1:
                    raise ValueError(f"tier policy: {entry!r}: {key}={value!r} is not a whole number >= 1")
                fields[key] = int(value)
            retention = RetentionPolicy(fields.get("last", DEFAULT_LAST[tier]), fields.get("pin", 0))
            rules.append((tier, TierRule(fields.get("every", 1), retention)))
        if not rules:
            raise ValueError(
                f"tier policy {text!r} names no tier: expected 'tier:field=N[,field=N...][; ...]'"
            )
        return cls(tuple(rules))

    def __str__(self) -> str:
        """The policy in its grammar (what :meth:`parse` reads back)."""
        entries = []
        for tier, rule in self.rules:
            fields = [f"every={rule.every}"] if rule.every != 1 else []
            fields.append(f"last={rule.retention.keep_last}")
            if rule.retention.keep_every:
                fields.append(f"pin={rule.retention.keep_every}")
            entries.append(f"{tier}:{','.join(fields)}")
        return "; ".join(entries)

    @property
    def named(self) -> tuple[str, ...]:
        """The tiers the policy names (the others get :meth:`TierRule.default`)."""
        return tuple(tier for tier, _ in self.rules)

    def rule(self, tier: str) -> TierRule:
        """``tier``'s rule: the policy's, else the default."""
        return next((rule for t, rule in self.rules if t == tier), None) or TierRule.default(tier)

    @property
    def snapshot_every(self) -> int | None:
        """Memory's ``every``, the interval at which ranks snapshot; None when the policy
        does not name one (the ranks' own interval stands, ``job.checkpoint(every)``)."""
        return next((rule.every for t, rule in self.rules if t == "memory"), None)

    def tiers_for(self, step: int, configured: Iterable[str]) -> tuple[str, ...]:
        """The durable tiers, of those ``configured``, a checkpoint of ``step`` goes to, in
        drain order (``disk``, ``shared``, ``object``): each whose ``every`` divides the step."""
        have = {str(t) for t in configured}
        return tuple(t for t in TIERS[1:] if t in have and step % self.rule(t).every == 0)

    def check_interval(self, every: int) -> None:
        """A ValueError when ranks snapshotting every ``every`` steps would not give each
        durable tier the steps it asks for (its ``every`` is not a multiple of theirs).

        >>> TierPolicy.parse("disk:every=200").check_interval(30)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: the job snapshots every 30 steps, but PHALANX_CKPT_TIERS has disk take every 200th step: ...
        """
        for tier in TIERS[1:]:
            want = self.rule(tier).every  # 1: every checkpoint the keeper gets, whatever the interval
            if want > 1 and want % every:
                raise ValueError(
                    f"the job snapshots every {every} steps, but PHALANX_CKPT_TIERS has {tier} take every"
                    f" {want}th step: it would get one every {math.lcm(want, every)}; make the job's"
                    f" interval divide {want}, or change the policy"
                )

    def retention(self) -> dict[str, RetentionPolicy]:
        """What each tier keeps, every tier (those not named: their default)."""
        return {tier: self.rule(tier).retention for tier in TIERS}

    def check(self, configured: Iterable[str]) -> None:
        """A ValueError when the policy names a durable tier not in ``configured`` (memory
        always is): a rule for a tier a keeper lacks is a mistake, not a no-op."""
        have = {str(t) for t in configured}
        missing = [t for t in self.named if t != "memory" and t not in have]
        if missing:
            raise ValueError(
                f"tier policy names {', '.join(missing)}, which this keeper does not configure"
                f" (set {', '.join('PHALANX_CKPT_' + t.upper() for t in missing)} or drop it from the policy)"
            )


_UNITS = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9}


def parse_drain_lanes(text: str) -> tuple[tuple[str, ...], ...]:
    """``PHALANX_CKPT_DRAIN``: the durable tiers in lanes that drain side by side, lanes
    separated by ``|``, the tiers of a lane (drained in order) by ``,``; each of disk,
    shared and object exactly once.

    >>> parse_drain_lanes("object | disk, shared")
    (('object',), ('disk', 'shared'))
    """
    lanes = tuple(tuple(t.strip() for t in lane.split(",") if t.strip()) for lane in text.split("|"))
    named = [t for lane in lanes for t in lane]
    durable = TIERS[1:]
    if any(not lane for lane in lanes):
        raise ValueError(f"drain lanes {text!r}: an empty lane")
    bad = [t for t in named if t not in durable]
    if bad:
        raise ValueError(f"drain lanes {text!r}: {bad[0]!r} is not a durable tier ({', '.join(durable)})")
    if len(named) != len(set(named)) or set(named) != set(durable):
        raise ValueError(f"drain lanes {text!r}: name each of {', '.join(durable)} exactly once")
    return lanes


def parse_rates(text: str) -> dict[str, float]:
    """``PHALANX_CKPT_RATE``: a cap in bytes/s per durable tier, ``tier=N[K|M|G]`` separated
    by ``,`` (a tier not named: no cap).

    >>> parse_rates("disk=400M, object=1.5G")
    {'disk': 400000000.0, 'object': 1500000000.0}
    """
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        tier, sep, value = (x.strip() for x in part.partition("="))
        if not sep or tier not in TIERS[1:] or tier in out:
            raise ValueError(
                f"drain rates {text!r}: expected 'tier=N[K|M|G],...' (disk, shared, object), got {part!r}"
            )
        unit = value[-1:].upper() if value[-1:].upper() in _UNITS else ""
        try:
            rate = float(value[: len(value) - len(unit)] if unit else value) * _UNITS[unit]
        except ValueError:
            raise ValueError(f"drain rates {text!r}: {value!r} is not a rate (N[K|M|G] bytes/s)") from None
        if not rate > 0 or rate == float("inf"):
            raise ValueError(f"drain rates {text!r}: {value!r} must be a finite rate > 0")
        out[tier] = rate
    return out


@dataclass(frozen=True)
class Fault:
    """One fault to strike (``PHALANX_FAULTS``; :mod:`phalanx.runtime.faults` strikes it)."""

    action: str
    worker: str
    point: str
    value: int


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """``action:worker@point=N``, comma-separated (points: ``step``, ``reduce``, ``pause``,
    ``recovery``, ``rendezvous``, ``transfer``, ``collective``: :mod:`phalanx.runtime.faults`); a
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
                f"bad fault {part!r}: want action:worker@step=N, @reduce=N, @pause=N, or @recovery=G, @rendezvous=G,"
                " @transfer=G, @collective=G (wedge: not at recovery)"
            )
        faults.append(Fault(m[1], m[2], m[3], int(m[4])))
    return tuple(faults)

"""Where every checkpoint copy is, in the ``phalanx_ckpt`` KV bucket.

Keys (one writer each: the keeper that holds the copy, or that wrote it to a
shared tier)::

    <job>.<step:012d>.manifest              the manifest (JSON), put before any copy is complete
    <job>.<step:012d>.<tier>.<node>         {"state", "bytes", "at", "addr", "by"} of one copy
    <job>.<step:012d>.takeover              {"node", "origin", "state", "at"}: who finishes its drain
    <job>.<step:012d>.removed               {"job", "step", "created", "at", "by"}: removed by an operator
    <job>.<step:012d>.replicas              {"wanted", "made", "error", ...}: replicas still missing
    =keeper.<node>                          {"addr", "at"}: how peers reach that node's keeper

``<node>`` is ``-`` for the shared and object tiers (one copy for every node); ``by`` is
the node whose keeper wrote the record (for a shared or object copy: who drained it,
the origin's keeper or the one that took its drain over). A keeper refreshes its
``=keeper`` registration (a new ``at``) every :attr:`KeeperConfig.refresh_s`; the
``takeover`` key is a claim made by a KV create or compare-and-set
(:mod:`phalanx.checkpoint.takeover`), never by a plain put.
The ``removed`` key is a tombstone ``phalanx ckpt rm`` writes (the one key a keeper
does not write) before it deletes the manifest; every keeper then removes its copies
(:mod:`phalanx.checkpoint.removal`).
The ``replicas`` key is its origin keeper's while a checkpoint has fewer peer replicas
than it wants (:class:`ReplicasShort`, :mod:`phalanx.checkpoint.replicas`); deleted
once they exist, or once the origin no longer holds the checkpoint to send.
A deleted copy is a deleted key. Operators and policies read the bucket (or
watch it); the events on ``phalanx.evt.<job>.checkpoint`` say the same as it
happens.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from phalanx.bus import Bucket, Bus, Conflict
from phalanx.bus.keywatch import KeyWatch
from phalanx.checkpoint.manifest import Manifest, ManifestError
from phalanx.checkpoint.tiers import Tier, step_key
from phalanx.contract.streams import CKPT_BUCKET
from phalanx.telemetry import get_logger

SHARED_NODE = "-"
COMPLETE: Final = "complete"
log = get_logger(component="checkpoint-catalog")
_JOB = re.compile(r"^[A-Za-z0-9_-]{1,64}(=r(0|[1-9][0-9]{0,8}))?$")  # as a manifest's job


def is_job_name(name: str) -> bool:
    """Whether ``name`` is a job a manifest may name (a job, or a part ``<job>=r<rank>``)."""
    return bool(_JOB.match(name))


@dataclass(frozen=True)
class Copy:
    tier: Tier
    node: str  # SHARED_NODE for the shared and object tiers
    state: str
    bytes: int
    addr: str = ""
    by: str = ""  # the node whose keeper wrote this record ("": written before records said)
    at: float = 0.0  # when the record was written (time.time() of its keeper)


@dataclass(frozen=True)
class Registration:
    """A keeper's ``=keeper.<node>`` record: where it is, and when it last said so."""

    node: str
    addr: str
    at: float  # the keeper's time.time() at its last refresh


@dataclass(frozen=True)
class Claim:
    """Who finishes the drain of a checkpoint whose origin keeper was lost."""

    node: str  # the claimer
    origin: str  # the lost keeper whose drain it finishes
    state: str  # DRAINING, then DONE
    at: float
    revision: int = 0  # the key's KV revision (what a compare-and-set names)


DRAINING: Final = "draining"
DONE: Final = "done"
REMOVED: Final = "removed"


@dataclass(frozen=True)
class Removed:
    """A checkpoint an operator removed (``phalanx ckpt rm``): its tombstone. ``created``
    (its manifest's) tells it from a later save of the same step, which is left alone."""

    job: str
    step: int
    created: float
    at: float = 0.0
    by: str = ""

    def of(self, m: Manifest) -> bool:
        """Whether ``m`` is the manifest of the removed checkpoint."""
        return (m.job, m.step, m.created) == (self.job, self.step, self.created)

    def encode(self) -> bytes:
        return msgpack.packb(
            {"job": self.job, "step": self.step, "created": self.created, "at": self.at, "by": self.by}
        )

    @classmethod
    def parse(cls, raw: bytes) -> Removed | None:
        """The tombstone in ``raw`` (None: not one, logged). It names its checkpoint itself:
        a watch of ``*.*.removed`` sees values, not keys."""
        try:
            v = msgpack.unpackb(raw, raw=False)
            t = cls(str(v["job"]), int(v["step"]), float(v["created"]), float(v["at"]), str(v["by"]))
        except (ValueError, KeyError, TypeError, msgpack.ExtraData) as exc:
            log.warning("tombstone_bad", error=str(exc))
            return None
        if not is_job_name(t.job) or t.step < 0:
            log.warning("tombstone_bad", job=t.job[:80], step=t.step)
            return None
        return t


REPLICAS: Final = "replicas"


@dataclass(frozen=True)
class ReplicasShort:
    """A checkpoint with fewer peer replicas than its origin keeper (``by``) wants: the
    peers that hold one, the last error, and since when it is short. Rewritten only when
    what it says changes, not on every retry."""

    wanted: int
    made: tuple[str, ...] = ()
    error: str = ""
    by: str = ""
    since: float = 0.0

    @property
    def missing(self) -> int:
        return max(0, self.wanted - len(self.made))

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "wanted": self.wanted,
                "made": list(self.made),
                "error": self.error[:500],
                "by": self.by,
                "since": self.since,
            }
        )

    @classmethod
    def parse(cls, key: str, raw: bytes) -> ReplicasShort | None:
        try:
            v = msgpack.unpackb(raw, raw=False)
            made = tuple(str(n) for n in v["made"])
            return cls(int(v["wanted"]), made, str(v["error"]), str(v["by"]), float(v["since"]))
        except (ValueError, KeyError, TypeError, msgpack.ExtraData) as exc:
            log.warning("record_bad", key=key, error=str(exc))
            return None


@dataclass
class Entry:
    """One checkpoint: its manifest, every copy the catalog knows of, and the claim of
    the keeper that took its drain over, if one did."""

    job: str
    step: int
    manifest: Manifest | None = None
    copies: list[Copy] = field(default_factory=list)
    takeover: Claim | None = None
    removed: Removed | None = None  # an operator removed it (phalanx ckpt rm)
    replicas: ReplicasShort | None = None  # replicas its origin has not made yet

    def complete(self) -> list[Copy]:
        return [c for c in self.copies if c.state == COMPLETE]

    def tiers(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for c in self.complete():
            out.setdefault(c.tier.value, []).append(c.node)
        return out


class Catalog:
    def __init__(self, kv: Bucket) -> None:
        self.kv = kv

    @classmethod
    async def open(cls, bus: Bus, *, create: bool = True, timeout_s: float | None = None) -> Catalog:
        """The catalog (``create``: the bucket made if missing; else ``nats.js.errors.NotFoundError``)."""
        return cls(await bus.kv.bucket(CKPT_BUCKET, create=create, timeout_s=timeout_s))

    async def put_manifest(self, m: Manifest) -> None:
        await self.kv.put(f"{m.job}.{step_key(m.step)}.manifest", m)

    async def manifest(self, job: str, step: int) -> Manifest | None:
        """The manifest committed for ``job@step`` (None: none, deleted, or unreadable: logged)."""
        key = f"{job}.{step_key(step)}.manifest"
        entry = await self.kv.get(key)
        if entry is None or not entry.value:
            return None
        try:
            return Manifest.parse(entry.value, f"{CKPT_BUCKET}/{key}")
        except ManifestError as exc:
            log.warning("manifest_bad", key=key, error=str(exc))
            return None

    async def record(
        self,
        job: str,
        step: int,
        tier: Tier,
        node: str,
        state: str,
        nbytes: int,
        addr: str = "",
        by: str = "",
    ) -> None:
        value = {"state": state, "bytes": nbytes, "at": time.time(), "addr": addr, "by": by}
        await self.kv.put(f"{job}.{step_key(step)}.{tier.value}.{node}", msgpack.packb(value))

    async def forget(self, job: str, step: int, tier: Tier, node: str) -> None:
        await self.kv.delete(f"{job}.{step_key(step)}.{tier.value}.{node}")

    async def replicas_short(self, job: str, step: int, short: ReplicasShort) -> None:
        await self.kv.put(f"{job}.{step_key(step)}.{REPLICAS}", short.encode())

    async def replicas_made(self, job: str, step: int) -> None:
        await self.kv.delete(f"{job}.{step_key(step)}.{REPLICAS}")

    async def forget_manifest(self, job: str, step: int) -> None:
        await self.kv.delete(f"{job}.{step_key(step)}.manifest")

    # -- removal by an operator (phalanx ckpt rm; phalanx.checkpoint.removal) ----------------
    async def mark_removed(self, m: Manifest, by: str) -> Removed:
        """Write the tombstone of ``m``'s checkpoint (before its manifest is deleted)."""
        t = Removed(m.job, m.step, m.created, time.time(), by)
        await self.kv.put(f"{m.job}.{step_key(m.step)}.{REMOVED}", t.encode())
        return t

    async def remove_manifest(self, job: str, step: int, created: float) -> bool:
        """Delete the manifest of ``job@step`` if it is still the one made at ``created``
        (compare-and-set on its revision): True when it is gone, False when another
        manifest (a later save of that step) is there now, which is kept."""
        key = f"{job}.{step_key(step)}.manifest"
        for _ in range(5):
            entry = await self.kv.get(key)
            if entry is None or not entry.value:
                return True
            try:
                if Manifest.parse(entry.value, f"{CKPT_BUCKET}/{key}").created != created:
                    return False
            except ManifestError:
                return False
            try:
                await self.kv.delete(key, last=entry.revision)
                return True
            except Conflict:  # rewritten meanwhile (the same manifest, re-put by a keeper?): again
                continue
        return False

    async def removals(self) -> dict[tuple[str, int], Removed]:
        """Every tombstone, by (job, step)."""
        out: dict[tuple[str, int], Removed] = {}
        for raw in (await self._scan(f"*.*.{REMOVED}", raw=True)).values():
            t = Removed.parse(raw)
            if t is not None:
                out[(t.job, t.step)] = t
        return out

    async def watch(self, pattern: str) -> KeyWatch:
        """Watch the keys matching ``pattern`` (their latest values, then every change).
        The entries carry the pattern, not their keys: values must say what they are."""
        return await self.kv.watch(pattern)

    async def register_keeper(self, node: str, addr: str) -> None:
        await self.kv.put(f"=keeper.{node}", msgpack.packb({"addr": addr, "at": time.time()}))

    async def keepers(self) -> dict[str, str]:
        return {
            k.split(".", 1)[1]: str(v.get("addr", "")) for k, v in (await self._scan("=keeper.>")).items()
        }

    async def registration(self, node: str) -> Registration | None:
        """``node``'s keeper registration (None: none, or unreadable: logged)."""
        key = f"=keeper.{node}"
        entry = await self.kv.get(key)
        if entry is None or not entry.value:
            return None
        try:
            v = msgpack.unpackb(entry.value, raw=False)
            return Registration(node, str(v.get("addr", "")), float(v.get("at", 0.0)))
        except (ValueError, TypeError, AttributeError, msgpack.ExtraData) as exc:
            log.warning("registration_bad", key=key, error=str(exc))
            return None

    # -- takeover claims (phalanx.checkpoint.takeover) ---------------------------------------
    async def claim(self, job: str, step: int, node: str, origin: str, *, last: int | None = None) -> int:
        """Claim the drain of ``job@step`` (origin ``origin``) for ``node``, state DRAINING:
        a KV create, or -- ``last`` given -- a compare-and-set on that revision of the claim
        (taking over a claim whose claimer is lost, or renewing one's own). Returns the new
        revision; :class:`phalanx.bus.Conflict` when another claim got there first."""
        value = _claim_value(node, origin, DRAINING)
        key = _claim_key(job, step)
        if last is None:
            return await self.kv.create(key, value)
        return await self.kv.update(key, value, last=last)

    async def claim_done(self, job: str, step: int, node: str, origin: str, *, last: int) -> int:
        """Mark ``node``'s claim (at revision ``last``) DONE; :class:`phalanx.bus.Conflict` if it moved on."""
        return await self.kv.update(_claim_key(job, step), _claim_value(node, origin, DONE), last=last)

    async def unclaim(self, job: str, step: int, *, last: int) -> None:
        """Delete the claim (at revision ``last``) for another keeper to make;
        :class:`phalanx.bus.Conflict` if it moved on."""
        await self.kv.delete(_claim_key(job, step), last=last)

    async def claim_of(self, job: str, step: int) -> Claim | None:
        """The current claim on ``job@step``'s drain (None: none, or unreadable: logged)."""
        entry = await self.kv.get(_claim_key(job, step))
        if entry is None or not entry.value:
            return None
        return _parse_claim(_claim_key(job, step), entry.value, entry.revision)

    async def copies_on(self, node: str) -> list[tuple[str, int, Tier]]:
        """(job, step, tier) of every copy the catalog says ``node`` holds."""
        out = []
        for key in await self._scan(">", raw=True):
            parts = key.split(".")
            if (
                len(parts) == 4
                and parts[3] == node
                and parts[1].isdigit()
                and parts[2] in Tier.__members__.values()
            ):
                out.append((parts[0], int(parts[1]), Tier(parts[2])))
        return out

    async def entries(self, job: str) -> dict[int, Entry]:
        """Every checkpoint of ``job`` the catalog knows, by step."""
        out: dict[int, Entry] = {}
        for key, value in (await self._scan(f"{job}.>", raw=True)).items():
            parts = key.split(".")
            if len(parts) < 3 or not parts[1].isdigit():
                continue
            step = int(parts[1])
            e = out.setdefault(step, Entry(job, step))
            if parts[2] == "manifest" and len(parts) == 3:
                try:
                    e.manifest = Manifest.parse(value, f"{CKPT_BUCKET}/{key}")
                except ManifestError as exc:
                    log.warning("manifest_bad", key=key, error=str(exc))
            elif parts[2] == "takeover" and len(parts) == 3:
                e.takeover = _parse_claim(key, value, 0)
            elif parts[2] == REMOVED and len(parts) == 3:
                e.removed = Removed.parse(value)
            elif parts[2] == REPLICAS and len(parts) == 3:
                e.replicas = ReplicasShort.parse(key, value)
            elif len(parts) == 4 and parts[2] in Tier.__members__.values():
                try:
                    rec = msgpack.unpackb(value, raw=False)
                    e.copies.append(
                        Copy(
                            Tier(parts[2]),
                            parts[3],
                            str(rec["state"]),
                            int(rec["bytes"]),
                            str(rec.get("addr", "")),
                            str(rec.get("by", "")),
                            float(rec.get("at", 0.0)),
                        )
                    )
                except (ValueError, KeyError, TypeError, msgpack.ExtraData) as exc:
                    log.warning("record_bad", key=key, error=str(exc))
        return out

    async def _scan(self, pattern: str, raw: bool = False) -> dict[str, Any]:
        """The current value of every key matching ``pattern``."""
        values = await self.kv.latest(pattern)
        return values if raw else {k: msgpack.unpackb(v, raw=False) for k, v in values.items()}


def _claim_key(job: str, step: int) -> str:
    return f"{job}.{step_key(step)}.takeover"


def _claim_value(node: str, origin: str, state: str) -> bytes:
    return msgpack.packb({"node": node, "origin": origin, "state": state, "at": time.time()})


def _parse_claim(key: str, raw: bytes, revision: int) -> Claim | None:
    try:
        v = msgpack.unpackb(raw, raw=False)
        return Claim(str(v["node"]), str(v["origin"]), str(v["state"]), float(v["at"]), revision)
    except (ValueError, KeyError, TypeError, msgpack.ExtraData) as exc:
        log.warning("claim_bad", key=key, error=str(exc))
        return None

"""Where every checkpoint copy is, in the ``phalanx_ckpt`` KV bucket.

Keys (one writer each: the keeper that holds the copy, or that wrote it to a
shared tier)::

    <job>.<step:012d>.manifest              the manifest (JSON), put before any copy is complete
    <job>.<step:012d>.<tier>.<node>         {"state", "bytes", "at", "addr"} of one copy
    =keeper.<node>                          {"addr", "at"}: how peers reach that node's keeper

``<node>`` is ``-`` for the shared and object tiers (one copy for every node).
A deleted copy is a deleted key. Operators and policies read the bucket (or
watch it); the events on ``phalanx.evt.<job>.checkpoint`` say the same as it
happens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from phalanx.bus import Bucket, Bus
from phalanx.checkpoint.manifest import Manifest, ManifestError
from phalanx.checkpoint.tiers import Tier, step_key
from phalanx.contract.streams import CKPT_BUCKET
from phalanx.telemetry import get_logger

SHARED_NODE = "-"
COMPLETE: Final = "complete"
log = get_logger(component="checkpoint-catalog")


@dataclass(frozen=True)
class Copy:
    tier: Tier
    node: str  # SHARED_NODE for the shared and object tiers
    state: str
    bytes: int
    addr: str = ""


@dataclass
class Entry:
    """One checkpoint: its manifest and every copy the catalog knows of."""

    job: str
    step: int
    manifest: Manifest | None = None
    copies: list[Copy] = field(default_factory=list)

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
    async def open(cls, bus: Bus) -> Catalog:
        return cls(await bus.kv.bucket(CKPT_BUCKET, create=True))

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
        self, job: str, step: int, tier: Tier, node: str, state: str, nbytes: int, addr: str = ""
    ) -> None:
        value = msgpack.packb({"state": state, "bytes": nbytes, "at": time.time(), "addr": addr})
        await self.kv.put(f"{job}.{step_key(step)}.{tier.value}.{node}", value)

    async def forget(self, job: str, step: int, tier: Tier, node: str) -> None:
        await self.kv.delete(f"{job}.{step_key(step)}.{tier.value}.{node}")

    async def forget_manifest(self, job: str, step: int) -> None:
        await self.kv.delete(f"{job}.{step_key(step)}.manifest")

    async def register_keeper(self, node: str, addr: str) -> None:
        await self.kv.put(f"=keeper.{node}", msgpack.packb({"addr": addr, "at": time.time()}))

    async def keepers(self) -> dict[str, str]:
        return {
            k.split(".", 1)[1]: str(v.get("addr", "")) for k, v in (await self._scan("=keeper.>")).items()
        }

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
                        )
                    )
                except (ValueError, KeyError, TypeError, msgpack.ExtraData) as exc:
                    log.warning("record_bad", key=key, error=str(exc))
        return out

    async def _scan(self, pattern: str, raw: bool = False) -> dict[str, Any]:
        """The current value of every key matching ``pattern``."""
        values = await self.kv.latest(pattern)
        return values if raw else {k: msgpack.unpackb(v, raw=False) for k, v in values.items()}

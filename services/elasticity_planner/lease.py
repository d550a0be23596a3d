"""Leader election for planner replicas: a lease record in KV and a fencing token.

Every replica runs a :class:`Lease`. The leader renews the record
``planner-leader`` in the ``phalanx_jobs`` bucket every ``ttl_s / 3`` by
compare-and-set on its last revision; a standby watches the record's revision
and takes over, by compare-and-set on the revision it last saw, once that
revision has not moved for ``ttl_s``. Expiry is judged by each standby's own
clock against what it observed, so replicas on different hosts never compare
wall clocks.

The fencing token is the KV revision at which a replica acquired the lease.
Revisions of a bucket only grow, so a later leader always holds a higher token;
the planner writes it into every job record and every plan, and ranks refuse
plans with a lower token than one they have seen.

A standby need not wait out the TTL for a leader that is gone: with a ``probe``, it
asks the holder named in the record (:data:`~phalanx.contract.subjects.INSTANCE_HEALTH`,
which every planner answers from the moment it starts) at each step, and the server
answers "no responders" once the holder's connection is closed (its process killed,
its host's kernel closed the socket). Asked twice, ``confirm_s`` apart, and gone both
times, the holder is taken over at once, by the same compare-and-set on the revision
the standby saw. A holder that is only slow or cut off from the server (a partition:
the server still counts its connection) answers late or not at all, which is no
verdict: the TTL decides. A record without a ``presence`` (a planner from before
it answered) is never probed.

A leader counts itself leader only until ``ttl_s * 0.8`` after the last renewal
it *sent* that succeeded: a standby cannot take over before ``ttl_s`` after it
*saw* that renewal, which is later. Safety does not rest on this alone: every job
record is written by compare-and-set, and a record written by a higher token
makes a lower-token planner step down (:class:`NotLeader`).

>>> lease = Lease(kv, instance="planner-a", ttl_s=1.0)
>>> await lease.step()          # every ttl/3 while leading, lease.standby_every_s standing by
True
>>> lease.check()               # the fencing token, or NotLeader
4711
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable

import msgpack

from phalanx.bus import Bucket, Conflict
from phalanx.telemetry import get_logger

LEASE_KEY = "planner-leader"  # no dot: never a job's "<job>.plan"


Probe = Callable[[str], Awaitable[bool]]
"""Whether the planner answering ``presence`` is gone (its connection closed)."""


def presence(instance: str) -> str:
    """The token of ``instance``'s own subject (an instance name, ``host:pid:nonce``, may
    hold dots a subject token may not)."""
    return hashlib.sha256(instance.encode()).hexdigest()[:16]


class NotLeader(RuntimeError):
    """This replica does not (or no longer) hold the planner lease."""


class Lease:
    def __init__(
        self,
        kv: Bucket,
        instance: str,
        ttl_s: float = 1.0,
        *,
        probe: Probe | None = None,
        confirm_s: float = 0.02,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        self.kv = kv
        self.instance = instance
        self.ttl_s = ttl_s
        self.probe, self.confirm_s = probe, confirm_s
        self.token = 0  # the revision at which this replica acquired the lease (0: never)
        self._revision: int | None = None  # our last write while leader
        self._valid_until = 0.0  # monotonic
        self._seen: tuple[int, float] | None = None  # (revision, monotonic when first seen)
        self.log = get_logger(component="planner-lease", instance=instance)
        self.elections = 0

    @property
    def standby_every_s(self) -> float:
        """How often a standby steps (and asks the holder): TTL/10, at most 100 ms, so a
        long TTL does not slow the takeover of a holder that is gone."""
        return min(self.ttl_s / 10, 0.1)

    def is_leader(self) -> bool:
        return self.token > 0 and time.monotonic() < self._valid_until

    def check(self) -> int:
        """The fencing token, or :class:`NotLeader` when the lease is not (or no longer) ours."""
        if not self.is_leader():
            raise NotLeader(f"{self.instance} does not hold the planner lease")
        return self.token

    def _value(self) -> bytes:
        fields = {"holder": self.instance, "ttl_s": self.ttl_s, "at": time.time()}
        if self.probe is not None:  # this replica answers its own subject
            fields["presence"] = presence(self.instance)
        return msgpack.packb(fields)

    @staticmethod
    def holder(value: bytes | None) -> str:
        return Lease._field(value, "holder") or "?"

    @staticmethod
    def _field(value: bytes | None, name: str) -> str | None:
        try:
            found = msgpack.unpackb(value or b"").get(name)
        except Exception:
            return None
        return found if isinstance(found, str) else None

    async def _holder_gone(self, value: bytes | None) -> bool:
        """Whether the holder that wrote ``value`` is gone: asked twice, ``confirm_s``
        apart (the module doc). False when it cannot tell."""
        token = self._field(value, "presence")
        if self.probe is None or token is None:
            return False
        if not await self.probe(token):
            return False
        await asyncio.sleep(self.confirm_s)
        return await self.probe(token)

    async def step(self) -> bool:
        """One round: renew if leader, else try to take an expired or absent lease.
        Returns whether this replica is leader afterwards."""
        now = time.monotonic()
        if self.token:
            assert self._revision is not None  # set with the token
            try:
                # no longer than the lease is ours: a renewal stuck in a partition must not
                # keep this replica from stepping down (and standing by) on time
                self._revision = await asyncio.wait_for(
                    self.kv.update(LEASE_KEY, self._value(), last=self._revision),
                    max(0.01, self._valid_until - now),
                )
                self._valid_until = now + self.ttl_s * 0.8
            except Conflict:
                self.resign("another replica took the lease")
            except Exception as exc:  # NATS unreachable: leader until the lease runs out
                if time.monotonic() >= self._valid_until:
                    self.resign(f"could not renew: {exc!r}")
            return self.is_leader()
        try:
            entry = await self.kv.get(LEASE_KEY)  # None: never written, or released
        except Exception as exc:
            self.log.debug("lease_read_failed", error=repr(exc))
            return False
        if entry is None or not entry.value:
            acquire = self.kv.create(LEASE_KEY, self._value())
        else:
            if self._seen is None or self._seen[0] != entry.revision:
                self._seen = (entry.revision, now)  # it moved: the holder is alive
                if not await self._holder_gone(entry.value):
                    return False
            elif now - self._seen[1] < self.ttl_s and not await self._holder_gone(entry.value):
                return False
            acquire = self.kv.update(LEASE_KEY, self._value(), last=entry.revision)
        try:
            revision = await acquire
        except Exception as exc:  # someone else was faster, or NATS is away
            self.log.debug("lease_not_taken", error=repr(exc))
            self._seen = None
            return False
        self.token = self._revision = revision
        self._valid_until = now + self.ttl_s * 0.8
        self.elections += 1
        self.log.info(
            "lease_acquired", token=self.token, previous=self.holder(entry.value if entry else None)
        )
        return True

    def fenced(self, token: int) -> None:
        """A record written under ``token`` (higher than ours) was found: step down."""
        if token > self.token > 0:
            self.resign(f"a newer leader (token {token}) wrote a job record")

    def resign(self, why: str) -> None:
        self.log.warning("lease_lost", token=self.token, reason=why)
        self.token = 0
        self._revision = None
        self._seen = None

    async def release(self) -> None:
        """Give the lease up at once (a graceful stop): a standby needs no TTL to wait."""
        if self.token and self._revision is not None:
            try:
                await self.kv.delete(LEASE_KEY, last=self._revision)
            except Exception as exc:
                self.log.debug("lease_release_failed", error=repr(exc))
        self.token = 0


async def leader_pid(kv: Bucket) -> int | None:
    """The process id of the planner holding the lease (its instance is ``host:pid:nonce``),
    or None when nobody holds it. For operators' tools and tests that kill the leader."""
    entry = await kv.get(LEASE_KEY)
    if entry is None:
        return None
    try:
        return int(Lease.holder(entry.value).split(":")[1])
    except (IndexError, ValueError):
        return None

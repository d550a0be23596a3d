"""The KV buckets through the bus: get, put, compare-and-set, watch, read all, with typed values.

``bus.kv`` (:class:`Buckets`) opens a bucket; a :class:`Bucket` reads and writes it::

    jobs = await bus.kv.bucket(JOBS_BUCKET)
    found = await jobs.get_as("j1.plan", JobRecord)       # (record, revision) or None
    rev = await jobs.create("j1.plan", record)             # Conflict: the key exists
    rev = await jobs.update("j1.plan", record, last=rev)   # Conflict: it moved on since rev
    plans = await jobs.latest_as("*.plan", JobRecord)      # every current record
    watch = await jobs.watch("j1.plan")                    # one key (phalanx.bus.keywatch)

A value is bytes, or a model: a :class:`~phalanx.contract.Message` is stored as its msgpack
payload (:func:`phalanx.contract.encode`; the kind is implied by the bucket and key, no
headers), any other pydantic model as its JSON (the cluster records). :func:`kv_decode` reads
either back, :class:`~phalanx.contract.DecodeError` when it is not one.

``leader=True`` opens the bucket with every get answered by its stream's leader (read-your-
writes): whoever reads a key to compare-and-set it must (the planner and its lease). Direct
gets (the default for :data:`~phalanx.contract.streams.DIRECT_BUCKETS`) may be answered by a
follower that is behind.
"""

from __future__ import annotations

from typing import TypeVar

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from pydantic import BaseModel, ValidationError

from phalanx.bus.core import Core
from phalanx.bus.keywatch import KeyWatch, KvEntry, WatchLost
from phalanx.bus.topology import ensure_bucket, kv_latest, leader_bucket
from phalanx.contract import DecodeError, Message, decode, encode, headers_for
from phalanx.contract.permissions import watch_names

T = TypeVar("T", bound=BaseModel)


class Conflict(Exception):
    """A compare-and-set lost: the key exists (``create``) or moved on since ``last`` (``update``)."""


def kv_encode(value: bytes | BaseModel) -> bytes:
    """A value as the bucket stores it (see the module docstring)."""
    if isinstance(value, Message):
        return encode(value)[0]
    if isinstance(value, BaseModel):
        return value.model_dump_json().encode()
    return value


def kv_decode(data: bytes, model: type[T]) -> T:
    """The ``model`` stored in ``data``; :class:`DecodeError` saying why not."""
    if issubclass(model, Message):
        return decode(data, headers_for(model), model)  # type: ignore[return-value]  # model is T
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise DecodeError(f"invalid {model.__name__}: {exc.errors()[0]['msg']}") from exc


class AllKeys:
    """Every key of a bucket, watched (nats.py's ``watchall``): each key's latest value,
    then every change; :meth:`next` says ``None`` once, when the latest values are all in."""

    def __init__(self, watcher: KeyValue.KeyWatcher) -> None:
        self._watcher = watcher

    async def next(self, timeout_s: float) -> KvEntry | None:
        """The next value or deletion, or None (caught up). ``TimeoutError`` when nothing
        came within ``timeout_s``; :class:`~phalanx.bus.keywatch.WatchLost` once stopped."""
        try:
            entry = await self._watcher.updates(timeout=timeout_s)
        except nats.errors.TimeoutError:
            raise TimeoutError(f"no change within {timeout_s:g} s") from None
        if entry is None:
            return None
        if not isinstance(entry, KeyValue.Entry):  # the watcher was stopped
            raise WatchLost("the watch was stopped")
        return KvEntry(entry.key, entry.value or b"", entry.revision or 0, entry.operation)

    async def stop(self) -> None:
        await self._watcher.stop()


class Bucket:
    """One KV bucket, read and written through the bus."""

    def __init__(self, name: str, kv: KeyValue, js: JetStreamContext, bus: Core) -> None:
        self.name = name
        self._kv, self._js, self._bus = kv, js, bus

    async def get(self, key: str) -> KvEntry | None:
        """The key's current value (None: never written, or deleted)."""
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:  # (a deleted key too: KeyDeletedError)
            return None
        return KvEntry(key, entry.value or b"", entry.revision or 0)

    async def get_as(self, key: str, model: type[T]) -> tuple[T, int] | None:
        """The key's value decoded as ``model``, and its revision (None: no value);
        :class:`DecodeError` when the value is not a ``model``."""
        entry = await self.get(key)
        if entry is None or not entry.value:
            return None
        return kv_decode(entry.value, model), entry.revision

    async def put(self, key: str, value: bytes | BaseModel) -> int:
        """Write ``key`` whatever it holds; its new revision."""
        return await self._kv.put(key, kv_encode(value))

    async def create(self, key: str, value: bytes | BaseModel) -> int:
        """Write ``key`` only if it has no value; :class:`Conflict` if it has."""
        try:
            return await self._kv.create(key, kv_encode(value))
        except KeyWrongLastSequenceError as exc:
            raise Conflict(f"{self.name}/{key} exists") from exc

    async def update(self, key: str, value: bytes | BaseModel, *, last: int) -> int:
        """Write ``key`` only if its revision is still ``last``; :class:`Conflict` if not."""
        try:
            return await self._kv.update(key, kv_encode(value), last=last)
        except KeyWrongLastSequenceError as exc:
            raise Conflict(f"{self.name}/{key} moved on from revision {last}") from exc

    async def delete(self, key: str, *, last: int | None = None) -> None:
        """Delete ``key`` (if its revision is still ``last``, when given: :class:`Conflict` if not)."""
        try:
            await self._kv.delete(key, last=last)
        except KeyWrongLastSequenceError as exc:
            raise Conflict(f"{self.name}/{key} moved on from revision {last}") from exc
        except KeyNotFoundError:
            pass

    async def latest(self, pattern: str = ">", timeout_s: float = 5.0) -> dict[str, bytes]:
        """The current value of every key matching ``pattern`` (deleted keys left out).

        Read with an ordered consumer to the last entry (:func:`~phalanx.bus.streams.read_to_end`),
        not ``KeyValue.keys()`` or a watch's first ``None``, which can come ahead of the entries (a
        planner taking over would see no jobs). ``TimeoutError`` when the entries stop coming
        before the last one: a partial view is never returned as the whole.
        """
        return await kv_latest(self._js, self.name, pattern, timeout_s)

    async def latest_as(self, pattern: str, model: type[T], timeout_s: float = 5.0) -> dict[str, T]:
        """:meth:`latest`, each value decoded as ``model``; one that is not is left out and logged."""
        out: dict[str, T] = {}
        for key, data in (await self.latest(pattern, timeout_s)).items():
            try:
                out[key] = kv_decode(data, model)
            except DecodeError as err:
                self._bus.log.warning("bad_kv_value", bucket=self.name, key=key, reason=err.reason)
        return out

    async def watch_all(self) -> AllKeys:
        """Watch every key of the bucket (:class:`AllKeys`)."""
        return AllKeys(await self._kv.watchall())

    async def watch(self, key: str) -> KeyWatch:
        """Watch one key (its current value first): :class:`~phalanx.bus.keywatch.KeyWatch`
        (a service's: any name)."""
        return await KeyWatch.start(self._bus.nc, self.name, key)


class Buckets:
    """The KV side of one :class:`~phalanx.bus.Bus` (``bus.kv``)."""

    def __init__(self, bus: Core) -> None:
        self.bus = bus

    async def bucket(
        self, name: str, *, leader: bool = False, create: bool = False, timeout_s: float | None = None
    ) -> Bucket:
        """Open bucket ``name`` (``create``: create it if it is not there; ``leader``: every get
        from the stream's leader; ``timeout_s``: of each request, default nats.py's 5 s).
        A bucket that is not there raises ``nats.js.errors.NotFoundError``."""
        js = self.bus.js if timeout_s is None else self.bus.nc.jetstream(timeout=timeout_s)
        if leader:
            kv = await leader_bucket(js, name)
        elif create:
            kv = await ensure_bucket(js, name)
        else:
            kv = await js.key_value(name)
        return Bucket(name, kv, js, self.bus)

    async def watch(self, bucket: str, key: str, *, heartbeat_s: float = 2.0) -> KeyWatch:
        """Watch one key of ``bucket`` without opening it (a follower of one record may not
        look at more): :class:`~phalanx.bus.keywatch.KeyWatch`, under one of the user's
        own :func:`~phalanx.contract.permissions.watch_names` when it logged in as one."""
        names = watch_names(self.bus.user) if self.bus.user else ()
        return await KeyWatch.start(self.bus.nc, bucket, key, names=names, heartbeat_s=heartbeat_s)

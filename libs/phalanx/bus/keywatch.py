"""Watching one KV key through a consumer whose create request names the key.

nats.py's ``KeyValue.watch`` creates an unnamed ordered consumer: its API subject
(``$JS.API.CONSUMER.CREATE.<stream>``) carries no filter, the key is in the request
body, so NATS permissions cannot tell one key from another, and whoever may watch
one key of a bucket may watch them all. A :class:`KeyWatch` creates a named consumer
through the subject that carries the filter,
``$JS.API.CONSUMER.CREATE.KV_<bucket>.<name>.$KV.<bucket>.<key>`` (nats-server >=
2.9, which refuses a body whose filter differs from the subject's, and a body with
several filters), so a user can be allowed exactly its own key (see
:mod:`phalanx.natsauth`). The request is sent here rather than through nats.py's
``add_consumer``, which picks that form from a server-version check of its own.

The watch delivers the key's latest value first (``deliver_policy``
``last_per_subject``), then every later one. It is push-delivered with idle
heartbeats and no acknowledgements; instead of re-creating its consumer from the
next sequence as nats.py's ordered consumer does (which, for a named consumer, the
server refuses as a change of its start), a gap in the consumer's sequence, a
heartbeat that says a message was missed, a status other than a heartbeat, or no
heartbeat for :data:`MISSED_HEARTBEATS` intervals ends the watch with
:class:`WatchLost`. The caller starts a new one, which replays the latest value:
all a follower of one record needs::

    watch = await (await bus.kv.bucket(JOBS_BUCKET)).watch("j1.plan")
    try:
        async for entry in watch:
            ...
    finally:
        await watch.stop()

The request says ``"action": "create"``, so no one can update (redirect) another's
watch. Under authorization a follower may name its consumer only with one of its
user's few :func:`~phalanx.contract.permissions.watch_names` (so no user can fill
the bucket's consumer limit): the watch takes the first free one, :meth:`stop`
deletes it, and one left by a process that died is removed by the server
``inactive_s`` after its subscription went (or taken over when every name is held).
Without names (no authorization) the name is random.
"""

from __future__ import annotations

import contextlib
import json
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, ServiceUnavailableError
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE

JS_API = "$JS.API"
MISSED_HEARTBEATS = 3
_EXISTS = (10148, 10105)  # a consumer of that name exists (with another config; still active)


class WatchLost(Exception):
    """The watch may have missed a value: start a new one (it replays the latest)."""


@dataclass(frozen=True)
class KvEntry:
    """One value of a key (``operation`` ``DEL``/``PURGE``: a deletion, value empty)."""

    key: str
    value: bytes
    revision: int
    operation: str | None = None


def entry_operation(headers: dict[str, str] | None) -> str | None:
    """``DEL`` / ``PURGE`` for a deletion (a client's or the server's marker), else None."""
    headers = headers or {}
    if KV_OP in headers:
        return headers[KV_OP]
    reason = headers.get(KV_MARKER_REASON)
    if reason is None:
        return None
    return KV_DEL if reason == "Remove" else KV_PURGE


class KeyWatch:
    """One key of a bucket, watched: its current value first, then every later one."""

    def __init__(
        self,
        sub: Subscription,
        bucket: str,
        key: str,
        consumer: str,
        heartbeat_s: float,
        nc: NATS | None = None,
    ) -> None:
        self._sub = sub
        self.bucket = bucket
        self.key = key
        self.consumer = consumer
        self.heartbeat_s = heartbeat_s
        self._nc = nc  # set when the consumer's name is one of a few: deleted on stop
        self._delivered = 0  # the consumer sequence of the last value handed out

    @classmethod
    async def start(
        cls,
        nc: NATS,
        bucket: str,
        key: str,
        *,
        names: Sequence[str] = (),
        heartbeat_s: float = 2.0,
        inactive_s: float = 30.0,
        timeout_s: float = 5.0,
    ) -> KeyWatch:
        """Create the consumer (under the first of ``names`` not in use; every one in
        use: a random one taken over) and its subscription. A refused create (no
        permission) is a ``nats.errors.TimeoutError``; a bucket that is not there, an
        ``APIError``."""
        stream, subject = f"KV_{bucket}", f"$KV.{bucket}.{key}"
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)  # before the consumer: its first delivery cannot be missed
        try:
            if not names:
                name = f"watch_{secrets.token_hex(8)}"
                await _create(nc, stream, name, subject, inbox, heartbeat_s, inactive_s, timeout_s)
                return cls(sub, bucket, key, name, heartbeat_s)
            for name in names:
                try:
                    await _create(nc, stream, name, subject, inbox, heartbeat_s, inactive_s, timeout_s)
                    return cls(sub, bucket, key, name, heartbeat_s, nc)
                except APIError as exc:
                    if exc.err_code not in _EXISTS:
                        raise
            name = random.choice(names)  # every one held (watches of processes that died)
            await _delete(nc, stream, name, timeout_s)
            await _create(nc, stream, name, subject, inbox, heartbeat_s, inactive_s, timeout_s)
            return cls(sub, bucket, key, name, heartbeat_s, nc)
        except nats.errors.NoRespondersError:
            await sub.unsubscribe()
            raise ServiceUnavailableError from None
        except BaseException:
            await sub.unsubscribe()
            raise

    def __aiter__(self) -> KeyWatch:
        return self

    async def __anext__(self) -> KvEntry:
        """The next value (or deletion: ``operation`` set) of the key, as it arrives."""
        while True:
            try:
                msg = await self._sub.next_msg(timeout=self.heartbeat_s * MISSED_HEARTBEATS)
            except nats.errors.TimeoutError:
                raise WatchLost(
                    f"{self.bucket}/{self.key}: nothing, not even a heartbeat, for "
                    f"{self.heartbeat_s * MISSED_HEARTBEATS:g}s"
                ) from None
            headers = msg.headers or {}
            status = headers.get("Status")
            if status is not None and not msg.data:
                if status != "100" or msg.reply:  # 100 with a reply: flow control, never asked for
                    raise WatchLost(
                        f"{self.bucket}/{self.key}: status {status} {headers.get('Description', '')}"
                    )
                last = int(headers.get("Nats-Last-Consumer", self._delivered) or 0)
                if last != self._delivered:
                    raise WatchLost(
                        f"{self.bucket}/{self.key}: the server sent {last}, {self._delivered} arrived"
                    )
                continue
            meta = msg.metadata
            if meta.sequence.consumer != self._delivered + 1:
                raise WatchLost(
                    f"{self.bucket}/{self.key}: delivery {meta.sequence.consumer} after {self._delivered}"
                )
            self._delivered = meta.sequence.consumer
            return KvEntry(self.key, msg.data, meta.sequence.stream, entry_operation(msg.headers))

    async def stop(self) -> None:
        """Unsubscribe, and delete a consumer named with one of the user's few names
        (its name is free again at once); the server removes any other once it has had
        no interest for ``inactive_s``."""
        await self._sub.unsubscribe()
        if self._nc is not None:
            with contextlib.suppress(Exception):  # gone already, or NATS away: inactive_s ends it
                await _delete(self._nc, f"KV_{self.bucket}", self.consumer, 1.0)


async def _create(
    nc: NATS,
    stream: str,
    name: str,
    subject: str,
    inbox: str,
    heartbeat_s: float,
    inactive_s: float,
    timeout_s: float,
) -> None:
    """Create consumer ``name`` of ``stream``, pushing ``subject`` to ``inbox`` (through
    the API subject that names the filter); an answer with an error raises ``APIError``."""
    config = ConsumerConfig(
        name=name,
        deliver_subject=inbox,
        filter_subject=subject,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=AckPolicy.NONE,
        max_deliver=1,
        idle_heartbeat=heartbeat_s,
        inactive_threshold=inactive_s,
        num_replicas=1,
        mem_storage=True,
    )
    request = {"stream_name": stream, "config": config.as_dict(), "action": "create"}
    reply = await nc.request(
        f"{JS_API}.CONSUMER.CREATE.{stream}.{name}.{subject}", json.dumps(request).encode(), timeout=timeout_s
    )
    answer = json.loads(reply.data)
    if "error" in answer:
        APIError.from_error(answer["error"])  # raises


async def _delete(nc: NATS, stream: str, name: str, timeout_s: float) -> None:
    """Delete consumer ``name`` of ``stream`` (one that is not there: nothing to do)."""
    reply = await nc.request(f"{JS_API}.CONSUMER.DELETE.{stream}.{name}", b"", timeout=timeout_s)
    answer = json.loads(reply.data)
    if "error" in answer and answer["error"].get("code") != 404:
        APIError.from_error(answer["error"])  # raises

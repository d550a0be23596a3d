"""Reading what the JetStream streams hold: the last message on a subject, a subject's history.

``bus.streams`` (:class:`Streams`) reads decoded messages, each with where it sits in its
stream (:class:`Stored`)::

    last = await bus.streams.last(SCHED, CAPACITY.format(cluster="c"), CapacityChanged)
    decisions = await bus.streams.history(DECISION.format(job="j1"), PlanDecision)

A stored message that does not decode as expected is left out and logged
(``bad_stored_message``): it was refused when it was published or consumed already.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Generic, TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from phalanx.bus.core import Core
from phalanx.contract import DecodeError, Message, decode
from phalanx.contract.proto import MSG_ID_HEADER
from phalanx.contract.streams import StreamSpec

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Stored(Generic[M]):
    """One message as its stream holds it."""

    msg: M
    subject: str
    seq: int  # its sequence in the stream
    msg_id: str | None  # the publisher's de-duplication id (``Nats-Msg-Id``)


async def read_to_end(sub: JetStreamContext.PushSubscription, what: str, timeout_s: float) -> list[Msg]:
    """Every message of an ordered consumer up to the one the server sent with nothing
    pending after it (then unsubscribes); ``[]`` only when consumer info shows nothing
    pending *and* nothing delivered; ``TimeoutError`` when they stop coming before that.

    Not nats.py's "caught up" (a watch's first ``None``, ``KeyValue.keys()``): it decides
    from consumer info that can be read before the first deliveries are, so it may come
    ahead of them, and a reader would see nothing where something is.
    """
    try:
        info = await sub.consumer_info()
        if info.num_pending == 0 and not (info.delivered and info.delivered.consumer_seq):
            return []
        out: list[Msg] = []
        while True:
            try:
                msg = await sub.next_msg(timeout=timeout_s)
            except nats.errors.TimeoutError:
                raise TimeoutError(f"read {len(out)} of {what}, then nothing for {timeout_s}s") from None
            out.append(msg)
            if msg.metadata.num_pending == 0:
                return out
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(sub.unsubscribe())


class Tail(Generic[M]):
    """Every ``expected`` message on a subject, from the first the stream holds, then each as it
    is stored (:meth:`Streams.tail`): an ordered consumer, removed by :meth:`stop`."""

    def __init__(
        self, streams: Streams, sub: JetStreamContext.PushSubscription, kinds: tuple[type[M], ...]
    ) -> None:
        self._streams, self._sub, self._kinds = streams, sub, kinds

    async def next(self, timeout_s: float) -> Stored[M] | None:
        """The next message (None: none came within ``timeout_s``); what is not one of the
        expected kinds is skipped (logged)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                raw = await self._sub.next_msg(timeout=max(0.001, deadline - loop.time()))
            except nats.errors.TimeoutError:
                return None
            seq = raw.metadata.sequence.stream
            stored = self._streams._stored(raw.subject, raw.data, raw.headers, seq, self._kinds)
            if stored is not None:
                return stored

    async def stop(self) -> None:
        """Remove the consumer now (one left to the connection's drain holds it up for 30 s)."""
        await self._sub.unsubscribe()


class Streams:
    """The JetStream reads of one :class:`~phalanx.bus.Bus` (``bus.streams``)."""

    def __init__(self, bus: Core) -> None:
        self.bus = bus

    @property
    def _js(self) -> JetStreamContext:
        return self.bus.js

    def _stored(
        self,
        subject: str,
        data: bytes | None,
        headers: dict[str, str] | None,
        seq: int | None,
        kinds: tuple[type[M], ...],
    ) -> Stored[M] | None:
        """The message, decoded as one of ``kinds``; None (logged) when it is not one."""
        try:
            msg = decode(data or b"", headers)
            if not isinstance(msg, kinds):
                raise DecodeError(f"{subject} holds {msg.KIND!r}", msg.KIND)
        except DecodeError as err:
            self.bus.log.warning("bad_stored_message", subject=subject, reason=err.reason)
            return None
        return Stored(msg, subject, seq or 0, headers.get(MSG_ID_HEADER) if headers else None)

    async def last(self, stream: StreamSpec, subject: str, expected: type[M]) -> Stored[M] | None:
        """The newest message ``stream`` holds on ``subject`` (None: none, or not an ``expected``)."""
        try:
            raw = await self._js.get_last_msg(stream.name, subject)
        except NotFoundError:
            return None
        return self._stored(raw.subject or subject, raw.data, raw.headers, raw.seq, (expected,))

    async def history(
        self,
        subject: str,
        expected: type[M] | tuple[type[M], ...],
        *,
        stream: StreamSpec | None = None,
        timeout_s: float = 5.0,
    ) -> list[Stored[M]]:
        """Every ``expected`` message a stream holds on ``subject`` (wildcards allowed), oldest
        first, up to the last one there when called: a job's decisions, recoveries, steps.

        Read with an ordered consumer until the message sent with nothing pending after it
        (:func:`read_to_end`); ``TimeoutError`` when messages stop coming before the last one.
        """
        kinds = expected if isinstance(expected, tuple) else (expected,)
        sub = await self._js.subscribe(
            subject,
            stream=stream.name if stream else None,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
            inactive_threshold=60.0,
        )
        out: list[Stored[M]] = []
        for raw in await read_to_end(sub, f"the messages on {subject}", timeout_s):
            stored = self._stored(raw.subject, raw.data, raw.headers, raw.metadata.sequence.stream, kinds)
            if stored is not None:
                out.append(stored)
        return out

    async def tail(
        self, subject: str, expected: type[M] | tuple[type[M], ...], *, stream: StreamSpec | None = None
    ) -> Tail[M]:
        """Follow ``subject`` from the first message the stream holds (:class:`Tail`)."""
        sub = await self._js.subscribe(
            subject,
            stream=stream.name if stream else None,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
        return Tail(self, sub, expected if isinstance(expected, tuple) else (expected,))

    async def walk(self, stream: StreamSpec, subject: str, expected: type[M]) -> list[Stored[M]]:
        """What :meth:`history` reads, one message get at a time: needs only the right to
        read ``stream`` (no consumer), for parties that may not create one on it."""
        out: list[Stored[M]] = []
        seq = 1
        while True:
            try:
                raw = await self._js.get_msg(stream.name, seq=seq, subject=subject, next=True)
            except NotFoundError:
                return out
            stored = self._stored(raw.subject or subject, raw.data, raw.headers, raw.seq, (expected,))
            if stored is not None:
                out.append(stored)
            seq = (raw.seq or seq) + 1

    async def delete_consumer(self, stream: StreamSpec, durable: str) -> bool:
        """Remove a durable consumer (False: there was none)."""
        try:
            await self._js.delete_consumer(stream.name, durable)
        except NotFoundError:
            return False
        return True

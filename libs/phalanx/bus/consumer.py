"""Durable pull consumers whose loop survives a server restart.

nats.py does not re-bind pull subscriptions by itself (its issue 504): the loop here checks
its consumer after every reconnect, re-creates it when the server lost it, and pulls with
one-shot requests (:meth:`Consumers._pull`). :meth:`phalanx.bus.Bus.consume` and
:meth:`~phalanx.bus.Bus.rewind` are the way in.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import DEFAULT_PREFIX, AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from phalanx.bus.core import Core
from phalanx.bus.topology import ensure_topology
from phalanx.contract import DecodeError, Message, decode
from phalanx.contract.streams import StreamSpec
from phalanx.contract.subjects import sender_mismatch
from phalanx.telemetry import extract_context

_tracer = trace.get_tracer("phalanx.bus")
RawHandler = Callable[[Message, Msg], Awaitable[None]]
BatchHandler = Callable[[list[tuple[Message, Msg]]], Awaitable[None]]


def decode_on(raw: Msg, expected: tuple[type[Message], ...]) -> Message:
    """The message in ``raw``, checked against its subject: one of ``expected``, and
    of the job, worker and node the subject names (:func:`sender_mismatch`). Raises
    :class:`DecodeError` with the reason."""
    msg = decode(raw.data, raw.headers)
    if not isinstance(msg, expected):
        raise DecodeError(f"{raw.subject} does not carry {msg.KIND!r}", msg.KIND)
    if (why := sender_mismatch(raw.subject, msg)) is not None:
        raise DecodeError(why, msg.KIND)
    return msg


def process_span(msg: Msg) -> Any:
    """The span of handling ``msg``, a child of the context its headers carry."""
    return _tracer.start_as_current_span(
        f"process {msg.subject}",
        context=extract_context(msg.headers),
        kind=SpanKind.CONSUMER,
        attributes={
            "messaging.system": "nats",
            "messaging.operation.type": "process",
            "messaging.destination.name": msg.subject,
        },
    )


def _redelivered(
    raw: Msg, handled: dict[tuple[int, Any], None] | None
) -> tuple[tuple[int, Any] | None, bool]:
    """``raw``'s key in ``handled``, and whether it is a redelivery of a message this
    consumer already handled (its ack was lost, e.g. in a server restart): such a one is
    acknowledged again, not handled twice."""
    if handled is None:
        return None, False
    try:
        md = raw.metadata
        key = (md.sequence.stream, md.timestamp)
    except Exception:  # no JetStream metadata
        return None, False
    return key, md.num_delivered > 1 and key in handled


class Consumers:
    """The durable pull consumers of one bus."""

    def __init__(self, bus: Core) -> None:
        self.bus = bus

    def consume(
        self,
        stream: StreamSpec,
        durable: str,
        subjects: list[str],
        handler: Callable[[Message, Msg], Awaitable[None]],
        expected: tuple[type[Message], ...],
        *,
        deliver_new: bool = False,
        ack_wait_s: float = 30.0,
        max_deliver: int = 5,
        batch: int = 64,
        pull_expires_s: float = 1.0,
        batch_handler: BatchHandler | None = None,
    ) -> asyncio.Task[None]:
        """Run a durable pull consumer in the background until :meth:`close`.

        The handler must be idempotent: a message is acknowledged only after it
        returns, so a crash in between delivers it again. A handler that raises gets
        the message redelivered (``nak`` with a delay) up to ``max_deliver`` times.
        Messages are pulled up to ``batch`` at a time; a pull waits on the server at
        most ``pull_expires_s`` for the first one (:meth:`close` waits that long at most).

        ``batch_handler`` (instead of ``handler``, which is then not called) takes each
        pull's valid messages at once, in order, and they are acknowledged together once
        it returns (all redelivered if it raises): the planner commits a pull's inputs in
        one transaction (18,000 registrations of a 16k-rank job are not 18,000 writes).
        It opens each message's own span (:func:`process_span`) where it needs one.
        """
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.NEW if deliver_new else DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_deliver=max_deliver,
            filter_subjects=subjects,
            max_ack_pending=10_000,
        )
        return self.bus.spawn(
            self._consume_loop(
                stream, durable, config, handler, expected, batch, pull_expires_s, batch_handler
            ),
            name=f"consume:{durable}",
        )

    async def rewind(self, stream: StreamSpec, durable: str) -> int:
        """Hand what a dead consumer held back to the consumer at once.

        Messages a crashed process fetched but never acknowledged are redelivered
        only after ``ack_wait``. A standby taking over (planner failover) cannot wait
        that long: it re-creates the durable consumer to start again just after its
        ack floor. Messages acknowledged out of order above the floor come again too,
        so handlers must be idempotent (they are required to be). Returns how many
        messages were outstanding (0: nothing to do, the consumer is left alone).
        """
        try:
            info = await self.bus.js.consumer_info(stream.name, durable)
        except NotFoundError:
            return 0
        held = info.num_ack_pending or 0
        if not held:
            return 0
        floor = info.ack_floor.stream_seq if info.ack_floor and info.ack_floor.stream_seq else 0
        config = info.config
        config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = floor + 1
        await self.bus.js.delete_consumer(stream.name, durable)
        await self.bus.js.add_consumer(stream.name, config)
        self.bus.log.info("consumer_rewound", durable=durable, outstanding=held, start_seq=floor + 1)
        return held

    async def _consume_loop(
        self,
        stream: StreamSpec,
        durable: str,
        config: ConsumerConfig,
        handler: Callable[[Message, Msg], Awaitable[None]],
        expected: tuple[type[Message], ...],
        batch: int,
        pull_expires_s: float = 1.0,
        batch_handler: BatchHandler | None = None,
    ) -> None:
        sub: Subscription | None = None  # on this loop's own inbox, where pulled messages arrive
        handled: dict[tuple[int, Any], None] = {}  # (stream seq, stored at) of handled messages
        checked_at = -1  # self.bus.reconnects when the consumer was last checked
        idle = 0  # consecutive empty pulls
        next_subject = f"{DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{stream.name}.{durable}"
        me = asyncio.current_task()
        try:
            # cancelling(): Python 3.11's wait_for can swallow a cancellation that lands as
            # its inner future completes; a loop that went on would take a standby's input.
            while not self.bus.closing and not (me is not None and me.cancelling()):
                try:
                    # After a reconnect, and after 10 empty pulls, make sure the
                    # consumer still exists (a server that lost its state, a deleted consumer).
                    if sub is None or self.bus.reconnects != checked_at or idle >= 10:
                        idle = 0
                        try:
                            await self.bus.js.consumer_info(stream.name, durable)
                        except NotFoundError:
                            await self.bus.js.add_consumer(stream.name, config)
                        checked_at = self.bus.reconnects
                    if sub is None:
                        sub = await self.bus.nc.subscribe(self.bus.nc.new_inbox())
                    msgs = await self._pull(sub, next_subject, batch, pull_expires_s)
                    idle = 0 if msgs else idle + 1
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    # Server restart, lost connection, stream or consumer gone: re-bind.
                    self.bus.outage.symptom(durable, "consume_rebind", durable=durable, error=repr(exc))
                    if sub is not None:
                        with contextlib.suppress(Exception):
                            await sub.unsubscribe()
                    sub = None
                    with contextlib.suppress(Exception):
                        # Re-create what a restarted server lost; change nothing that exists.
                        # Bounded: a request that reached a server going down is never answered.
                        await asyncio.wait_for(ensure_topology(self.bus.js, create_only=True), 1.0)
                    await asyncio.sleep(0.2)
                    continue
                if batch_handler is not None:
                    await self._deliver_batch(msgs, batch_handler, expected, handled)
                    continue
                for raw in msgs:
                    await self._deliver(raw, handler, expected, handled)
        finally:
            # Unsubscribe, or the connection's drain waits on a status that came after the last pull.
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _pull(
        self, sub: Subscription, next_subject: str, batch: int, expires_s: float = 1.0
    ) -> list[Msg]:
        """One pull request for up to ``batch`` messages, read to its end.

        The request is a one-shot (``no_wait`` with ``expires``): the server answers at
        once with what the consumer has, or, when it has nothing, with the first
        messages to come within ``expires_s``; either way it ends the request with a
        404/408 status right behind them (nothing more when ``batch`` is filled). So one
        request is outstanding at a time, and a message never waits behind one.

        Not nats.py's ``fetch(batch > 1)``: when the server's 408 for an expired fetch
        arrives just after the client's own timer ended that fetch (the usual order: the
        request leaves after the timer starts), the next fetch takes that stale 408 for
        its own answer and sends a second, lingering request for ``batch`` messages. It
        returns on the first message its one-shot brings, and leaves the lingering request
        on the server: the next message is delivered to it, and that fetch then waits for
        the rest of the batch until the request expires -- up to 1 s late (RankFailed 20 ms
        after RankExited: the planner's plan began up to 1 s after the verdict).

        A status that outlived its own request (its answer came after our deadline) can
        end a later request early: that is harmless, the next pull asks again, and what
        the earlier request still brings arrives here with its own status right behind.
        """
        request = {"batch": batch, "expires": int(expires_s * 1e9), "no_wait": True}
        await self.bus.nc.publish(next_subject, json.dumps(request).encode(), reply=sub.subject)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + expires_s + 0.5  # the server's 408 comes at expires_s
        msgs: list[Msg] = []
        while len(msgs) < batch:
            try:
                raw = await sub.next_msg(timeout=max(0.001, deadline - loop.time()))
            except TimeoutError:  # the request or its answer was lost (a reconnect): ask again
                break
            status = raw.headers.get("Status") if raw.headers and not raw.reply else None
            if status is None:
                msgs.append(raw)
            elif status in ("404", "408", "409"):  # no more messages / expired / conflict
                break
            elif status == "503":
                raise RuntimeError(f"pull from {next_subject}: no responders (consumer or JetStream gone)")
            elif status != "100":  # 100: an idle heartbeat
                raise RuntimeError(f"pull from {next_subject}: status {status}")
        return msgs

    async def _deliver_batch(
        self,
        msgs: list[Msg],
        handler: BatchHandler,
        expected: tuple[type[Message], ...],
        handled: dict[tuple[int, Any], None] | None,
    ) -> None:
        items: list[tuple[Message, Msg]] = []
        keys: list[tuple[int, Any] | None] = []
        for raw in msgs:
            key, again = _redelivered(raw, handled)
            if again:
                with contextlib.suppress(Exception):
                    await raw.ack()
                continue
            try:
                items.append((decode_on(raw, expected), raw))
                keys.append(key)
            except DecodeError as err:
                await self.bus.report_bad_input(raw.subject, err)
                with contextlib.suppress(Exception):
                    await raw.term()
        if not items:
            return
        try:
            await handler(items)
        except Exception as exc:
            self.bus.log.exception(
                "handler_failed", subject=items[0][1].subject, count=len(items), error=repr(exc)
            )
            for _, raw in items:
                with contextlib.suppress(Exception):
                    await raw.nak(delay=0.5)
            return
        for (_, raw), key in zip(items, keys, strict=True):
            if handled is not None and key is not None:
                handled[key] = None
            with contextlib.suppress(Exception):
                await raw.ack()
        if handled is not None:
            while len(handled) > 100_000:
                del handled[next(iter(handled))]

    async def _deliver(
        self,
        raw: Msg,
        handler: Callable[[Message, Msg], Awaitable[None]],
        expected: tuple[type[Message], ...],
        handled: dict[tuple[int, Any], None] | None = None,
    ) -> None:
        key, again = _redelivered(raw, handled)
        if again:
            with contextlib.suppress(Exception):
                await raw.ack()
            return
        try:
            msg = decode_on(raw, expected)
        except DecodeError as err:
            await self.bus.report_bad_input(raw.subject, err)
            with contextlib.suppress(Exception):
                await raw.term()
            return
        with process_span(raw) as span:
            try:
                await handler(msg, raw)
            except Exception as exc:
                span.set_status(Status(StatusCode.ERROR, repr(exc)))
                self.bus.log.exception("handler_failed", subject=raw.subject, error=repr(exc))
                with contextlib.suppress(Exception):
                    await raw.nak(delay=0.5)
                return
        if handled is not None and key is not None:
            handled[key] = None
            if len(handled) > 100_000:
                del handled[next(iter(handled))]
        with contextlib.suppress(Exception):
            await raw.ack()

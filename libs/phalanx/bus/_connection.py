"""The bus: one NATS connection with typed, traced publish and consume.

>>> bus = await Bus.connect("nats://127.0.0.1:4222", name="failure-detector")
>>> await bus.publish(FAILED, RankFailed(...), job="j1", msg_id=incident)
>>> bus.subscribe(HEARTBEAT.wildcard(job="j1"), on_heartbeat, Heartbeat)
>>> bus.consume(EVENTS, "detector", EXITED.wildcard(), on_exit, RankExited)
>>> await bus.close()

Every received message is decoded against the expected model. A message that
fails to decode never reaches a handler: it is logged, reported on
``phalanx.err.<service>`` and (for JetStream) terminated so it is not redelivered.
JetStream consumers are durable pull consumers whose loop survives a server
restart (nats.py does not re-bind pull subscriptions by itself, issue 504).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from phalanx.bus.subjects import ERROR, Subject, Transport
from phalanx.bus.topology import StreamSpec, ensure_topology
from phalanx.schemas import DecodeError, ErrorEvent, Message, decode, encode
from phalanx.telemetry import extract_context, get_logger, inject_headers

M = TypeVar("M", bound=Message)
Handler = Callable[[M, Msg], Awaitable[None]]

_tracer = trace.get_tracer("phalanx.bus")


def nats_url() -> str:
    """The server URL from ``NATS_URL`` (or ``PHALANX_NATS_URL``)."""
    return os.environ.get("NATS_URL") or os.environ.get("PHALANX_NATS_URL") or "nats://127.0.0.1:4222"


# NATS server authorization (roles and permissions: phalanx.natsauth).
ENV_NATS_USER = "PHALANX_NATS_USER"
ENV_NATS_PASSWORD = "PHALANX_NATS_PASSWORD"
# nats.py hands error_cb the server's -ERR text lower-cased, subject included.
_PERMISSION_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"')


class PermissionDenied(RuntimeError):
    """The NATS server refused this client's credentials, or a publish it made."""


def inbox_prefix(user: str) -> str:
    """Where a user's replies arrive: the only inbox its permissions let it read."""
    return f"_INBOX.{user}"


def nats_auth_options(url: str) -> dict[str, Any]:
    """Client options for an authorizing server: none when no credentials are given.

    ``PHALANX_NATS_USER`` / ``PHALANX_NATS_PASSWORD`` win over a
    ``nats://user:pass@host:port`` URL (which works too, but URLs end up in logs).
    """
    user = os.environ.get(ENV_NATS_USER)
    opts: dict[str, Any] = {}
    if user:
        opts.update(user=user, password=os.environ.get(ENV_NATS_PASSWORD, ""))
    else:
        user = urlsplit(url.split(",")[0].strip()).username
    if user:
        opts["inbox_prefix"] = inbox_prefix(user)
    return opts


class Bus:
    def __init__(self, nc: Client, name: str) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.name = name
        self.log = get_logger(component="bus", client=name)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self.reconnects = 0
        # Run after every reconnect: what a core subscription missed meanwhile is
        # gone, so followers of the plan read it again from KV here.
        self.reconnect_hooks: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self.decode_errors = 0
        self.denied: dict[str, float] = {}  # subject (lower-cased) -> loop time the server last refused it

    # -- connection ---------------------------------------------------------
    @classmethod
    async def connect(
        cls,
        url: str | None = None,
        *,
        name: str,
        reconnect_wait_s: float = 0.25,
        ensure: bool = True,
    ) -> Bus:
        """Connect (retrying forever on reconnect) and create the topology if asked.

        With ``PHALANX_NATS_USER`` / ``PHALANX_NATS_PASSWORD`` set it logs in as that
        user (:func:`nats_auth_options`); credentials the server refuses raise
        :class:`PermissionDenied` at once, and a publish or subscription it refuses
        later is logged as ``permission_denied`` with its subject.
        """
        holder: dict[str, Bus] = {}

        url = url or nats_url()
        auth = nats_auth_options(url)
        user = auth.get("user") or urlsplit(url.split(",")[0].strip()).username

        async def on_error(exc: Exception) -> None:
            text = str(exc).lower()
            if "authorization violation" in text and "bus" not in holder:
                # Wrong or unknown credentials: retrying forever would only hide it.
                raise PermissionDenied(
                    f"nats: authorization violation: {url.split('@')[-1]} refused user {user!r}"
                )
            if "bus" not in holder:
                return
            bus = holder["bus"]
            refused = _PERMISSION_VIOLATION.search(text)
            if refused:
                bus.denied[refused.group(2)] = asyncio.get_running_loop().time()
                bus.log.error(
                    "permission_denied",
                    operation=refused.group(1),
                    subject=refused.group(2),
                    user=user,
                    error=str(exc),
                )
            elif "authorization violation" in text:
                bus.log.error("nats_auth_failed", user=user, error=str(exc))
            else:
                bus.log.warning("nats_error", error=repr(exc))

        async def on_disconnect() -> None:
            if "bus" in holder:
                holder["bus"].log.warning("nats_disconnected")

        async def on_reconnect() -> None:
            if "bus" in holder:
                bus = holder["bus"]
                bus.reconnects += 1
                bus.log.info("nats_reconnected", url=str(bus.nc.connected_url))
                for hook in list(bus.reconnect_hooks):
                    task: asyncio.Task[None] = asyncio.create_task(hook())
                    bus._tasks.add(task)
                    task.add_done_callback(bus._tasks.discard)

        nc = Client()
        try:
            await nc.connect(
                url,
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=reconnect_wait_s,  # type: ignore[arg-type]  # seconds, float is fine
                ping_interval=5,
                max_outstanding_pings=3,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                connect_timeout=2,
                **auth,
            )
        except PermissionDenied as exc:
            with contextlib.suppress(Exception):
                await nc.close()
            get_logger(component="bus", client=name).error("nats_auth_failed", user=user, error=str(exc))
            raise
        bus = cls(nc, name)
        holder["bus"] = bus
        if ensure:
            await ensure_topology(bus.js)
        return bus

    async def close(self, grace_s: float = 3.0) -> None:
        """Stop consume loops, flush and drain the connection.

        Each consume loop finishes the batch it holds (so nothing fetched waits out
        its ack_wait before another consumer gets it) and leaves at its next fetch;
        a loop still busy after ``grace_s`` is cancelled.
        """
        self._closing = True
        tasks = list(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for t in pending:
                t.cancel()
            for t in pending:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.drain()

    # -- publish ------------------------------------------------------------
    async def publish(
        self,
        subject: Subject,
        msg: Message,
        *,
        msg_id: str | None = None,
        retry_for_s: float = 30.0,
        traced: bool = True,
        **tokens: str,
    ) -> None:
        """Publish ``msg`` on ``subject`` with the current trace context.

        JetStream subjects wait for the server's acknowledgement, retrying with the
        same ``Nats-Msg-Id`` for up to ``retry_for_s`` (a restart in between is then
        neither a loss nor a duplicate). ``traced=False`` is for high-rate core
        messages such as heartbeats.
        """
        if not isinstance(msg, subject.message):
            raise TypeError(f"{subject.pattern} carries {subject.message.KIND}, not {msg.KIND}")
        subj = subject.format(**tokens)
        payload, headers = encode(msg)
        if not traced:  # high-rate, ephemeral (heartbeats): no span, no context
            await self.nc.publish(subj, payload, headers=headers)
            return
        with _tracer.start_as_current_span(
            f"publish {subject.pattern}",
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": "nats",
                "messaging.operation.type": "publish",
                "messaging.destination.name": subj,
                "messaging.message.id": msg_id or "",
            },
        ):
            inject_headers(headers)
            if subject.transport is Transport.JETSTREAM:
                if msg_id:
                    headers["Nats-Msg-Id"] = msg_id
                await self._js_publish(subj, payload, headers, retry_for_s)
            else:
                await self.nc.publish(subj, payload, headers=headers)

    async def _js_publish(
        self, subj: str, payload: bytes, headers: dict[str, str], retry_for_s: float
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + retry_for_s
        delay = 0.05
        while True:
            attempt = loop.time()
            try:
                await self.js.publish(subj, payload, headers=headers, timeout=2.0)
                return
            except Exception as exc:
                if self.denied.get(subj.lower(), -1.0) >= attempt:  # refused, not lost: no retry
                    raise PermissionDenied(f"the NATS server refused publishing to {subj}") from exc
                if loop.time() + delay > deadline or self._closing:
                    raise
                self.log.warning("publish_retry", subject=subj, error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def publish_raw(self, subject: str, payload: bytes, headers: dict[str, str] | None = None) -> None:
        """Send bytes as they are (tests use it to send bad input)."""
        await self.nc.publish(subject, payload, headers=headers)

    async def request(self, subject: str, msg: Message, expected: type[M], timeout: float = 2.0) -> M:
        payload, headers = encode(msg)
        inject_headers(headers)
        reply = await self.nc.request(subject, payload, headers=headers, timeout=timeout)
        return decode(reply.data, reply.headers, expected)

    # -- receive ------------------------------------------------------------
    async def report_bad_input(self, subject: str, err: DecodeError) -> None:
        """Log and publish an :class:`ErrorEvent` for a message that did not decode."""
        self.decode_errors += 1
        self.log.error("bad_input", subject=subject, reason=err.reason, kind=err.kind)
        event = ErrorEvent(service=self.name, subject=subject, reason=err.reason, kind=err.kind)
        with contextlib.suppress(Exception):
            await self.publish(ERROR, event, retry_for_s=2.0, service=self.name)

    def _span(self, msg: Msg, operation: str) -> Any:
        return _tracer.start_as_current_span(
            f"{operation} {msg.subject}",
            context=extract_context(msg.headers),
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": "nats",
                "messaging.operation.type": operation,
                "messaging.destination.name": msg.subject,
            },
        )

    async def subscribe(
        self,
        subject: str,
        handler: Handler[M],
        expected: type[M],
        *,
        queue: str = "",
        trace_messages: bool = True,
    ) -> Any:
        """Core NATS subscription delivering decoded ``expected`` messages to ``handler``."""

        async def cb(raw: Msg) -> None:
            try:
                msg = decode(raw.data, raw.headers, expected)
            except DecodeError as err:
                await self.report_bad_input(raw.subject, err)
                return
            try:
                if trace_messages:
                    with self._span(raw, "process"):
                        await handler(msg, raw)
                else:
                    await handler(msg, raw)
            except Exception as exc:
                self.log.exception("handler_failed", subject=raw.subject, error=repr(exc))

        return await self.nc.subscribe(subject, queue=queue, cb=cb, pending_msgs_limit=1_000_000)

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
    ) -> asyncio.Task[None]:
        """Run a durable pull consumer in the background until :meth:`close`.

        The handler must be idempotent: a message is acknowledged only after it
        returns, so a crash in between delivers it again. A handler that raises gets
        the message redelivered (``nak`` with a delay) up to ``max_deliver`` times.
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
        task = asyncio.create_task(
            self._consume_loop(stream, durable, config, handler, expected, batch),
            name=f"consume:{durable}",
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _consume_loop(
        self,
        stream: StreamSpec,
        durable: str,
        config: ConsumerConfig,
        handler: Callable[[Message, Msg], Awaitable[None]],
        expected: tuple[type[Message], ...],
        batch: int,
    ) -> None:
        sub = None
        handled: dict[tuple[int, Any], None] = {}  # (stream seq, stored at) of handled messages
        bound_at = -1  # self.reconnects when the subscription was bound
        idle = 0  # consecutive empty fetches
        try:
            while not self._closing:
                try:
                    # A pull subscription can stall silently after a reconnect or a
                    # consumer leader change (nats.py issue 504): bind it again after
                    # every reconnect, and check on it after 10 s without a message.
                    if sub is not None and (self.reconnects != bound_at or idle >= 10):
                        idle = 0
                        with contextlib.suppress(Exception):
                            await sub.unsubscribe()
                        sub = None
                    if sub is None:
                        try:
                            await self.js.consumer_info(stream.name, durable)
                        except NotFoundError:
                            await self.js.add_consumer(stream.name, config)
                        bound_at = self.reconnects
                        sub = await self.js.pull_subscribe_bind(durable, stream=stream.name)
                    msgs = await sub.fetch(batch, timeout=1.0)
                    idle = 0
                except TimeoutError:
                    idle += 1
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    # Server restart, lost connection, stream or consumer gone: re-bind.
                    self.log.warning("consume_rebind", durable=durable, error=repr(exc))
                    if sub is not None:
                        with contextlib.suppress(Exception):
                            await sub.unsubscribe()
                    sub = None
                    with contextlib.suppress(Exception):
                        # bounded: a request that reached a server going down is never answered
                        await asyncio.wait_for(ensure_topology(self.js), 1.0)
                    await asyncio.sleep(0.2)
                    continue
                for raw in msgs:
                    await self._deliver(raw, handler, expected, handled)
        finally:
            # Unsubscribe, or the connection's drain waits 30 s on this pull subscription's
            # queue (nats.py's fetch discards late status messages without task_done).
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _deliver(
        self,
        raw: Msg,
        handler: Callable[[Message, Msg], Awaitable[None]],
        expected: tuple[type[Message], ...],
        handled: dict[tuple[int, Any], None] | None = None,
    ) -> None:
        # A redelivery of a message this consumer already handled (its ack was lost,
        # e.g. in a server restart) is acknowledged again, not handled twice.
        key = None
        if handled is not None:
            with contextlib.suppress(Exception):
                md = raw.metadata
                key = (md.sequence.stream, md.timestamp)
                if md.num_delivered > 1 and key in handled:
                    await raw.ack()
                    return
        try:
            msg = decode(raw.data, raw.headers)
            if not isinstance(msg, expected):
                raise DecodeError(f"{raw.subject} does not carry {msg.KIND!r}", msg.KIND)
        except DecodeError as err:
            await self.report_bad_input(raw.subject, err)
            with contextlib.suppress(Exception):
                await raw.term()
            return
        with self._span(raw, "process") as span:
            try:
                await handler(msg, raw)
            except Exception as exc:
                span.set_status(Status(StatusCode.ERROR, repr(exc)))
                self.log.exception("handler_failed", subject=raw.subject, error=repr(exc))
                with contextlib.suppress(Exception):
                    await raw.nak(delay=0.5)
                return
        if handled is not None and key is not None:
            handled[key] = None
            if len(handled) > 100_000:
                del handled[next(iter(handled))]
        with contextlib.suppress(Exception):
            await raw.ack()

"""The bus: one NATS connection with typed, traced publish and consume.

>>> bus = await Bus.connect("nats://127.0.0.1:4222", name="failure-detector")
>>> await bus.publish(FAILED, RankFailed(...), job="j1", msg_id=incident)
>>> await bus.subscribe(HEARTBEAT.wildcard(job="j1"), on_heartbeat, Heartbeat)
>>> bus.consume(EVENTS, "detector", EXITED.wildcard(), on_exit, (RankExited,))
>>> record = await (await bus.kv.bucket(JOBS_BUCKET)).get_as("j1.plan", JobRecord)
>>> last = await bus.streams.last(SCHED, CAPACITY.format(cluster="c"), CapacityChanged)
>>> await bus.close()

Every NATS call of Phalanx goes through a :class:`Bus`; its parts live beside it:
publish/subscribe/request here, durable consumers in :mod:`.consumer`, stream reads in
:mod:`.streams` (``bus.streams``), KV buckets in :mod:`.kv` (``bus.kv``), refused input in
:mod:`.badinput`, what a lost server is logged as in :mod:`.outage`, login options in :mod:`.auth`.

Every received message is decoded against the expected model. A message that
fails to decode never reaches a handler: it is logged, reported on
``phalanx.err.<service>`` and (for JetStream) terminated so it is not redelivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import BadRequestError
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from phalanx.bus.auth import PERMISSION_VIOLATION, PermissionDenied, nats_auth_options, nats_url
from phalanx.bus.badinput import BadInputReporter
from phalanx.bus.consumer import Consumers, decode_on, process_span
from phalanx.bus.kv import Buckets
from phalanx.bus.outage import Outage
from phalanx.bus.streams import Streams
from phalanx.bus.topology import ensure_topology
from phalanx.contract import DecodeError, Message, decode, encode
from phalanx.contract.subjects import BOUND_TOKENS, Subject, Transport, sender_mismatch
from phalanx.telemetry import get_logger, inject_headers

M = TypeVar("M", bound=Message)

UNACKED_BOUND_S = 15.0
"""How long bytes sent to the server may go unacknowledged before the kernel drops the
connection (``TCP_USER_TIMEOUT``, Linux). Without it, a partition that outlasts
nats.py's own stale check (3 PINGs, 15 s) can hold a client for minutes after it
heals: on reconnecting, nats.py waits for its old transport to close, which first
flushes whatever it had buffered to a peer that no longer answers, while the
kernel's retransmissions back off towards a minute apart. Measured here (a client
publishing 50 KB/s, its link to NATS blackholed for 60 s): back 47 s after the heal
without it, 0.3 s after with it."""


def _bound_unacked(nc: Client) -> None:
    """Give the client's TCP socket :data:`UNACKED_BOUND_S` (on connect, and on every reconnect)."""
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    writer = getattr(getattr(nc, "_transport", None), "_bare_io_writer", None)
    sock = writer.get_extra_info("socket") if writer is not None else None
    if option is None or sock is None:
        return
    with contextlib.suppress(OSError):  # not TCP (a test's socket pair): nothing to bound
        sock.setsockopt(socket.IPPROTO_TCP, option, int(UNACKED_BOUND_S * 1000))


Handler = Callable[[M, Msg], Awaitable[None]]

_tracer = trace.get_tracer("phalanx.bus")


class _Events:
    """nats.py's callbacks for one connection: refusals, errors, loss and recovery."""

    def __init__(self, url: str, user: str | None) -> None:
        self.url, self.user = url, user
        self.bus: Bus | None = None  # set once connected: before that, errors decide the connect

    async def on_error(self, exc: Exception) -> None:
        text = str(exc).lower()
        bus = self.bus
        if bus is None:
            if "authorization violation" in text:
                # Wrong or unknown credentials: retrying forever would only hide it.
                raise PermissionDenied(
                    f"nats: authorization violation: {self.url.split('@')[-1]} refused user {self.user!r}"
                )
            if isinstance(exc, ssl.SSLError):
                raise exc  # a certificate that does not verify will not verify on the next try
            return
        refused = PERMISSION_VIOLATION.search(text)
        if refused:
            bus.denied[refused.group(2)] = asyncio.get_running_loop().time()
            bus.log.error(
                "permission_denied",
                operation=refused.group(1),
                subject=refused.group(2),
                user=self.user,
                error=str(exc),
            )
        elif "authorization violation" in text:
            bus.log.error("nats_auth_failed", user=self.user, error=str(exc))
        else:  # during an outage: every failed reconnect attempt (see .outage)
            bus.outage.symptom(type(exc).__name__, "nats_error", error=repr(exc))

    async def on_disconnect(self) -> None:
        # nats.py reports its own drain/close as a disconnect too: only a lost
        # connection is worth a warning.
        if self.bus is not None and not self.bus.closing:
            self.bus.outage.lost(self.bus.server)

    async def on_reconnect(self) -> None:
        bus = self.bus
        if bus is None:
            return
        bus.reconnects += 1
        _bound_unacked(bus.nc)
        bus.outage.recovered(bus.server)
        for hook in list(bus.reconnect_hooks):
            bus.spawn(hook(), name="reconnect-hook")


class Bus:
    # Error events for refused input (report_bad_input): per subject pattern at most
    # ERROR_EVENTS_PER_S, in bursts of ERROR_EVENTS_BURST, and ERROR_EVENTS_IN_FLIGHT
    # publishes at a time; instances may set their own.
    ERROR_EVENTS_PER_S = 5.0
    ERROR_EVENTS_BURST = 20
    ERROR_EVENTS_IN_FLIGHT = 8

    def __init__(self, nc: Client, name: str) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.name = name
        self.user: str | None = None  # the NATS user it logged in as, set by connect
        self.log = get_logger(component="bus", client=name)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self.reconnects = 0
        # Run after every reconnect: what a core subscription missed meanwhile is
        # gone, so followers of the plan read it again from KV here.
        self.reconnect_hooks: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._server = ""  # see server
        self.denied: dict[str, float] = {}  # subject (lower-cased) -> loop time the server last refused it
        self.outage = Outage(self.log)  # the loss once, repeats with backoff, the recovery once
        self.bad_input = BadInputReporter(self)
        self.report_bad_input = self.bad_input.report
        self.kv = Buckets(self)  # KV buckets: get, put, compare-and-set, watch, read all
        self.streams = Streams(self)  # what the streams hold: last message, history
        consumers = Consumers(self)
        self.consume = consumers.consume  # durable pull consumers (.consumer)
        self.rewind = consumers.rewind

    # -- connection ---------------------------------------------------------
    @classmethod
    async def connect(
        cls,
        url: str | None = None,
        *,
        name: str,
        reconnect_wait_s: float = 0.25,
        ensure: bool = True,
        report_errors: bool = True,
    ) -> Bus:
        """Connect (retrying forever on reconnect) and create the topology if asked.

        With ``PHALANX_NATS_USER`` / ``PHALANX_NATS_PASSWORD`` set it logs in as that
        user (:func:`~phalanx.bus.auth.nats_auth_options`); credentials the server refuses
        raise :class:`PermissionDenied` at once, and a publish or subscription it refuses
        later is logged as ``permission_denied`` with its subject.

        With TLS asked for (a ``tls://`` URL or ``PHALANX_NATS_TLS_*``), a server whose
        certificate does not verify, or that does not offer TLS at all, raises
        :class:`ssl.SSLError` at once instead of being retried (or used in clear).

        ``report_errors=False`` is for a client that is no error publisher (the CLI, a
        policy): what it refuses is logged only, not published on ``phalanx.err.<name>``.
        """
        url = url or nats_url()
        auth = nats_auth_options(url)
        user = auth.get("user") or urlsplit(url.split(",")[0].strip()).username
        events = _Events(url, user)
        log = get_logger(component="bus", client=name)
        nc = Client()
        try:
            await nc.connect(
                url,
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=reconnect_wait_s,  # type: ignore[arg-type]  # seconds, float is fine
                ping_interval=5,
                max_outstanding_pings=3,
                error_cb=events.on_error,
                disconnected_cb=events.on_disconnect,
                reconnected_cb=events.on_reconnect,
                connect_timeout=2,
                **auth,
            )
        except PermissionDenied as exc:
            with contextlib.suppress(Exception):
                await nc.close()
            log.error("nats_auth_failed", user=user, error=str(exc))
            raise
        except ssl.SSLError as exc:
            # bounded: the socket of a failed handshake may never report itself closed
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2.0)
            log.error("nats_tls_failed", error=repr(exc))
            raise
        if "tls" in auth and not getattr(nc, "_server_info", {}).get("tls_required"):
            # nats.py goes on in clear when the server does not offer TLS: refuse that.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2.0)
            where = str(nc.connected_url.netloc if nc.connected_url else url.split("@")[-1])
            log.error("nats_tls_failed", error="no TLS", server=where)
            raise ssl.SSLError(f"nats: TLS was asked for, but the server at {where} does not offer it")
        _bound_unacked(nc)
        bus = events.bus = cls(nc, name)
        bus.user = user
        bus.bad_input.publish_events = report_errors
        if ensure:
            await ensure_topology(bus.js)
        return bus

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def is_connected(self) -> bool:
        return bool(self.nc.is_connected)

    @property
    def reading(self) -> bool:
        """Whether the client's read loop runs: it can end on an error nats.py does not
        recover from while the connection still says it is connected (nothing is heard)."""
        reader = getattr(self.nc, "_reading_task", None)
        return reader is None or not reader.done()

    @property
    def server(self) -> str:
        """``host:port`` of the server connected to (while reconnecting: the last one)."""
        if self.nc.connected_url:
            self._server = str(self.nc.connected_url.netloc)
        return self._server

    @property
    def decode_errors(self) -> int:
        return self.bad_input.decode_errors

    @property
    def bad_input_suppressed(self) -> int:
        return self.bad_input.suppressed

    def spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
        """Run ``coro`` as a task of the bus: :meth:`close` waits for it (then cancels it)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Wait until the server has seen everything sent so far (a PING answered), and so
        every message it sent before its answer has arrived.

        Use this, not ``nc.flush()``: nats-py (2.15, 2.16) writes that PING straight to the
        socket, ahead of the commands still queued for its flusher task, so a ``SUB`` made
        just before could reach the server after the PONG, and a message another connection
        publishes then was not delivered to it. Handing the queue to the socket first keeps
        the order (``_flush_pending`` is nats-py's own way in; there is no public one)."""
        await self.nc._flush_pending(force_flush=True)
        await self.nc.flush(timeout=timeout_s)  # type: ignore[arg-type]  # seconds, float is fine

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
        neither a loss nor a duplicate). ``traced=False`` is for periodic messages
        that belong to no incident (heartbeats, digests, step stats): no span, no context.

        A job, worker or node token not given is the message's own (``ACK`` goes to
        ``phalanx.evt.<job>.ack.<its worker>``): receivers refuse a message whose
        payload names another than its subject (:func:`sender_mismatch`).
        """
        if not isinstance(msg, subject.message):
            raise TypeError(f"{subject.pattern} carries {subject.message.KIND}, not {msg.KIND}")
        for name in BOUND_TOKENS:
            if (
                name in subject.params
                and name not in tokens
                and isinstance(v := getattr(msg, name, None), str)
            ):
                tokens[name] = v
        subj = subject.format(**tokens)
        payload, headers = encode(msg)

        async def send() -> None:
            if subject.transport is Transport.JETSTREAM:
                if msg_id:
                    headers["Nats-Msg-Id"] = msg_id
                await self._js_publish(subj, payload, headers, retry_for_s)
            else:
                await self.nc.publish(subj, payload, headers=headers)

        if not traced:
            await send()
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
            await send()

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
                if isinstance(exc, BadRequestError):  # the stream refused it (10054: over max_msg_size)
                    self.log.error("publish_refused", subject=subj, size=len(payload), error=exc.description)
                    raise
                if loop.time() + delay > deadline or self._closing:
                    raise
                self.outage.symptom(subj, "publish_retry", subject=subj, error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def request(self, subject: str, msg: Message, expected: type[M], timeout: float = 2.0) -> M:
        """Send ``msg`` and wait ``timeout`` s for one reply, decoded as ``expected``."""
        payload, headers = encode(msg)
        inject_headers(headers)
        reply = await self.nc.request(subject, payload, headers=headers, timeout=timeout)
        return decode(reply.data, reply.headers, expected)

    async def reply(self, request: Msg, msg: Message) -> None:
        """Answer ``request`` (received by :meth:`subscribe`) with ``msg``; nothing if it wants no answer."""
        if request.reply:
            payload, headers = encode(msg)
            await self.nc.publish(request.reply, payload, headers=headers)

    # -- receive ------------------------------------------------------------
    async def subscribe_raw(self, subject: str, cb: Callable[[Msg], Awaitable[None]]) -> Subscription:
        """A core subscription handing ``cb`` the messages undecoded: only for a hot path that
        reads its input by hand, faster than a model per message (the detector's digests,
        :mod:`phalanx.services.failure_detector.wire`); ``cb`` refuses what it cannot read
        with :meth:`report_bad_input`, as :meth:`subscribe` does."""
        return await self.nc.subscribe(subject, cb=cb, pending_msgs_limit=1_000_000)

    def decode_input(self, raw: Msg, expected: type[M] | tuple[type[M], ...]) -> M:
        """What :meth:`subscribe` hands its handler: ``raw`` decoded as ``expected`` and checked
        against its subject (:func:`sender_mismatch`); raises :class:`DecodeError`."""
        if isinstance(expected, tuple):
            return decode_on(raw, expected)  # type: ignore[return-value]  # one of expected
        msg = decode(raw.data, raw.headers, expected)
        if (why := sender_mismatch(raw.subject, msg)) is not None:
            raise DecodeError(why, msg.KIND)
        return msg

    async def subscribe(
        self,
        subject: str,
        handler: Handler[M],
        expected: type[M] | tuple[type[M], ...],
        *,
        queue: str = "",
        trace_messages: bool = True,
    ) -> Subscription:
        """Core NATS subscription delivering decoded ``expected`` messages (one model, or any of
        several) to ``handler``. What does not decode, or names another sender than its subject,
        is refused (:meth:`report_bad_input`); a handler that raises is logged."""

        async def cb(raw: Msg) -> None:
            try:
                msg = self.decode_input(raw, expected)
            except DecodeError as err:
                await self.report_bad_input(raw.subject, err)
                return
            try:
                if trace_messages:
                    with process_span(raw):
                        await handler(msg, raw)
                else:
                    await handler(msg, raw)
            except Exception as exc:
                self.log.exception("handler_failed", subject=raw.subject, error=repr(exc))

        return await self.nc.subscribe(subject, queue=queue, cb=cb, pending_msgs_limit=1_000_000)

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
import json
import re
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import DEFAULT_PREFIX, AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BadRequestError, NotFoundError
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from phalanx.bus.subjects import BOUND_TOKENS, ERROR, Subject, Transport, sender_mismatch
from phalanx.bus.topology import StreamSpec, ensure_topology
from phalanx.schemas import DecodeError, ErrorEvent, Message, decode, encode
from phalanx.settings import get_settings
from phalanx.telemetry import extract_context, get_logger, inject_headers

M = TypeVar("M", bound=Message)
Handler = Callable[[M, Msg], Awaitable[None]]

_tracer = trace.get_tracer("phalanx.bus")


def nats_url() -> str:
    """The server URL from ``NATS_URL`` (or ``PHALANX_NATS_URL``)."""
    return get_settings().nats_url


# NATS server authorization (roles and permissions: phalanx.natsauth).
ENV_NATS_USER = "PHALANX_NATS_USER"
ENV_NATS_PASSWORD = "PHALANX_NATS_PASSWORD"
# TLS (any of these, or a tls:// URL, turns it on): the CA that signed the server's
# certificate (default: the system's), this client's certificate and key (for a
# server that verifies clients), and the name to check the server's certificate for.
ENV_NATS_TLS_CA = "PHALANX_NATS_TLS_CA"
ENV_NATS_TLS_CERT = "PHALANX_NATS_TLS_CERT"
ENV_NATS_TLS_KEY = "PHALANX_NATS_TLS_KEY"
ENV_NATS_TLS_HOSTNAME = "PHALANX_NATS_TLS_HOSTNAME"
# nats.py hands error_cb the server's -ERR text lower-cased, subject included.
_PERMISSION_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"')


class PermissionDenied(RuntimeError):
    """The NATS server refused this client's credentials, or a publish it made."""


def inbox_prefix(user: str) -> str:
    """Where a user's replies arrive: the only inbox its permissions let it read."""
    return f"_INBOX.{user}"


def nats_auth_options(url: str) -> dict[str, Any]:
    """Client options for an authorizing and/or TLS server: none when nothing is set.

    ``PHALANX_NATS_USER`` / ``PHALANX_NATS_PASSWORD`` win over a
    ``nats://user:pass@host:port`` URL (which works too, but URLs end up in logs).

    TLS is on when a server URL is ``tls://...`` or any of ``PHALANX_NATS_TLS_CA``
    (a PEM bundle of the CAs to trust instead of the system's), ``PHALANX_NATS_TLS_CERT``
    and ``PHALANX_NATS_TLS_KEY`` (this client's certificate chain and key, for a
    server that verifies clients) is set; ``PHALANX_NATS_TLS_HOSTNAME`` names the
    host the server's certificate must be for (default: the URL's host). The
    server's certificate is always verified.
    """
    settings = get_settings()
    user = settings.nats_user
    opts: dict[str, Any] = {}
    if user:
        opts.update(user=user, password=settings.nats_password.get_secret_value())
    else:
        user = urlsplit(url.split(",")[0].strip()).username
    if user:
        opts["inbox_prefix"] = inbox_prefix(user)
    ca, cert, key = settings.nats_tls_ca, settings.nats_tls_cert, settings.nats_tls_key
    tls_url = any(u.strip().lower().startswith("tls://") for u in url.split(","))
    if tls_url or ca or cert or key:
        if key and not cert:
            raise ValueError(f"{ENV_NATS_TLS_KEY} is set without {ENV_NATS_TLS_CERT}")
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        if cert:
            context.load_cert_chain(cert, key)
        opts["tls"] = context
        if settings.nats_tls_hostname:
            opts["tls_hostname"] = settings.nats_tls_hostname
    return opts


class _BadInputBucket:
    """The error-event budget of one subject pattern (a token bucket), and what it held back."""

    __slots__ = ("flusher", "last", "stamp", "suppressed", "tokens")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp
        self.suppressed = 0
        self.last: tuple[str, DecodeError] | None = None
        self.flusher: asyncio.Task[None] | None = None


def _subject_pattern(subject: str) -> str:
    """The catalogue pattern ``subject`` is an instance of (its tokens as ``*``), else
    ``other``: the key of the error-event budget, whatever the tokens say.

    >>> _subject_pattern("phalanx.hb.j1.w0"), _subject_pattern("nope.x")
    ('phalanx.hb.*.*', 'other')
    """
    from phalanx.bus.subjects import CATALOGUE  # (here: the import line above is shared)

    parts = subject.split(".")
    for s in CATALOGUE:
        pat = s.pattern.split(".")
        if len(pat) == len(parts) and all(p[0] == "{" or p == q for p, q in zip(pat, parts, strict=True)):
            return s.wildcard()
    return "other"


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
        self.log = get_logger(component="bus", client=name)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self.reconnects = 0
        # Run after every reconnect: what a core subscription missed meanwhile is
        # gone, so followers of the plan read it again from KV here.
        self.reconnect_hooks: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self.decode_errors = 0
        self.denied: dict[str, float] = {}  # subject (lower-cased) -> loop time the server last refused it
        self.bad_input_suppressed = 0  # refused inputs reported only in a summary (rate limit)
        self._bad_input: dict[str, _BadInputBucket] = {}  # subject pattern -> its error-event budget
        self._error_sends: set[asyncio.Task[None]] = set()

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

        With TLS asked for (a ``tls://`` URL or ``PHALANX_NATS_TLS_*``), a server whose
        certificate does not verify, or that does not offer TLS at all, raises
        :class:`ssl.SSLError` at once instead of being retried (or used in clear).
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
            if isinstance(exc, ssl.SSLError) and "bus" not in holder:
                raise exc  # a certificate that does not verify will not verify on the next try
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
            # nats.py reports its own drain/close as a disconnect too: only a lost
            # connection is worth a warning.
            if "bus" in holder and not holder["bus"]._closing:
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
        except ssl.SSLError as exc:
            # bounded: the socket of a failed handshake may never report itself closed
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2.0)
            get_logger(component="bus", client=name).error("nats_tls_failed", error=repr(exc))
            raise
        if "tls" in auth and not getattr(nc, "_server_info", {}).get("tls_required"):
            # nats.py goes on in clear when the server does not offer TLS: refuse that.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2.0)
            where = str(nc.connected_url.netloc if nc.connected_url else url.split("@")[-1])
            get_logger(component="bus", client=name).error("nats_tls_failed", error="no TLS", server=where)
            raise ssl.SSLError(f"nats: TLS was asked for, but the server at {where} does not offer it")
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
        """Count, log and publish an :class:`ErrorEvent` for a message that was refused.

        Never waits (the caller is usually a subscription's callback, and a flood of
        bad messages must not hold up the good ones behind it): the event goes out
        from a task of its own, at most ``ERROR_EVENTS_IN_FLIGHT`` at a time. Per
        subject pattern (:func:`_subject_pattern`) at most ``ERROR_EVENTS_PER_S``
        events and log lines a second go out, in bursts of ``ERROR_EVENTS_BURST``;
        what the limit holds back is counted (``bad_input_suppressed``) and reported
        in one summary event and log line (``bad_input_suppressed``, "<count> more
        refused ...") as soon as the budget allows. ``decode_errors`` counts every one.
        """
        self.decode_errors += 1
        now = asyncio.get_running_loop().time()
        key = _subject_pattern(subject)
        bucket = self._bad_input.get(key)
        if bucket is None:
            bucket = self._bad_input[key] = _BadInputBucket(float(self.ERROR_EVENTS_BURST), now)
        self._refill(bucket, now)
        room = len(self._error_sends) < self.ERROR_EVENTS_IN_FLIGHT
        if bucket.suppressed == 0 and bucket.tokens >= 1.0 and room:
            bucket.tokens -= 1.0
            self.log.error("bad_input", subject=subject, reason=err.reason, kind=err.kind)
            self._send_error(ErrorEvent(service=self.name, subject=subject, reason=err.reason, kind=err.kind))
            return
        bucket.suppressed += 1
        bucket.last = (subject, err)
        self.bad_input_suppressed += 1
        if bucket.flusher is None and not self._closing:
            bucket.flusher = task = asyncio.create_task(self._flush_bad_input(key, bucket), name="bad-input")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _refill(self, bucket: _BadInputBucket, now: float) -> None:
        tokens = bucket.tokens + (now - bucket.stamp) * self.ERROR_EVENTS_PER_S
        bucket.tokens = min(float(self.ERROR_EVENTS_BURST), tokens)
        bucket.stamp = now

    async def _flush_bad_input(self, key: str, bucket: _BadInputBucket) -> None:
        """Once the budget allows, one summary of what the rate limit held back on ``key``."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._refill(bucket, loop.time())
                if self._closing or (
                    bucket.tokens >= 1.0 and len(self._error_sends) < self.ERROR_EVENTS_IN_FLIGHT
                ):
                    break
                await asyncio.sleep(max(0.01, (1.0 - bucket.tokens) / self.ERROR_EVENTS_PER_S))
            count, bucket.suppressed = bucket.suppressed, 0
            if count == 0 or bucket.last is None:
                return
            subject, err = bucket.last
            self.log.error(
                "bad_input_suppressed", pattern=key, count=count, subject=subject, reason=err.reason
            )
            if self._closing:
                return
            bucket.tokens -= 1.0
            reason = f"{count} more refused inputs on {key} not reported one by one (rate limit); the last: {err.reason}"
            self._send_error(ErrorEvent(service=self.name, subject=key, reason=reason[:4000], kind=err.kind))
        finally:
            bucket.flusher = None

    def _send_error(self, event: ErrorEvent) -> None:
        async def send() -> None:
            with contextlib.suppress(Exception):
                await self.publish(ERROR, event, retry_for_s=2.0, service=self.name)

        task = asyncio.create_task(send(), name="error-event")
        for tasks in (self._error_sends, self._tasks):
            tasks.add(task)
            task.add_done_callback(tasks.discard)

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
                if (why := sender_mismatch(raw.subject, msg)) is not None:
                    raise DecodeError(why, msg.KIND)
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
        pull_expires_s: float = 1.0,
    ) -> asyncio.Task[None]:
        """Run a durable pull consumer in the background until :meth:`close`.

        The handler must be idempotent: a message is acknowledged only after it
        returns, so a crash in between delivers it again. A handler that raises gets
        the message redelivered (``nak`` with a delay) up to ``max_deliver`` times.
        Messages are pulled up to ``batch`` at a time; a pull waits on the server at
        most ``pull_expires_s`` for the first one (:meth:`close` waits that long at most).
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
            self._consume_loop(stream, durable, config, handler, expected, batch, pull_expires_s),
            name=f"consume:{durable}",
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

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
            info = await self.js.consumer_info(stream.name, durable)
        except NotFoundError:
            return 0
        held = info.num_ack_pending or 0
        if not held:
            return 0
        floor = info.ack_floor.stream_seq if info.ack_floor and info.ack_floor.stream_seq else 0
        config = info.config
        config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = floor + 1
        await self.js.delete_consumer(stream.name, durable)
        await self.js.add_consumer(stream.name, config)
        self.log.info("consumer_rewound", durable=durable, outstanding=held, start_seq=floor + 1)
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
    ) -> None:
        sub: Subscription | None = None  # on this loop's own inbox, where pulled messages arrive
        handled: dict[tuple[int, Any], None] = {}  # (stream seq, stored at) of handled messages
        checked_at = -1  # self.reconnects when the consumer was last checked
        idle = 0  # consecutive empty pulls
        next_subject = f"{DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{stream.name}.{durable}"
        me = asyncio.current_task()
        try:
            # cancelling(): Python 3.11's wait_for can swallow a cancellation that lands as
            # its inner future completes; a loop that went on would take a standby's input.
            while not self._closing and not (me is not None and me.cancelling()):
                try:
                    # After a reconnect, and after 10 empty pulls, make sure the
                    # consumer still exists (a server that lost its state, a deleted consumer).
                    if sub is None or self.reconnects != checked_at or idle >= 10:
                        idle = 0
                        try:
                            await self.js.consumer_info(stream.name, durable)
                        except NotFoundError:
                            await self.js.add_consumer(stream.name, config)
                        checked_at = self.reconnects
                    if sub is None:
                        sub = await self.nc.subscribe(self.nc.new_inbox())
                    msgs = await self._pull(sub, next_subject, batch, pull_expires_s)
                    idle = 0 if msgs else idle + 1
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
        await self.nc.publish(next_subject, json.dumps(request).encode(), reply=sub.subject)
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
            msg = decode_on(raw, expected)
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

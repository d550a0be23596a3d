"""A node's launcher collects its workers' heartbeats locally and publishes one
:class:`~phalanx.contract.NodeDigest` per interval.

Why: at 2,000 nodes x 8 ranks, one heartbeat per rank is 16,000 messages per
interval for one detector to decode; one digest per node is 2,000, and the
digest is also the node's own heartbeat (a node that goes silent is one
``NodeLost``, not eight ``RankHung``).

Ranks send each heartbeat as one datagram to the launcher's unix datagram
socket (``PHALANX_HEARTBEAT_SOCKET``, :mod:`phalanx.worker.heartbeat`). The
socket has ``SO_PASSCRED`` on, so the kernel attaches the sender's real pid to
every datagram (``SCM_CREDENTIALS``); a datagram is accepted only from the pid
the launcher spawned for that worker (:meth:`NodeDigestPublisher.expect`), which
makes a heartbeat forged by another process impossible. Everything else is
dropped, counted (``refused``) and logged at most once a second.

Each digest carries, per expected worker that has heartbeated, its latest
heartbeat and ``age_ms``, how long ago the launcher received it (monotonic), so
the detector can date it. A worker whose last heartbeat said ``DONE`` is carried
once more, then dropped.

Heartbeats also carry the steps a rank completed since its last one (step time,
loss). The launcher gathers them and publishes them on JetStream about once a
second (:class:`~phalanx.contract.StepStats` on ``phalanx.evt.<job>.steps``), off
the digest's schedule, so a slow acknowledgement never delays a digest; that
record of the run is what ``phalanx report`` draws after the job.

The launcher also answers the detector's probe of its node
(``phalanx.node.<job>.<node>.ping``) with its own id: when many nodes fall silent
at once, the detector asks before it judges any of them, and the server's "no
responders" (this launcher's connection is gone) is what confirms a node lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nats.aio.subscription
from nats.aio.msg import Msg

from phalanx.bus import Bus
from phalanx.contract import (
    DecodeError,
    DigestEntry,
    HealthReply,
    Heartbeat,
    NodeDigest,
    Phase,
    Ping,
    StepRecord,
    StepStats,
    decode,
    headers_for,
)
from phalanx.contract.subjects import NODE_DIGEST, NODE_PROBE, STEPS

__all__ = ["NodeDigestPublisher"]

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ANC_SIZE = socket.CMSG_SPACE(_CREDS.size)
_MAX_DATAGRAM = 65536
_HB_HEADERS = headers_for(Heartbeat)
STEPS_INTERVAL_S = 1.0
_STEPS_PER_MSG = 256  # ~170 B each at most: a batch stays under PHALANX_EVT's max_msg_size (64 KiB)
_STEPS_KEPT = 16 * _STEPS_PER_MSG  # kept while NATS is away; the oldest go first


@dataclass
class _Latest:
    hb: Heartbeat
    received: float  # time.monotonic()


class NodeDigestPublisher:
    """Receives the local workers' heartbeats; publishes the node's digest every interval.

    The launcher calls :meth:`expect` when it spawns a worker process and
    :meth:`forget` once that process has exited.
    """

    def __init__(
        self,
        bus: Bus,
        *,
        job: str,
        node: str,
        launcher: str,
        host: str,
        socket_path: Path,
        interval_s: float,
        steps_interval_s: float = STEPS_INTERVAL_S,
        on_heartbeat: Callable[[Heartbeat], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        NODE_DIGEST.format(job=job, node=node)  # raises ValueError for a bad job or node name
        self.bus = bus
        self.job, self.node, self.launcher, self.host = job, node, launcher, host
        self.socket_path = Path(socket_path)
        self.interval_s = interval_s
        self.seq = 0
        self.received = 0
        self.refused = 0
        self.published = 0
        self._expected: dict[str, int] = {}
        self._latest: dict[str, _Latest] = {}
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refused_logged_at = -1.0
        self._refused_unlogged = 0
        self.on_heartbeat = on_heartbeat
        """Called with every heartbeat accepted (the launcher's metrics)."""
        self.steps_interval_s = steps_interval_s
        self.steps_seq = 0
        self._steps: list[StepRecord] = []
        self._pending: StepStats | None = None  # sent, not yet acknowledged
        self._steps_task: asyncio.Task[None] | None = None
        self._probe_sub: nats.aio.subscription.Subscription | None = None
        self._started = time.monotonic()

    # -- the launcher's side -----------------------------------------------------------
    def expect(self, worker: str, pid: int) -> None:
        """``worker`` now runs as process ``pid``: accept its heartbeats (and only from it)."""
        if self._expected.get(worker) != pid:
            self._latest.pop(worker, None)  # a new incarnation starts with no heartbeat
        self._expected[worker] = pid

    def forget(self, worker: str) -> None:
        """``worker``'s process has exited: refuse and stop reporting it (what it sent
        before it ended, its last steps, is taken first)."""
        self._drain()
        self._expected.pop(worker, None)
        self._latest.pop(worker, None)

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.socket_path).st_mode):
                self.socket_path.unlink()  # left by an earlier launcher
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.setblocking(False)
            sock.bind(str(self.socket_path))
            os.chmod(self.socket_path, 0o600)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        await self.answer_probes()  # (already, if the launcher asked first)
        loop.add_reader(sock.fileno(), self._drain)
        self._task = asyncio.create_task(self._run(), name=f"node-digest-{self.node}")
        self._steps_task = asyncio.create_task(self._run_steps(), name=f"node-steps-{self.node}")
        self.bus.log.info("node_digest_started", node=self.node, socket=str(self.socket_path))

    async def stop(self) -> None:
        """Stop publishing; the last digest goes out first (workers forgotten by then are not in it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            with contextlib.suppress(Exception):
                await self.publish_now()
        if self._steps_task is not None:
            self._steps_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._steps_task
            self._steps_task = None
            self._drain()
            try:
                await self.publish_steps(retry_for_s=2.0)
            except Exception as exc:
                self.bus.log.warning("step_stats_lost", steps=len(self._steps), error=repr(exc))
        if self._sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        if self._probe_sub is not None:
            with contextlib.suppress(Exception):
                await self._probe_sub.unsubscribe()
            self._probe_sub = None

    async def answer_probes(self) -> None:
        """Answer the detector's question whether this node's launcher is there (before
        the first digest: the detector may ask as soon as it tracks the node)."""
        if self._probe_sub is None:
            self._probe_sub = await self.bus.subscribe(
                NODE_PROBE.format(job=self.job, node=self.node), self._on_probe, Ping, trace_messages=False
            )

    async def _on_probe(self, ping: Ping, raw: Msg) -> None:
        """The detector asks whether this node's launcher is there: it is, and says which."""
        details: dict[str, str | int | float | bool] = {"seq": self.seq, "workers": len(self._expected)}
        await self.bus.reply(
            raw,
            HealthReply(
                service="launcher",
                status="ok",
                uptime_s=round(time.monotonic() - self._started, 3),
                instance=self.launcher,
                details=details,
            ),
        )

    # -- receiving -----------------------------------------------------------------------
    def _drain(self) -> None:
        sock = self._sock
        while sock is not None:
            try:
                data, anc, _, _ = sock.recvmsg(_MAX_DATAGRAM, _ANC_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.bus.log.warning("heartbeat_socket_error", error=repr(exc))
                return
            self._accept(data, _sender_pid(anc))

    def _accept(self, data: bytes, sender: int | None) -> None:
        try:
            hb = decode(data, _HB_HEADERS, Heartbeat)
        except DecodeError as err:
            self._refuse(sender, f"not a heartbeat: {err.reason}")
            return
        expected = self._expected.get(hb.worker)
        if hb.job != self.job or expected is None:
            self._refuse(sender, f"unexpected worker {hb.job}/{hb.worker}")
        elif sender != expected or hb.pid != expected:
            self._refuse(sender, f"{hb.worker} runs as pid {expected}, not {sender} (says {hb.pid})")
        else:
            self.received += 1
            self._latest[hb.worker] = _Latest(hb, time.monotonic())
            if self.on_heartbeat is not None:
                self.on_heartbeat(hb)
            self._steps.extend(r for r in hb.finished if r.worker == hb.worker)
            if len(self._steps) > _STEPS_KEPT:
                del self._steps[: len(self._steps) - _STEPS_KEPT]

    def _refuse(self, sender: int | None, why: str) -> None:
        self.refused += 1
        self._refused_unlogged += 1
        now = time.monotonic()
        if now - self._refused_logged_at >= 1.0:
            self.bus.log.warning(
                "heartbeat_refused", reason=why, sender_pid=sender, refused=self._refused_unlogged
            )
            self._refused_logged_at, self._refused_unlogged = now, 0

    # -- publishing ----------------------------------------------------------------------
    def digest(self) -> NodeDigest:
        """The digest now; entries of workers that said DONE are dropped after this one."""
        now = time.monotonic()
        entries = []
        for worker, latest in list(self._latest.items()):
            hb = latest.hb
            entries.append(
                DigestEntry(
                    worker=worker,
                    pid=hb.pid,
                    seq=hb.seq,
                    rank=hb.rank,
                    generation=hb.generation,
                    step=hb.step,
                    step_ms=hb.step_ms,
                    phase=hb.phase,
                    phase_ms=hb.phase_ms,
                    age_ms=max(0.0, (now - latest.received) * 1e3),
                    interval_ms=hb.interval_ms,
                    collective_bound_ms=hb.collective_bound_ms,
                    op=hb.op,
                )
            )
            if hb.phase is Phase.DONE:
                del self._latest[worker]
        digest = NodeDigest(
            job=self.job,
            node=self.node,
            launcher=self.launcher,
            host=self.host,
            seq=self.seq,
            interval_ms=self.interval_s * 1e3,
            entries=entries,
        )
        self.seq += 1
        return digest

    async def publish_now(self) -> None:
        """Publish the digest now (the loop does every interval; raises when NATS refuses)."""
        await self.bus.publish(NODE_DIGEST, self.digest(), traced=False, job=self.job, node=self.node)
        self.published += 1

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            self._drain()  # what is already queued counts for this digest
            try:
                await self.publish_now()
            except Exception as exc:  # disconnected: keep the schedule, try again
                self.bus.log.debug("node_digest_failed", error=repr(exc))
            next_at += self.interval_s
            delay = next_at - loop.time()
            if delay < 0:  # fell behind: resync
                next_at = loop.time()
                delay = 0
            await asyncio.sleep(delay)

    async def publish_steps(self, retry_for_s: float = 30.0) -> int:
        """Publish the steps gathered since the last call (JetStream, acknowledged);
        returns how many. A message that was not acknowledged is sent again as it
        was, under the same ``Nats-Msg-Id``, so a retry is never a duplicate."""
        sent = 0
        while self._pending is not None or self._steps:
            if self._pending is None:
                batch = self._steps[:_STEPS_PER_MSG]
                del self._steps[: len(batch)]
                self._pending = StepStats(
                    job=self.job, node=self.node, launcher=self.launcher, seq=self.steps_seq, steps=batch
                )
                self.steps_seq += 1
            msg = self._pending
            await self.bus.publish(
                STEPS,
                msg,
                traced=False,
                msg_id=f"{self.launcher}:steps:{msg.seq}",
                retry_for_s=retry_for_s,
                job=self.job,
            )
            self._pending = None
            sent += len(msg.steps)
        return sent

    async def _run_steps(self) -> None:
        while True:
            await asyncio.sleep(self.steps_interval_s)
            try:
                await self.publish_steps(retry_for_s=self.steps_interval_s)
            except Exception as exc:  # disconnected: keep them, try again next time
                self.bus.log.debug("step_stats_failed", steps=len(self._steps), error=repr(exc))


def _sender_pid(ancdata: list[tuple[int, int, bytes]]) -> int | None:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDS.size:
            pid, _, _ = _CREDS.unpack_from(data)
            return int(pid)
    return None

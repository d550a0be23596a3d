"""The failure-detector service: the bus side of :mod:`.detector`.

It listens to

- heartbeats, ``phalanx.hb.<job>.<worker>`` (core NATS, untraced, every interval
  from each rank and spare that runs without a node launcher);
- node digests, ``phalanx.node.<job>.<node>`` (core NATS, untraced, every interval
  from each node's launcher: the node is alive, plus each local worker's latest
  heartbeat and its age; 2,000 digests instead of 16,000 heartbeats per interval
  at 2,000 nodes x 8 ranks);
- process exits, ``phalanx.evt.<job>.exited.<node>`` (JetStream, durable consumer
  ``failure-detector-exits``: the launcher's fast crash path; taken only from the
  launcher of the node that runs the worker);
- the planner's join answers and spawn requests, ``phalanx.evt.<job>.joined`` and
  ``phalanx.cmd.<job>.spawn`` (JetStream, durable consumers
  ``failure-detector-joins`` / ``-spawns``, read again from the start at every
  start): which node runs which worker, so that a launcher speaks only for its own
  node's workers (:meth:`Detector.assign`);
- plans, ``phalanx.cmd.<job>.plan`` (JetStream, durable consumer
  ``failure-detector-plans``: membership, generation, removed workers);
- registrations, ``phalanx.evt.<job>.registered.<worker>`` (JetStream, durable consumer
  ``failure-detector-registrations``: the pid each worker runs as; a heartbeat or
  digest entry from another pid is refused, see :mod:`.detector`, "Inputs are
  checked");
- failed collectives, ``phalanx.evt.<job>.comm_error.<worker>`` (a core subscription
  to the JetStream subject: only those reported while it runs), the survivors' word
  that a mass silence is real;

and publishes one verdict per incident: :class:`~phalanx.contract.RankFailed` on
``phalanx.evt.<job>.failed`` (a process exited non-zero or by a signal) or
:class:`~phalanx.contract.RankHung` on ``phalanx.evt.<job>.hung`` (heartbeats lost,
or a step stall), with the incident id ``<job>:<worker>:<pid>`` as
``Nats-Msg-Id``, so a detector restart or a second path never makes a second event;
and :class:`~phalanx.contract.NodeLost` on ``phalanx.evt.<job>.node_lost`` when a
node's digests stop (id ``<job>:node:<node>:<launcher>``; its workers get no
``RankHung`` of their own for that silence).

Each verdict opens a new trace: a root span ``detect`` that starts at the
inferred fault time, links to the message that triggered it (an exit report),
and ends once the event is stored; the event carries that trace downstream
(:mod:`.publish`).

A tick loop asks the detector for expired deadlines. Before it judges, it makes
sure every heartbeat the server already sent has been observed (a PING/PONG
round trip, then the subscriptions' queues drained), so a detector that was
itself slow does not blame the ranks. While disconnected from NATS, or after its
own event loop stalled, it holds all verdicts (:meth:`Detector.hold`). When half a
job goes silent at once it holds that job's silence verdicts
(``mass_silence_hold`` in the log) until something confirms them (:mod:`.mass`): it
asks each held node's launcher, ``phalanx.node.<job>.<node>.ping``, every
``mass_probe_s``; "no responders" judges that node at once; a failed collective
reported meanwhile ends the hold.

Refused input (a heartbeat from a pid the worker did not register, a sequence
number beyond the bound, a message on the wrong subject or naming another
worker or node than its subject, a digest entry or exit about another node's
worker, one that does not decode) changes nothing; it is counted (health:
``decode_errors``, ``refused_pid``, ``refused_seq``, ``refused_node``) and reported as an ``ErrorEvent`` on
``phalanx.err.failure-detector``, rate-limited per subject pattern with a summary
of what was held back (:meth:`Bus.report_bad_input`), so a flood of bad messages
neither blocks the heartbeats behind it nor floods the error stream.

Replicas: two or more detectors may run for the same jobs. Each verdict's
``Nats-Msg-Id`` is its incident id, so JetStream stores it once, whichever
replica decides first; each replica needs durable consumers of its own
(``PHALANX_DETECTOR_REPLICA``), or they would split the exits, plans and
registrations between them.

Configuration (environment, read through :mod:`phalanx.settings`; a bad value stops start-up):

- ``NATS_URL``: the NATS server.
- ``PHALANX_HEARTBEAT_MS`` (100): the heartbeat interval assumed for the
  service's own timing (tick, lag, grace). Each worker's window starts from the
  interval its heartbeats declare and then learns the real one.
- ``PHALANX_DETECTOR_PHI`` (8): phi threshold.
- ``PHALANX_DETECTOR_WINDOW`` (100): inter-arrival samples kept per worker.
- ``PHALANX_DETECTOR_MIN_STD_RATIO`` (0.2), ``PHALANX_DETECTOR_MIN_STD_MS`` (20):
  floors of sigma, as a fraction of the mean interval and absolute.
- ``PHALANX_DETECTOR_PAUSE_RATIO`` (0.15): acceptable pause added to the mean,
  as a fraction of it. With these defaults a regular sender is declared lost
  about 2.3 intervals after its last heartbeat.
- ``PHALANX_DETECTOR_DIGEST_SLACK`` (0.5): added to the silence deadline of a
  worker whose heartbeats come in node digests, as a fraction of the digest
  interval (a heartbeat is seen only with the node's next digest).
- ``PHALANX_STALL_FLOOR_MS`` (5000), ``PHALANX_STALL_FACTOR`` (4): a rank stalls
  after ``max(floor, factor x max recent step_ms)`` in COMPUTE without a step;
  ``PHALANX_STALL_INITIAL_MS`` (60000) before it has completed any step.
- ``PHALANX_DETECTOR_TICK_MS`` (interval/10, within 5..100): tick period.
- ``PHALANX_DETECTOR_MAX_LAG_MS`` (interval/2, at least 50): a tick this late
  means the detector itself stalled; verdicts are held.
- ``PHALANX_DETECTOR_GRACE_MS`` (2 x interval): hold kept after a reconnect.
- ``PHALANX_DETECTOR_JOB`` (all jobs): watch one job only.
- ``PHALANX_DETECTOR_EXIT_MAX_AGE_S`` (3600): exit reports older than this (a
  first start over an old stream) are logged, not judged.
- ``PHALANX_DETECTOR_REPLICA`` (empty): this replica's name, a plain name (letters,
  digits, ``-``, ``_``; at most 32). It goes into the durable consumer names
  (``failure-detector-exits-<replica>``...), so every replica sees every exit, plan
  and registration; empty keeps the names of a single detector.
- ``PHALANX_DETECTOR_MASS_HOLD_S`` (120): the longest a mass silence (at least half
  of a job's tracked workers, or of its nodes, and at least 2, silent within one
  interval) holds that job's silence verdicts when nothing confirms them; 0 never
  holds.

Run it with ``python -m phalanx.services.failure_detector``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from phalanx.services.failure_detector.config import Clock, DetectorConfig
from phalanx.services.failure_detector.detector import Detector
from phalanx.services.failure_detector.mass import Probe
from phalanx.services.failure_detector.publish import VerdictPublisher
from phalanx.services.failure_detector.wire import read_digest

from phalanx.bus import Bus
from phalanx.contract import (
    CollectiveError,
    DecodeError,
    HealthReply,
    Heartbeat,
    Message,
    NodeDigest,
    NodeJoined,
    Ping,
    Plan,
    RankExited,
    Registered,
    SpawnWorkers,
    decode,
)
from phalanx.contract.streams import COMMANDS, EVENTS
from phalanx.contract.subjects import (
    COMM_ERROR,
    EXITED,
    HEARTBEAT,
    JOINED,
    NODE_DIGEST,
    NODE_PROBE,
    PLAN,
    REGISTERED,
    SPAWN,
)
from phalanx.metrics import DetectorMetrics
from phalanx.service import Service
from phalanx.settings import DetectorSettings, load
from phalanx.telemetry import extract_context

__all__ = ["FailureDetector", "ServiceConfig"]

_REPLICA = re.compile(r"[A-Za-z0-9_-]{1,32}")
_PROBES_IN_FLIGHT = 256
"""Questions to held nodes' launchers in flight at once (a mass silence at scale holds
thousands of nodes)."""


@dataclass(frozen=True)
class ServiceConfig:
    """The detector's tuning plus the service's own timing."""

    detector: DetectorConfig = field(default_factory=DetectorConfig)
    heartbeat_s: float = 0.1
    tick_s: float = 0.01
    max_lag_s: float = 0.05
    reconnect_grace_s: float = 0.2
    drain_timeout_s: float = 0.5
    job: str | None = None
    exit_max_age_s: float = 3600.0
    replica: str = ""
    """This replica's name in its durable consumer names ("": a single detector's names)."""

    def __post_init__(self) -> None:
        if self.replica and not _REPLICA.fullmatch(self.replica):
            raise ValueError(
                f"PHALANX_DETECTOR_REPLICA={self.replica!r} is not a plain name "
                "(letters, digits, '-', '_'; at most 32)"
            )

    def durable(self, what: str) -> str:
        """The name of this replica's durable consumer of ``what`` (exits, plans, registrations).

        >>> ServiceConfig(replica="b", job="j1").durable("exits")
        'failure-detector-exits-b-j1'
        """
        replica = f"-{self.replica}" if self.replica else ""
        job = f"-{self.job}" if self.job else ""
        return f"failure-detector-{what}{replica}{job}"

    @classmethod
    def for_interval(cls, heartbeat_s: float, **overrides: Any) -> ServiceConfig:
        """Timing derived from an assumed heartbeat interval (as from the environment).

        >>> c = ServiceConfig.for_interval(0.5)
        >>> c.tick_s, c.max_lag_s, c.reconnect_grace_s
        (0.05, 0.25, 1.0)
        """
        values: dict[str, Any] = dict(
            heartbeat_s=heartbeat_s,
            tick_s=min(0.1, max(0.005, heartbeat_s / 10)),
            max_lag_s=max(0.05, heartbeat_s / 2),
            reconnect_grace_s=2 * heartbeat_s,
        )
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_settings(cls, settings: DetectorSettings | None = None) -> ServiceConfig:
        """The ``PHALANX_*`` knobs above (default: this process's :class:`DetectorSettings`),
        in seconds as the settings give them (no conversion here)."""
        s = settings or load(DetectorSettings)
        hb = s.heartbeat_interval_s
        base = cls.for_interval(hb)
        detector = DetectorConfig(
            phi_threshold=s.detector_phi,
            window=s.detector_window,
            min_std_ratio=s.detector_min_std_ratio,
            min_std_s=s.detector_min_std_s,
            pause_ratio=s.detector_pause_ratio,
            digest_slack_ratio=s.detector_digest_slack_ratio,
            stall_floor_s=s.stall_floor_s,
            stall_factor=s.stall_factor,
            stall_initial_s=s.stall_initial_s,
            straggle_floor_s=s.straggle_floor_s,
            node_floor_s=s.detector_node_floor_s,
            worker_floor_s=s.detector_worker_floor_s,
            mass_hold_s=s.detector_mass_hold_s,
        )
        return cls(
            detector=detector,
            heartbeat_s=hb,
            tick_s=s.detector_tick_s or base.tick_s,
            max_lag_s=s.detector_max_lag_s or base.max_lag_s,
            reconnect_grace_s=s.detector_grace_s or base.reconnect_grace_s,
            job=s.detector_job,
            exit_max_age_s=s.detector_exit_max_age_s,
            replica=s.detector_replica,
        )


class FailureDetector(Service):
    """Heartbeats, digests, exits and plans in; one RankFailed/RankHung/NodeLost per incident out.

    ``run_service(FailureDetector)`` runs it with the configuration from the
    environment; tests build one directly::

        svc = FailureDetector(bus, ServiceConfig.for_interval(0.5))
        await svc.start()
        ...
        await svc.stop()
    """

    name = "failure-detector"
    metrics_type = DetectorMetrics
    settings_type = DetectorSettings
    metrics: DetectorMetrics

    def __init__(
        self,
        bus: Bus,
        config: ServiceConfig | None = None,
        *,
        clock: Clock = time.monotonic,
        wall: Clock = time.time,
    ) -> None:
        super().__init__(bus)
        self.config = config or ServiceConfig.from_settings()
        self.detector = Detector(self.config.detector, clock=clock, wall=wall)
        self.clock, self.wall = clock, wall
        self.verdicts = VerdictPublisher(bus, self.metrics, self.log, wall)
        self.stale_exits = 0
        self.lag_holds = 0
        self.backlog_holds = 0
        self.ticks = 0
        self._hb_sub: Any = None
        self._digest_sub: Any = None
        self._comm_sub: Any = None
        self._probes: set[asyncio.Task[None]] = set()
        self._asking = asyncio.Semaphore(_PROBES_IN_FLIGHT)
        self._tick_task: asyncio.Task[None] | None = None
        self._ping: asyncio.Task[None] | None = None
        self._ping_epoch = 0
        """``bus.reconnects`` when that PING was sent."""
        self.deaf_holds = 0
        self._lag_heartbeat = self.metrics.heartbeat_lag.labels("heartbeat")
        self._lag_digest = self.metrics.heartbeat_lag.labels("digest")

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        tokens = {"job": cfg.job} if cfg.job else {}
        self._hb_sub = await self.bus.subscribe(
            HEARTBEAT.wildcard(**tokens), self._on_heartbeat, Heartbeat, trace_messages=False
        )
        # Not Bus.subscribe: digests take the fast path of _on_digest_raw.
        self._digest_sub = await self.bus.subscribe_raw(NODE_DIGEST.wildcard(**tokens), self._on_digest_raw)
        self._comm_sub = await self.bus.subscribe(
            COMM_ERROR.wildcard(**tokens), self._on_comm_error, CollectiveError, trace_messages=False
        )
        # Which node runs which worker: every answer the stream holds, from its start.
        for stream, what in ((EVENTS, "joins"), (COMMANDS, "spawns")):
            with contextlib.suppress(Exception):  # (a server away: the consumer reads on from where it was)
                await self.bus.streams.delete_consumer(stream, cfg.durable(what))
        self.bus.consume(
            EVENTS, cfg.durable("joins"), [JOINED.wildcard(**tokens)], self._on_placed, (NodeJoined,)
        )
        self.bus.consume(
            COMMANDS, cfg.durable("spawns"), [SPAWN.wildcard(**tokens)], self._on_placed, (SpawnWorkers,)
        )
        self.bus.consume(
            EVENTS,
            cfg.durable("registrations"),
            [REGISTERED.wildcard(**tokens)],
            self._on_registered,
            (Registered,),
        )
        self.bus.consume(
            EVENTS, cfg.durable("exits"), [EXITED.wildcard(**tokens)], self._on_exit, (RankExited,)
        )
        self.bus.consume(COMMANDS, cfg.durable("plans"), [PLAN.wildcard(**tokens)], self._on_plan, (Plan,))
        self._tick_task = asyncio.create_task(self._tick_loop(), name="failure-detector-tick")
        self.log.info(
            "detector_started",
            job=cfg.job or "*",
            replica=cfg.replica,
            heartbeat_ms=cfg.heartbeat_s * 1e3,
            tick_ms=cfg.tick_s * 1e3,
            phi=cfg.detector.phi_threshold,
        )

    async def stop(self) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick_task
        if self._ping is not None and not self._ping.done():  # not cancelled: see _caught_up
            await asyncio.wait({self._ping}, timeout=1.0)
        for t in list(self._probes):
            t.cancel()
        await self.verdicts.drain(timeout=5.0)  # let verdicts already decided reach the bus
        for sub in (self._hb_sub, self._digest_sub, self._comm_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    def health_details(self) -> dict[str, str | int | float | bool]:
        s = self.detector.stats
        return {
            "tracked_workers": len(self.detector),
            "tracked_nodes": sum(1 for _ in self.detector.nodes()),
            "incidents_reported": self.verdicts.reported,
            "incidents_decided": s.incidents,
            "pending_reports": self.verdicts.pending,
            "decode_errors": self.bus.decode_errors,
            "bad_input_suppressed": self.bus.bad_input_suppressed,
            "registrations": s.registrations,
            "stale_registrations": s.stale_registrations,
            "displaced": s.displaced,
            "refused_pid": s.refused_pid,
            "refused_seq": s.refused_seq,
            "refused_node": s.refused_node,
            "seq_resyncs": s.seq_resyncs,
            "mass_holds": s.mass_holds,
            "mass_held": s.mass_held,
            "mass_probes": s.mass_probes,
            "mass_confirmed": s.mass_confirmed,
            "replica": self.config.replica,
            "heartbeats": s.heartbeats,
            "ignored_heartbeats": s.ignored_heartbeats,
            "digests": s.digests,
            "digest_entries": s.digest_entries,
            "ignored_digests": s.ignored_digests,
            "nodes_lost": s.nodes_lost,
            "nodes_left": s.nodes_left,
            "clean_exits": s.clean_exits,
            "repeated_exits": s.repeated_exits,
            "stale_exits": self.stale_exits,
            "stale_plans": s.stale_plans,
            "holds": s.holds,
            "lag_holds": self.lag_holds,
            "backlog_holds": self.backlog_holds,
            "deaf_holds": self.deaf_holds,
            "publish_retries": self.verdicts.retries,
            "reconnects": self.bus.reconnects,
            "ticks": self.ticks,
        }

    # -- inputs --------------------------------------------------------------------
    async def _refuse(self, raw: Msg, msg: Message, why: str) -> None:
        await self.bus.report_bad_input(raw.subject, DecodeError(why, msg.KIND))

    async def _report_refused(self, subject: str, kind: str) -> None:
        """Report what the detector refused (it changed nothing): the bus counts, logs
        and publishes each, rate-limited, without waiting."""
        for r in self.detector.take_refused():
            await self.bus.report_bad_input(subject, DecodeError(r.reason, kind))

    async def _on_heartbeat(self, hb: Heartbeat, raw: Msg) -> None:
        parts = raw.subject.split(".")
        if parts[2:] != [hb.job, hb.worker]:
            await self._refuse(raw, hb, f"heartbeat of {hb.job}/{hb.worker} on {raw.subject}")
            return
        self._lag_heartbeat.observe(max(0.0, self.wall() - hb.ts))
        self.detector.observe(hb)
        if self.detector.refused:
            await self._report_refused(raw.subject, Heartbeat.KIND)

    async def _on_digest_raw(self, raw: Msg) -> None:
        """A digest off the wire (what Bus.subscribe would do, faster).

        Digests are most of the detector's input (one per node per interval, 4,000/s
        at 2,000 nodes and 500 ms); a pydantic model per entry cost as much CPU as
        the detection. :func:`.wire.read_digest` checks a well-formed digest by hand
        into tuples; anything it does not take goes through the full :func:`decode`,
        so a bad digest is refused with the same error event as on any subscription.
        """
        try:
            sent_at: list[float] = []
            fields = read_digest(raw.data, raw.headers, sent_at)
            if fields is None:
                try:
                    d = decode(raw.data, raw.headers, NodeDigest)
                except DecodeError as err:
                    await self.bus.report_bad_input(raw.subject, err)
                    return
                await self._on_digest(d, raw)
                return
            job, node = fields[0], fields[1]
            if raw.subject.split(".")[2:] != [job, node]:
                reason = f"digest of {job}/{node} on {raw.subject}"
                await self.bus.report_bad_input(raw.subject, DecodeError(reason, NodeDigest.KIND))
                return
            self._lag_digest.observe(max(0.0, self.wall() - sent_at[0]))
            self.detector.observe_digest_rows(*fields, sent_at=sent_at[0])
            if self.detector.refused:
                await self._report_refused(raw.subject, NodeDigest.KIND)
        except Exception as exc:
            self.log.exception("handler_failed", subject=raw.subject, error=repr(exc))

    async def _on_digest(self, d: NodeDigest, raw: Msg) -> None:
        parts = raw.subject.split(".")
        if parts[2:] != [d.job, d.node]:
            await self._refuse(raw, d, f"digest of {d.job}/{d.node} on {raw.subject}")
            return
        self._lag_digest.observe(max(0.0, self.wall() - d.ts))
        self.detector.observe_digest(d)
        if self.detector.refused:
            await self._report_refused(raw.subject, NodeDigest.KIND)

    async def _on_exit(self, msg: Message, raw: Msg) -> None:
        if not isinstance(msg, RankExited):  # the bus already refuses other kinds (and other senders)
            return
        age = self.wall() - msg.exited_at
        if age > self.config.exit_max_age_s:
            self.stale_exits += 1
            self.log.warning(
                "stale_exit_ignored", job=msg.job, worker=msg.worker, pid=msg.pid, age_s=round(age, 1)
            )
            return
        incident = self.detector.on_exit(msg)
        if self.detector.refused:  # another node's launcher: nothing changed
            await self._report_refused(raw.subject, RankExited.KIND)
            return
        if incident is None:
            self.log.info(
                "exit_no_incident",
                job=msg.job,
                worker=msg.worker,
                pid=msg.pid,
                exit_code=msg.exit_code,
                signal=msg.signal,
            )
            return
        # Acked only once the verdict is stored: a crash here redelivers the exit.
        await self.verdicts.publish(incident, extract_context(raw.headers))

    async def _on_registered(self, msg: Message, raw: Msg) -> None:
        if not isinstance(msg, Registered):  # (the bus checked its subject names its job and worker)
            return
        outcome, dropped = self.detector.register(msg)
        fields = dict(
            job=msg.job, worker=msg.worker, pid=msg.pid, incarnation=msg.incarnation, launch=msg.launch
        )
        if outcome == "stale":
            self.log.info("stale_registration_ignored", **fields)
        elif outcome == "replaced" or dropped is not None:
            self.log.info("worker_registered", outcome=outcome, dropped_pid=dropped, **fields)
        else:
            self.log.debug("worker_registered", outcome=outcome, **fields)

    async def _on_placed(self, msg: Message, raw: Msg) -> None:
        """The planner placed workers on a node (a join answer, a spawn request)."""
        if isinstance(msg, NodeJoined) and not msg.accepted:
            return
        if isinstance(msg, NodeJoined | SpawnWorkers):
            self.detector.assign(msg.job, msg.node, msg.workers)

    async def _on_plan(self, msg: Message, raw: Msg) -> None:
        if not isinstance(msg, Plan):
            return
        if raw.subject != PLAN.format(job=msg.job):
            await self._refuse(raw, msg, f"plan of job {msg.job} on {raw.subject}")
            return
        if not self.detector.apply_plan(msg):
            self.log.info("stale_plan_ignored", job=msg.job, generation=msg.generation)

    # -- judgement -----------------------------------------------------------------
    async def _tick_loop(self) -> None:
        cfg = self.config
        last = self.clock()
        while True:
            await asyncio.sleep(cfg.tick_s)
            now = self.clock()
            lag, last = now - last - cfg.tick_s, now
            self.ticks += 1
            try:
                if not self.bus.is_connected:
                    self.detector.hold(now + cfg.reconnect_grace_s)
                    continue
                if self._deaf():
                    self.deaf_holds += 1
                    self.detector.hold(now + cfg.reconnect_grace_s)
                    if self.deaf_holds % 100 == 1:
                        self.log.error("detector_deaf", reason="the NATS client's read loop ended")
                    continue
                if lag > cfg.max_lag_s:
                    self.lag_holds += 1
                    self.detector.hold(now)
                    self.log.warning("detector_lagged", lag_ms=round(lag * 1e3, 1))
                    continue
                for job, node, launcher in self.detector.take_probes():
                    t = asyncio.create_task(self._probe(job, node, launcher), name=f"probe-{job}-{node}")
                    self._probes.add(t)
                    t.add_done_callback(self._probes.discard)
                if not self.detector.due():
                    continue
                if not await self._caught_up():
                    self.backlog_holds += 1
                    self.detector.hold(self.clock())
                    continue
                for incident in self.detector.tick():
                    self.verdicts.spawn(incident)
                for h in self.detector.take_mass_holds():
                    self.log.warning(
                        "mass_silence_hold",
                        job=h.job,
                        count=h.workers,
                        nodes=h.nodes,
                        tracked_workers=h.tracked_workers,
                        tracked_nodes=h.tracked_nodes,
                        hold_s=round(h.until - h.started, 3),
                    )
            except Exception as exc:  # the loop must outlive any one bad tick
                self.log.exception("tick_failed", error=repr(exc))

    async def _probe(self, job: str, node: str, launcher: str) -> None:
        """Ask a held node's launcher whether it is there (:mod:`.mass`)."""
        async with self._asking:
            try:
                reply = await self.bus.request(
                    NODE_PROBE.format(job=job, node=node),
                    Ping(),
                    HealthReply,
                    timeout=self.config.detector.mass_probe_s,
                )
            except nats.errors.NoRespondersError:
                outcome = Probe.GONE
            except Exception:  # late, undecodable, or our own connection away: says nothing
                outcome = Probe.SILENT
            else:
                outcome = Probe.ALIVE if reply.instance == launcher else Probe.REPLACED
        if outcome is Probe.GONE or outcome is Probe.REPLACED:
            self.log.info("mass_probe", job=job, node=node, launcher=launcher, outcome=outcome.value)
        self.detector.probed(job, node, launcher, outcome)

    async def _on_comm_error(self, msg: CollectiveError, raw: Msg) -> None:
        self.detector.collective_error(msg)

    async def _caught_up(self) -> bool:
        """Whether every heartbeat and digest the server sent so far has been observed.

        The PONG to a PING comes after every message the server sent before it,
        so once it is back they all sit in the subscriptions' queues; then let the
        subscriptions' tasks empty them.

        The PING is never cancelled: nats.py's ``flush(timeout)`` cancels its
        future on a timeout but leaves it queued, and the late PONG then ends the
        client's read loop (``InvalidStateError`` on ``set_result``) while the
        client still reports itself connected: a detector that hears nothing more
        and judges every node lost. So one PING at a time is in flight, awaited
        here for at most ``drain_timeout_s`` (then: not caught up, a backlog), and
        while it is unanswered the detector is behind by definition.
        """
        ping = self._ping
        if ping is not None and not ping.done():
            if self.bus.reconnects == self._ping_epoch:
                return False  # an earlier PING is still unanswered: messages before it are still coming
            ping.cancel()  # lost with the old connection (a reconnect forgets its PINGs): safe to cancel
        if ping is not None and not ping.cancelled():
            ping.exception()  # (retrieved: a failed PING only means not caught up then)
        # nats.py annotates the timeout as int; it is handed to asyncio.wait_for. Long
        # enough never to expire on a live connection (see above).
        self._ping_epoch = self.bus.reconnects
        self._ping = ping = asyncio.create_task(self.bus.flush(3600), name="failure-detector-ping")
        done, _ = await asyncio.wait({ping}, timeout=self.config.drain_timeout_s)
        if not done or ping.cancelled() or ping.exception() is not None:
            return False
        deadline = self.clock() + self.config.drain_timeout_s
        spins = 0
        subs = [sub for sub in (self._hb_sub, self._digest_sub) if sub is not None]
        while any(sub.pending_msgs > 0 for sub in subs):
            if self.clock() > deadline:
                return False
            spins += 1
            await asyncio.sleep(0 if spins < 100 else 0.001)
        return True

    def _deaf(self) -> bool:
        """Whether the NATS client stopped reading while it says it is connected (its
        read loop ended on an error it does not recover from): nothing is heard, so
        nobody may be judged."""
        return not self.bus.reading

"""The simulated launchers of ``bench.scale``: many per process, each speaking the real
wire protocol through :class:`~phalanx.bus.Bus` and the contract's models.

``python -m bench.scalesim '<config json>'`` runs the launchers of the nodes it is given
(``bench.scale`` starts ``--sim-procs`` of these). Each simulated launcher does what
``phalanx.launcher.launcher.Launcher`` and its workers' agents do on the bus, minus the
processes:

- joins: publishes its node's :class:`~phalanx.contract.JobSpec` on ``JOB_SPEC`` (one
  ``Nats-Msg-Id`` per attempt, as ``Launcher._join``), waits for its
  :class:`~phalanx.contract.NodeJoined`, asks again after a refusal marked ``retry``;
- its workers register: one :class:`~phalanx.contract.Registered` each on ``REGISTERED``
  (ranks, then spares; as ``Agent._start``), and so do spares the planner asks for on
  ``SPAWN`` (:class:`~phalanx.contract.SpawnWorkers`, as ``Launcher._on_spawn``);
- publishes one :class:`~phalanx.contract.NodeDigest` per interval covering its
  registered workers (built from :class:`~phalanx.contract.DigestEntry` models, as
  ``NodeDigestPublisher.digest``): each worker heartbeats once per interval and
  completes a step per heartbeat, alternating COMPUTE and COLLECTIVE, with the rank and
  generation of the plan its node holds;
- receives plans through the design's :class:`~bench.scaleplan.PlanSource` (one per
  launcher, and one per followed rank where the design has ranks read NATS themselves);
- answers the detector's probe of its node (``NODE_PROBE``, as ``NodeDigestPublisher``)
  with its launcher id, from before its join until it is silenced (a node lost: its
  launcher's connection is gone, so the server answers "no responders");
- acknowledges: one :class:`~phalanx.contract.PlanAck` per member worker on ``ACK`` when
  the plan reaches it (a followed rank acknowledges what its own source delivered, the
  other ranks when their launcher holds the plan), and again for a plan re-sent on the
  plan subject more than 0.5 s after it was first held (``Agent._offer``).

What the simulators share that launchers on a cluster would not (each launcher has its own
CPU there; here a thousand share one event loop, and their serial work would measure the
simulator, not the design): a payload delivered to many of a process's launchers is
decoded once (:class:`SimBus`; the server still delivers and counts every copy), and
acknowledgements go out once the process has handled the burst of deliveries in front of
it (:meth:`Simulator._flush_acks`).

Not simulated: the rendezvous store, the ranks' processes and their exits (a fenced
worker sends no ``RankExited``), step statistics, collective errors.

Control: JSON requests on ``bench.scale.ctl.<proc>`` (``status``, ``follow``,
``silence``, ``reset``, ``await``, ``collect``), answered once done.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import json
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bench.scaleplan import Held, PlanSource, design
from phalanx.bus import Bus
from phalanx.contract import (
    DigestEntry,
    HealthReply,
    JobSpec,
    NodeAck,
    NodeDigest,
    NodeJoined,
    Phase,
    Ping,
    PlanAck,
    Registered,
    Role,
    SpawnWorkers,
)
from phalanx.contract.codec import HDR_ENCODING
from phalanx.contract.subjects import (
    ACK,
    JOB_SPEC,
    JOINED,
    NODE_ACK,
    NODE_DIGEST,
    NODE_PROBE,
    REGISTERED,
    SPAWN,
    Subject,
)
from phalanx.launcher.children import worker_names
from phalanx.launcher.launcher import command_fingerprint

CTL = "bench.scale.ctl"
PID_BASE = 10_000_000
SPAWN_PID_BASE = 20_000_000
COMMAND = ["python", "-m", "bench.scale", "(simulated)"]
ACK_QUIET_S = 0.005  # acknowledgements wait until no delivery queued one for this long (_flush_acks)
RESEND_ACK_S = 0.5  # Agent._offer: a re-send this long after the plan was held is acknowledged again


def node_name(k: int) -> str:
    return f"n{k}"


def store_addr(k: int) -> str:
    """A distinct (unreachable) address per simulated node: lost hosts are per node, as on a cluster."""
    return f"10.{(k >> 16) & 255}.{(k >> 8) & 255}.{k & 255}:29400"


class SimBus(Bus):
    """A simulator process's connection, shared by its launchers, decoding each distinct
    payload once (:meth:`decode_input`): every subscription of this process that receives
    the same bytes on the same subject gets the same (frozen) message. On a cluster each
    launcher decodes its own copy on its own CPU, in parallel; here a thousand launchers
    share one core, and decoding one delta a thousand times would measure the simulator,
    not the design. The server still delivers, and counts, every copy."""

    MEMO = 64

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._memo: dict[tuple[str, bytes, str, Any], Any] = {}

    def decode_input(self, raw: Msg, expected: Any) -> Any:
        key = (raw.subject, raw.data, (raw.headers or {}).get(HDR_ENCODING, ""), expected)
        msg = self._memo.get(key)
        if msg is None:
            msg = super().decode_input(raw, expected)
            if len(self._memo) >= self.MEMO:
                self._memo.clear()
            self._memo[key] = msg
        return msg


@dataclass
class SimNode:
    k: int
    launcher: str
    workers: list[str] = field(default_factory=list)
    roles: dict[str, Role] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    registered: list[str] = field(default_factory=list)
    run: str = ""
    joined: bool = False
    dead: bool = False
    held: int = 0
    held_at: dict[int, float] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)
    source: PlanSource | None = None
    seq: int = 0
    probes: Subscription | None = None

    @property
    def name(self) -> str:
        return node_name(self.k)

    def held_since(self, generation: int) -> float | None:
        """When this node first held a plan of ``generation`` or newer."""
        times = [t for g, t in self.held_at.items() if g >= generation]
        return min(times) if times else None


@dataclass
class RankFollower:
    node: SimNode
    worker: str
    source: PlanSource
    held: int = 0
    held_at: float = 0.0


class Simulator:
    """One simulator process: its nodes, their bus traffic and the bench's control requests."""

    def __init__(self, bus: Bus, cfg: dict[str, Any]) -> None:
        self.bus, self.cfg = bus, cfg
        self.job: str = cfg["job"]
        self.proc: int = cfg["proc"]
        self.interval: float = cfg["interval_s"]
        self.design = design(cfg["design"])
        per, spares = cfg["ranks_per_node"], cfg["spares_per_node"]
        self.nodes: dict[int, SimNode] = {}
        for k in cfg["nodes"]:
            n = SimNode(k, f"{node_name(k)}-{uuid.uuid4().hex[:12]}")
            n.workers = worker_names(n.name, per + spares, qualified=True)
            self.nodes[k] = n
        self.by_launcher = {n.launcher: n for n in self.nodes.values()}
        self.rank_followers: dict[str, RankFollower] = {}
        self.followed: set[str] = set()  # workers whose own source acknowledges for them
        self.acks_in_flight = 0
        self._acks: list[tuple[Subject, PlanAck | NodeAck]] = []
        self._ack_flush: asyncio.Future[None] | None = None
        self.acks_sent = 0
        self.ack_errors = 0
        self.digests_sent = 0
        self.lags: list[float] = []
        self.spawned = 0
        self._joined: dict[str, asyncio.Future[NodeJoined]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._changed = asyncio.Event()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- join and registrations ------------------------------------------------------------
    async def start(self) -> None:
        await self.bus.subscribe(JOINED.format(job=self.job), self._on_joined, NodeJoined)
        await self.bus.subscribe(SPAWN.format(job=self.job), self._on_spawn, SpawnWorkers)
        await self.bus.nc.subscribe(f"{CTL}.{self.proc}", cb=self._on_ctl)
        self._spawn(self._join_all())
        self._spawn(self._digests())

    async def _join_all(self) -> None:
        gate = asyncio.Semaphore(self.cfg.get("join_concurrency", 16))

        async def one(n: SimNode) -> None:
            async with gate:
                await self._join(n)
                await self._register(n, n.workers)

        await asyncio.gather(*(one(n) for n in self.nodes.values()))

    async def _join(self, n: SimNode) -> None:
        cfg = self.cfg

        async def answer(ping: Ping, raw: Msg) -> None:
            await self.bus.reply(
                raw, HealthReply(service="launcher", status="ok", uptime_s=0.0, instance=n.launcher)
            )

        n.probes = await self.bus.subscribe(
            NODE_PROBE.format(job=self.job, node=n.name), answer, Ping, trace_messages=False
        )
        spec = JobSpec(
            job=self.job,
            node=n.name,
            launcher=n.launcher,
            host=f"sim-{n.k}",
            store_addr=store_addr(n.k),
            workers=list(n.workers),
            ranks=cfg["ranks_per_node"],
            min_nodes=cfg["min_nodes"],
            max_nodes=cfg["max_nodes"],
            global_batch=cfg["global_batch"],
            command=command_fingerprint(COMMAND),
        )
        loop = asyncio.get_running_loop()
        for attempt in range(1000):
            fut = self._joined[n.launcher] = loop.create_future()
            msg_id = f"{self.job}:spec:{n.launcher}:{attempt}"
            await self.bus.publish(JOB_SPEC, spec, job=self.job, node=n.name, msg_id=msg_id)
            joined = await asyncio.wait_for(fut, self.cfg.get("join_timeout_s", 300.0))
            if joined.accepted:
                n.run, n.joined = joined.run, True
                n.workers[:] = list(joined.workers)
                per = cfg["ranks_per_node"]
                for i, w in enumerate(n.workers):
                    n.roles[w] = Role.SPARE if joined.as_spares or i >= per else Role.RANK
                    n.pids[w] = PID_BASE + n.k * len(n.workers) + i
                return
            if not joined.retry:
                raise RuntimeError(f"node {n.name} refused: {joined.reason}")
            await asyncio.sleep(0.5)

    async def _on_joined(self, msg: NodeJoined, raw: Msg) -> None:
        fut = self._joined.get(msg.launcher)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def _register(self, n: SimNode, names: list[str]) -> None:
        for w in names:
            pid = n.pids[w]
            reg = Registered(
                job=self.job, worker=w, role=n.roles[w], host=f"sim-{n.k}", pid=pid, launch=n.run
            )
            msg_id = f"{self.job}:{w}:{pid}:registered"
            await self.bus.publish(REGISTERED, reg, job=self.job, worker=w, msg_id=msg_id)
            n.registered.append(w)

    async def _on_spawn(self, msg: SpawnWorkers, raw: Msg) -> None:
        n = self.by_launcher.get(msg.launcher)
        if n is None or n.dead or msg.run != n.run:
            return
        new = [w for w in msg.workers if w not in n.pids]
        for w in new:
            self.spawned += 1
            n.workers.append(w)
            n.roles[w] = Role.SPARE
            n.pids[w] = SPAWN_PID_BASE + self.proc * 1_000_000 + self.spawned
        if new:
            self._spawn(self._register(n, new))

    # -- digests ---------------------------------------------------------------------------
    def digest(self, n: SimNode, m: int) -> NodeDigest:
        """Node ``n``'s digest for interval ``m``: every registered worker heartbeated once."""
        ms = self.interval * 1e3
        entries = [
            DigestEntry(
                worker=w,
                pid=n.pids[w],
                seq=m,
                rank=n.ranks.get(w, -1),
                generation=n.held,
                step=m,
                step_ms=ms * 0.8,
                phase=Phase.COMPUTE if m % 2 == 0 else Phase.COLLECTIVE,
                phase_ms=ms * 0.2,
                age_ms=ms * 0.5,
                interval_ms=ms,
                collective_bound_ms=2000.0,
                op=m % 2,
            )
            for w in n.registered
        ]
        return NodeDigest(
            job=self.job,
            node=n.name,
            launcher=n.launcher,
            host=f"sim-{n.k}",
            seq=n.seq,
            interval_ms=ms,
            entries=entries,
        )

    async def _digests(self) -> None:
        """Each joined node's digest every interval, spread evenly over it (a launcher's
        timer); the loop wakes at most every 5 ms and sends what is due."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ks = sorted(self.nodes)
        due = [(t0 + self.interval * i / len(ks), k) for i, k in enumerate(ks)]
        heapq.heapify(due)
        while due:
            now = loop.time()
            while due and due[0][0] <= now:
                at, k = heapq.heappop(due)
                n = self.nodes[k]
                if n.dead:
                    continue
                heapq.heappush(due, (at + self.interval, k))
                if not n.joined:
                    continue
                self.lags.append(now - at)
                with contextlib.suppress(Exception):
                    await self.bus.publish(
                        NODE_DIGEST, self.digest(n, n.seq), traced=False, job=self.job, node=n.name
                    )
                    self.digests_sent += 1
                n.seq += 1
            if due:
                await asyncio.sleep(max(0.005, due[0][0] - loop.time()))

    # -- plans and acknowledgements ----------------------------------------------------------
    async def follow(self) -> tuple[int, int]:
        """Start each live launcher's source, and the followed ranks' (``rank_stride``)."""
        stride = self.cfg["rank_stride"]
        started = ranks = 0
        for n in self.nodes.values():
            if n.dead or n.source is not None:
                continue
            n.source = self.design.launcher_source(self.bus, self.job, n.name, n.launcher, n.workers, n.run)
            await n.source.start(functools.partial(self._launcher_held, n))
            started += 1
            if not stride:
                continue
            for i, w in enumerate(list(n.workers)):
                if (n.k * len(n.workers) + i) % stride:
                    continue
                src = self.design.rank_source(self.bus, self.job, w)
                if src is None:
                    continue
                rf = self.rank_followers[w] = RankFollower(n, w, src)
                self.followed.add(w)
                await src.start(functools.partial(self._rank_held, rf))
                ranks += 1
        return started, ranks

    def _launcher_held(self, n: SimNode, h: Held) -> None:
        if n.dead or h.launch != n.run:
            return
        now = time.time()
        if h.generation > n.held:
            n.held, n.ranks = h.generation, dict(h.ranks)
            n.held_at[h.generation] = now
            if h.lost:  # this node was declared lost: it fences everything and ends
                n.dead = True
            self._ack(n, h, [w for w in h.ranks if w not in self.followed])
            self._changed.set()
        elif h.generation == n.held and h.by_message and now - n.held_at[n.held] > RESEND_ACK_S:
            self._ack(n, h, [w for w in h.ranks if w not in self.followed])

    def _rank_held(self, rf: RankFollower, h: Held) -> None:
        if rf.node.dead or h.launch != rf.node.run:
            return
        now = time.time()
        if h.generation > rf.held:
            rf.held, rf.held_at = h.generation, now
            self._ack(rf.node, h, list(h.ranks))
        elif h.generation == rf.held and h.by_message and now - rf.held_at > RESEND_ACK_S:
            self._ack(rf.node, h, list(h.ranks))

    def _ack(self, n: SimNode, h: Held, workers: list[str]) -> None:
        if self.design.node_acks:  # one NodeAck for the node's members, as the real launcher sends
            if workers:
                self._queue_ack(
                    NODE_ACK,
                    NodeAck(job=self.job, node=n.name, generation=h.generation, workers=sorted(workers)),
                )
            return
        for w in workers:
            self._queue_ack(ACK, PlanAck(job=self.job, generation=h.generation, worker=w, rank=h.ranks[w]))

    def _queue_ack(self, subject: Subject, ack: PlanAck | NodeAck) -> None:
        self.acks_in_flight += 1
        self._acks.append((subject, ack))
        if self._ack_flush is None or self._ack_flush.done():
            self._ack_flush = asyncio.ensure_future(self._flush_acks())

    async def _flush_acks(self) -> None:
        """Publish the queued acknowledgements once this process has handled the burst of
        deliveries in front of it (nothing new queued for ``ACK_QUIET_S``). On a cluster each
        launcher acknowledges on its own CPU and never delays another launcher's delivery;
        here a thousand launchers share one event loop, and acknowledging in between would
        make the later launchers' deliveries wait for the earlier ones' acks."""
        while self._acks:
            seen = len(self._acks)
            await asyncio.sleep(ACK_QUIET_S)
            if len(self._acks) != seen:
                continue
            batch, self._acks = self._acks, []
            await asyncio.gather(*(self._publish_ack(subject, ack) for subject, ack in batch))

    async def _publish_ack(self, subject: Subject, ack: PlanAck | NodeAck) -> None:
        try:
            await self.bus.publish(subject, ack, job=self.job)
            self.acks_sent += 1
        except Exception:
            self.ack_errors += 1
        finally:
            self.acks_in_flight -= 1
            self._changed.set()

    def _settled(self, generation: int) -> bool:
        live = [n for n in self.nodes.values() if not n.dead]
        ranks_ok = all(rf.held >= generation for rf in self.rank_followers.values() if not rf.node.dead)
        return all(n.held >= generation for n in live) and ranks_ok and self.acks_in_flight == 0

    async def wait_for(self, generation: int, timeout_s: float) -> dict[str, Any]:
        """Until every live launcher (and followed rank) holds ``generation`` or newer and
        every acknowledgement went out; when each launcher first held it."""
        deadline = time.monotonic() + timeout_s
        while not self._settled(generation) and time.monotonic() < deadline:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 0.5)
        live = [n for n in self.nodes.values() if not n.dead]
        times = [t for n in live if (t := n.held_since(generation)) is not None]
        behind = [f"{n.name}@{n.held}" for n in live if n.held < generation]
        behind += [
            f"{rf.worker}@{rf.held}"
            for rf in self.rank_followers.values()
            if not rf.node.dead and rf.held < generation
        ]
        return {
            "ok": self._settled(generation),
            "behind": behind[:20],
            "acks_in_flight": self.acks_in_flight,
            "launchers": len(live),
            "holding": len(times),
            "times": times,
            "acks_sent": self.acks_sent,
            "ack_errors": self.ack_errors,
        }

    def collect(self) -> dict[str, Any]:
        """Each live launcher's received bytes since the last collect, and the followed ranks'."""
        launchers = []
        for n in self.nodes.values():
            if n.source is not None and not n.dead:
                b, m = n.source.counted.take()
                launchers.append({"node": n.name, "bytes": b, "msgs": m})
        ranks = []
        for rf in self.rank_followers.values():
            b, m = rf.source.counted.take()
            if not rf.node.dead:
                ranks.append({"worker": rf.worker, "bytes": b, "msgs": m})
        return {"launchers": launchers, "ranks": ranks}

    async def silence(self, k: int) -> float:
        """Node ``k`` is lost: no more digests, its launcher and ranks stop receiving."""
        n = self.nodes[k]
        n.dead = True
        at = time.time()
        if n.probes is not None:
            await n.probes.unsubscribe()
        if n.source is not None:
            await n.source.stop()
        for rf in self.rank_followers.values():
            if rf.node is n:
                await rf.source.stop()
        return at

    # -- control -------------------------------------------------------------------------------
    async def _on_ctl(self, raw: Msg) -> None:
        self._spawn(self._answer(raw))  # an await may take long: the next request is not held up

    async def _answer(self, raw: Msg) -> None:
        req = json.loads(raw.data)
        op = req["op"]
        out: dict[str, Any]
        if op == "status":
            out = {
                "joined": sum(n.joined for n in self.nodes.values()),
                "registered": sum(len(n.registered) for n in self.nodes.values()),
                "digests_sent": self.digests_sent,
                "lag_p99_s": sorted(self.lags)[int(len(self.lags) * 0.99)] if self.lags else None,
            }
        elif op == "follow":
            launchers, ranks = await self.follow()
            out = {"launchers": launchers, "ranks": ranks}
        elif op == "silence":
            out = {"at": await self.silence(int(req["node"]))}
        elif op == "await":
            out = await self.wait_for(int(req["generation"]), float(req["timeout_s"]))
        elif op == "collect":
            out = self.collect()
        else:
            out = {"error": f"unknown op {op!r}"}
        await raw.respond(json.dumps(out).encode())

    async def stop(self) -> None:
        for n in self.nodes.values():
            if n.source is not None:
                await n.source.stop()
        for rf in self.rank_followers.values():
            await rf.source.stop()
        for task in list(self._tasks):
            task.cancel()


async def simulate(cfg: dict[str, Any]) -> None:
    bus = await SimBus.connect(
        cfg["url"], name=f"scale-sim-{cfg['proc']}-{socket.gethostname()}", ensure=False
    )
    sim = Simulator(bus, cfg)
    await sim.start()
    await bus.flush()  # the control subscription is at the server before the bench asks anything
    done = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, done.set)
    print("ready", flush=True)
    await done.wait()
    await sim.stop()
    await bus.close()


def main() -> None:
    asyncio.run(simulate(json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()

"""Who may publish and subscribe to what: roles, user names and NATS permissions, derived from the contract.

The permissions are computed from :data:`phalanx.contract.subjects.CATALOGUE` (who sends and who
receives each subject, :data:`phalanx.contract.proto.PARTIES`) and the stream and bucket specs
(:mod:`phalanx.contract.streams`); :mod:`phalanx.natsauth` renders them into a nats-server
configuration and hands out the logins. Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.contract.proto import PARTIES
from phalanx.contract.streams import (
    CKPT_BUCKET,
    CLUSTER_BUCKET,
    COMMANDS,
    EVENTS,
    JOBS_BUCKET,
    SCHED,
    STREAMS,
)
from phalanx.contract.subjects import CATALOGUE, ERROR, HEALTH, Subject


def inbox_prefix(user: str) -> str:
    """Where a user's replies arrive: the only inbox its permissions let it read."""
    return f"_INBOX.{user}"


JS_API = "$JS.API"
ACCOUNT = "PHALANX"  # the account of every user (its JetStream quota: NatsAuth.accounts)
KV_STREAM = f"KV_{JOBS_BUCKET}"
KV_SUBJECTS = f"$KV.{JOBS_BUCKET}.>"
CLUSTER_KV_STREAM = f"KV_{CLUSTER_BUCKET}"
CLUSTER_KV_SUBJECTS = f"$KV.{CLUSTER_BUCKET}.>"  # written by admin only (phalanx cluster ...)
CKPT_KV_STREAM = f"KV_{CKPT_BUCKET}"
CKPT_KV_SUBJECTS = f"$KV.{CKPT_BUCKET}.>"  # written by the keepers and admin (ckpt rm)
ALL_STREAMS: tuple[str, ...] = (*(s.name for s in STREAMS), KV_STREAM, CLUSTER_KV_STREAM, CKPT_KV_STREAM)

PLANNER, DETECTOR, LAUNCHER, RANK = "planner", "detector", "launcher", "rank"
SCHEDULER, REPLICATION, OBSERVER, ADMIN = "scheduler", "replication", "observer", "admin"
POLICY = "policy"


_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # a job or worker name (as subjects take them)


@dataclass(frozen=True)
class NatsRole:
    """What a role is allowed beyond its subjects: derived into :class:`Permissions`."""

    name: str
    party: str | None  # who it is in phalanx.contract.proto.PARTIES (None: sends and receives nothing there)
    service: str | None = None  # a Phalanx service: owns phalanx.err.<service> and its health subject
    consumes: tuple[str, ...] = ()  # streams it runs JetStream consumers on
    creates_topology: bool = False  # Bus.connect(ensure=True): may create the streams and the bucket
    updates_topology: bool = False  # may change a stream's configuration
    writes_jobs_kv: bool = False  # may put/update/delete/purge keys of the phalanx_jobs bucket
    writes_ckpt_kv: bool = False  # may write the phalanx_ckpt bucket (checkpoint copies per tier)
    follows_plans: bool = False  # reads and watches its job's record, phalanx_jobs/<job>.plan
    per_job: bool = False  # rendered per job (rank: also per worker), see NatsAuth.with_job
    description: str = ""


ROLES: dict[str, NatsRole] = {
    r.name: r
    for r in (
        NatsRole(
            PLANNER,
            "elasticity-planner",
            "elasticity-planner",
            consumes=(COMMANDS.name, EVENTS.name, SCHED.name, KV_STREAM),
            creates_topology=True,
            updates_topology=True,
            writes_jobs_kv=True,
            description="the single writer of membership: plans, decisions, the phalanx_jobs bucket",
        ),
        NatsRole(
            DETECTOR,
            "failure-detector",
            "failure-detector",
            consumes=(EVENTS.name, COMMANDS.name),
            creates_topology=True,
            description="turns heartbeats, node digests and process exits into verdicts",
        ),
        NatsRole(
            LAUNCHER,
            "launcher",
            creates_topology=True,
            follows_plans=True,
            per_job=True,
            description="phalanx run: publishes the job spec, process exits and node digests",
        ),
        NatsRole(
            RANK,
            "rank",
            follows_plans=True,
            per_job=True,
            description="a training rank or hot spare (user code: the least trusted)",
        ),
        NatsRole(
            SCHEDULER,
            "scheduler-signal",
            "scheduler-signal",
            consumes=(CLUSTER_KV_STREAM,),  # the watch of the local cluster's records
            creates_topology=True,
            description="publishes capacity changes and preemption notices; watches phalanx_cluster",
        ),
        NatsRole(
            REPLICATION,
            "state-replication",
            "state-replication",
            consumes=(COMMANDS.name, EVENTS.name, CKPT_KV_STREAM),
            creates_topology=True,
            writes_ckpt_kv=True,
            description="the node's checkpoint keeper: follows plans, moves state over its own TCP"
            " streams, writes the phalanx_ckpt bucket",
        ),
        NatsRole(
            POLICY,
            "policy",
            consumes=(EVENTS.name, SCHED.name, COMMANDS.name),
            description="a user's own elasticity policy: reads events and signals, publishes proposals",
        ),
        NatsRole(
            OBSERVER,
            None,
            consumes=ALL_STREAMS,
            description="dashboards, trace tools, tests: reads subjects and streams, publishes nothing",
        ),
        NatsRole(ADMIN, None, description="provisioning and operators: everything"),
    )
}
SERVICES: tuple[str, ...] = tuple(r.service for r in ROLES.values() if r.service)
ROLE_OF_SERVICE: dict[str, str] = {r.service: r.name for r in ROLES.values() if r.service}
ROLE_OF_PARTY: dict[str, str] = {r.party: r.name for r in ROLES.values() if r.party}


def user_name(role: str, job: str | None = None, worker: str | None = None, node: str | None = None) -> str:
    """The NATS user of ``role`` (for ``job``, for its ``worker`` or, a launcher, its ``node``).

    One token, no dots: the user's inbox ``_INBOX.<user>.>`` is then never a prefix
    of another user's. ``rank``, ``launcher@demo/node-a``, ``rank@demo/node-a-w0``.
    """
    if (worker is not None or node is not None) and job is None:
        raise ValueError("a worker's or node's user belongs to a job")
    if job is None:
        return role
    member = worker if role == RANK else node
    return f"{role}@{job}" if member is None else f"{role}@{job}/{member}"


_QUALIFIED = re.compile(r"^(?P<node>[A-Za-z0-9_-]+)-w\d+$")


def worker_node(worker: str, nodes: Sequence[str] = ()) -> str | None:
    """The node a worker of a multi-node job runs on, from its name ``<node>-w<i>``
    (how ``phalanx run`` and the planner name them); with ``nodes``, one of those
    (the longest that fits), else None (``w0``.. of a one-node job).

    >>> worker_node("node-a-w3"), worker_node("w0"), worker_node("a-b-w0", ["a", "a-b"])
    ('node-a', None, 'a-b')
    """
    if nodes:
        fits = [n for n in nodes if worker.startswith(f"{n}-w") and worker[len(n) + 2 :].isdigit()]
        return max(fits, key=len) if fits else None
    m = _QUALIFIED.match(worker)
    return m.group("node") if m else None


@dataclass(frozen=True)
class Permissions:
    """One NATS user's ``permissions`` block."""

    publish_allow: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    subscribe_allow: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    allow_responses: bool = False  # may answer a request it received (health pings)

    def as_config(self) -> dict[str, object]:
        def side(allow: tuple[str, ...], deny: tuple[str, ...]) -> dict[str, list[str]]:
            out = {"allow": list(allow)}
            if deny:
                out["deny"] = list(deny)
            return out

        block: dict[str, object] = {
            "publish": side(self.publish_allow, self.publish_deny),
            "subscribe": side(self.subscribe_allow, self.subscribe_deny),
        }
        if self.allow_responses:
            block["allow_responses"] = True
        return block


def sent_by(party: str) -> list[Subject]:
    """The subjects ``party`` sends, according to the contract."""
    return [s for s in CATALOGUE if party in PARTIES.get(s.pattern, ((), ()))[0]]


def received_by(party: str) -> list[Subject]:
    """The subjects ``party`` receives, according to the contract."""
    return [s for s in CATALOGUE if party in PARTIES.get(s.pattern, ((), ()))[1]]


def _stream_read(stream: str) -> list[str]:
    """Look at a stream and its messages (a KV get is a message get)."""
    return [
        f"{JS_API}.STREAM.INFO.{stream}",
        f"{JS_API}.STREAM.MSG.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}.>",
        f"{JS_API}.CONSUMER.INFO.{stream}.*",
        f"{JS_API}.CONSUMER.NAMES.{stream}",
        f"{JS_API}.CONSUMER.LIST.{stream}",
    ]


def _stream_consume(stream: str) -> list[str]:
    """Create, bind, pull from, acknowledge and remove consumers of a stream."""
    return [
        f"{JS_API}.CONSUMER.CREATE.{stream}",
        f"{JS_API}.CONSUMER.CREATE.{stream}.>",
        f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.*",
        f"{JS_API}.CONSUMER.DELETE.{stream}.*",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.*",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _plan_follow(job: str, user: str) -> list[str]:
    """Read and watch the record ``<job>.plan`` (``*``: every job's) of the jobs bucket,
    only by the forms whose API subject names the key (the server checks the body
    against it): a direct get, and a :class:`~phalanx.bus.keywatch.KeyWatch` consumer
    under one of the user's own :func:`watch_names` (which it may also delete)."""
    key = f"$KV.{JOBS_BUCKET}.{job}.plan"
    names = watch_names(user)
    return [
        f"{JS_API}.STREAM.INFO.{KV_STREAM}",  # js.key_value(bucket)
        f"{JS_API}.DIRECT.GET.{KV_STREAM}.{key}",  # kv.get (the bucket has direct gets)
        # a KeyWatch: a consumer named with its filter, under a name of the user's own
        *(f"{JS_API}.CONSUMER.CREATE.{KV_STREAM}.{n}.{key}" for n in names),
        *(f"{JS_API}.CONSUMER.DELETE.{KV_STREAM}.{n}" for n in names),
    ]


WATCH_SLOTS = 4
"""The KV watches of the jobs bucket one follower user may hold at once."""


def watch_names(user: str) -> tuple[str, ...]:
    """The only names under which ``user`` (a rank or launcher) may create a consumer on
    the jobs bucket (:class:`~phalanx.bus.keywatch.KeyWatch`): a few per user, so no user
    can hold more than :data:`WATCH_SLOTS` of the stream's consumers, durable or not,
    and none can fill its consumer limit for the planner and every other job. A digest of
    the user, since a consumer name may hold neither ``.`` nor ``/``.

    >>> watch_names("rank@j1/w0")[0]
    'watch_ce924756758b2c10_0'
    """
    tag = hashlib.sha256(user.encode()).hexdigest()[:16]
    return tuple(f"watch_{tag}_{i}" for i in range(WATCH_SLOTS))


def check_name(what: str, value: str) -> None:
    if not _NAME.match(value):
        raise ValueError(f"{what} {value!r} is not a plain name (letters, digits, '_' and '-')")


def permissions(
    role: str,
    user: str | None = None,
    *,
    job: str | None = None,
    worker: str | None = None,
    node: str | None = None,
) -> Permissions:
    """The NATS permissions of ``role`` (for the user named ``user``, default :func:`user_name`).

    ``job``: scoped to that job's subjects and record (roles with ``per_job``);
    ``worker`` (ranks): heartbeats, registrations, acks, collective errors,
    recoveries and errors only as that worker; ``node`` (launchers): job specs,
    process exits and digests only as that node's launcher.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    r = ROLES[role]
    if job is not None:
        if not r.per_job:
            raise ValueError(f"role {role!r} is not scoped per job")
        check_name("job", job)
    if worker is not None:
        if role != RANK or job is None:
            raise ValueError("only a job's ranks have per-worker users")
        check_name("worker", worker)
    if node is not None:
        if role != LAUNCHER or job is None:
            raise ValueError("only a job's launchers have per-node users")
        check_name("node", node)
    user = user or user_name(role, job, worker, node)
    if role == ADMIN:
        return Permissions(publish_allow=(">",), subscribe_allow=(">",))
    own = {"job": job, "worker": worker, "node": node, "service": r.service}

    def scoped(s: Subject) -> str:
        return s.wildcard(**{k: v for k, v in own.items() if v is not None and k in s.params})

    pub: list[str] = [f"{JS_API}.INFO", f"{JS_API}.STREAM.NAMES", f"{JS_API}.STREAM.LIST"]
    deny: list[str] = []
    sub: list[str] = []
    if r.party is not None:
        # Application subjects: what the contract says this party sends ...
        for s in sent_by(r.party):
            if s is ERROR:
                if r.service:
                    pub.append(ERROR.format(service=r.service))
                elif worker is not None:  # the rank's bus is named rank-<worker>
                    pub.append(ERROR.format(service=f"{r.party}-{worker}"))
                else:  # ranks and launchers report under their own names: any but a service's
                    pub.append(ERROR.wildcard())
                    deny += [ERROR.format(service=svc) for svc in SERVICES]
            else:  # a request too: a planner asks its own service's instances only
                pub.append(scoped(s))
        # ... and what it receives (a service answers only its own health subject).
        for s in received_by(r.party):
            sub.append(scoped(s))
    if r.service:
        pub.append(HEALTH.format(service=r.service))  # its own probe (the health check in its container)
    if role == LAUNCHER:
        # phalanx run asks the services whether they answer before it starts its workers
        pub += [HEALTH.format(service=svc) for svc in SERVICES]
    # JetStream: look at the streams (a job's users: only at their record), consume its own streams.
    if job is None:
        for stream in ALL_STREAMS:
            pub += _stream_read(stream)
    for stream in r.consumes:
        pub += _stream_consume(stream)
    if r.follows_plans:
        pub += _plan_follow(job or "*", user)
    if r.creates_topology:
        pub += [f"{JS_API}.STREAM.CREATE.{s}" for s in ALL_STREAMS]
        # ensure_topology looks the buckets up
        pub += [f"{JS_API}.STREAM.INFO.{CLUSTER_KV_STREAM}", f"{JS_API}.STREAM.INFO.{CKPT_KV_STREAM}"]
    if r.updates_topology:
        pub += [f"{JS_API}.STREAM.UPDATE.{s}" for s in ALL_STREAMS]
    if r.writes_jobs_kv:
        pub.append(KV_SUBJECTS)
    else:
        deny.append(KV_SUBJECTS)
    if r.writes_ckpt_kv:
        pub.append(CKPT_KV_SUBJECTS)
    else:
        deny.append(CKPT_KV_SUBJECTS)
    deny.append(CLUSTER_KV_SUBJECTS)  # the local cluster: admin's alone
    # Never for these roles, whatever the allow list grows into.
    deny += [f"{JS_API}.STREAM.DELETE.>", f"{JS_API}.STREAM.PURGE.>", f"{JS_API}.STREAM.MSG.DELETE.>"]
    if not r.updates_topology:
        deny.append(f"{JS_API}.STREAM.UPDATE.>")
    if role == OBSERVER:
        sub += ["phalanx.>", "$JS.EVENT.>"]  # everything, and the JetStream advisories
    sub.append(f"{inbox_prefix(user)}.>")
    return Permissions(
        publish_allow=tuple(dict.fromkeys(pub)),
        publish_deny=tuple(dict.fromkeys(deny)),
        subscribe_allow=tuple(dict.fromkeys(sub)),
        allow_responses=r.service is not None or role == LAUNCHER,  # a launcher answers the detector's probe
    )

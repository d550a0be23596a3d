"""Who may publish what: Phalanx roles as real nats-server permissions.

The wire contract says who sends and who receives each subject
(:data:`phalanx.proto.PARTIES`, checked against what the code subscribes to and
publishes by ``tests/integration/test_parties.py``); this module turns that table
into NATS users with ``publish``/``subscribe`` permissions, so the *server* refuses
an unauthorised publisher: a training rank cannot publish a plan, only the planner
can write the ``phalanx_jobs`` KV bucket, and nothing it refuses reaches a stream,
a consumer or a subscriber. The client sees the refusal as ``-ERR 'Permissions
Violation for Publish to "<subject>"'``; :class:`phalanx.bus.Bus` logs it as
``permission_denied``.

Roles (one NATS user each, named after the role):

============ ==================== ====================================================
role         speaks for           may publish (besides what its JetStream use needs)
============ ==================== ====================================================
planner      elasticity-planner   plans, decisions, join answers, the ``phalanx_jobs`` bucket
detector     failure-detector     ``failed`` / ``hung`` / ``node_lost`` verdicts
launcher     launcher             job specs, process exits, node digests
rank         rank (and spares)    heartbeats, registered, ack, comm_error, recovered
scheduler    scheduler-signal     capacity and preemption signals (reads the ``phalanx_cluster`` bucket)
policy       a custom policy      proposals (``phalanx.cmd.<job>.proposal``)
replication  state-replication    its error events only (bulk state is not on NATS)
observer     --                   nothing: reads subjects and streams
admin        --                   everything (provisioning, operators, tests)
============ ==================== ====================================================

A party may subscribe to the subjects it *receives* (``phalanx.health.<own name>``
for a service), gets its replies on its own inbox ``_INBOX.<user>.>``
(``Bus.connect`` sets that prefix), and runs JetStream consumers only on the
streams it consumes. Only roles that create the topology (``Bus.connect(ensure=True)``)
may create streams, and only the planner and admin may *update* one. Error events
go to ``phalanx.err.<own service>``; ranks (named ``rank-<worker>``) may use any
``phalanx.err.*`` except a service's.

**Per job and per worker.** The users ``rank`` and ``launcher`` above may speak for
*any* job. A deployment renders, for each job ``J``, users scoped to it instead
(:meth:`NatsAuth.with_job`, ``--job`` below):

- ``launcher@J/<node>``, one per node: publishes only as that node's launcher
  (``phalanx.cmd.J.spec.<node>``, ``phalanx.evt.J.exited.<node>``,
  ``phalanx.node.J.<node>``) and the job's step stats; subscribes to
  ``phalanx.cmd.J.plan``, ``phalanx.evt.J.decision``, ``phalanx.evt.J.joined``.
  Without nodes (a one-node job, workers ``w0``..) one ``launcher@J`` speaks for
  any node of ``J``;
- ``rank@J/<worker>``, one per worker: publishes only as itself: heartbeats
  (``phalanx.hb.J.<worker>``), its events (``phalanx.evt.J.registered.<worker>``,
  ``.ack.<worker>``, ``.comm_error.<worker>``, ``.recovered.<worker>``) and errors
  (``phalanx.err.rank-<worker>``); subscribes to ``phalanx.cmd.J.plan``. Without a
  worker list one ``rank@J`` speaks for every worker of ``J``;
- both read and watch the job's KV record ``phalanx_jobs`` / ``J.plan`` (the plan
  they follow) and nothing else of JetStream: no message gets and no consumers on
  the event, command, scheduler or error streams, no stream info but the bucket's.

A job's users cannot publish or subscribe to another job's subjects, nor a
worker's or a node's user on another worker's or node's; the server refuses it
(and the sender's bus logs ``permission_denied``). What a user may publish on is
what it may claim: every receiver refuses a payload whose job, worker or node is
not its subject's (:func:`phalanx.bus.subjects.sender_mismatch`), the detector and
the planner take a process exit only from the launcher of the node that runs the
worker (the planner's join answers say which), and the planner takes collective
errors and acknowledgements only from members of the current generation.

**A job's record is its own.** The record holds the plan, and the plan the
generation's rendezvous secret (:attr:`phalanx.schemas.Plan.store_secret`), so a
job's users may read it only by the requests whose API subject names the key:
a direct get (``$JS.API.DIRECT.GET.KV_phalanx_jobs.$KV.phalanx_jobs.J.plan``; the
bucket has ``allow_direct``, :func:`phalanx.bus.topology.ensure_bucket`) and a
:class:`~phalanx.bus.keywatch.KeyWatch` consumer
(``$JS.API.CONSUMER.CREATE.KV_phalanx_jobs.<name>.$KV.phalanx_jobs.J.plan``;
nats-server refuses a body whose filter differs from the subject's). The unscoped
forms nats.py uses otherwise (``$JS.API.STREAM.MSG.GET.KV_phalanx_jobs``, the
unnamed consumer of ``kv.watch``), which carry the key in the body, are not
allowed; nor are the command stream (plans are published there too) and the
subjects ``phalanx.cmd.<J>.*`` to another job's users, who get no answer (a timeout).
What stays visible to them: the bucket's stream info (which keys exist: job
names). A consumer's deliver subject is not checked against its creator's
publish permissions, so a job's user can replay its *own* record onto a subject
someone listens on -- records carry no ``Phalanx-Kind`` header, and every
receiver refuses them as bad input. Role-wide users (the services, ``policy``,
``observer``, and ``rank``/``launcher`` without ``--job``) read every job's plans.

**The local cluster.** The ``phalanx_cluster`` bucket (one record per cluster,
:mod:`phalanx.cluster`) is written by ``admin`` alone: ``phalanx cluster offer`` /
``reclaim`` run with the admin credentials when the server enforces roles
(``PHALANX_NATS_USER=admin`` and its ``PHALANX_NATS_PASSWORD``, e.g. from
``admin.env``); any other user's write is refused. scheduler-signal reads and
watches it (a consumer on ``KV_phalanx_cluster``); every role-wide user may read
it, and the roles that create the topology may create the bucket and look it up
(``STREAM.INFO``, a job's launcher included).

Per worker is as strong as the separation between the processes: a rank running
as the same OS user as its launcher can read the launcher's environment, which
holds every local worker's password.

**One account, with a JetStream quota.** The rendered config puts every user in the
account ``PHALANX`` (:meth:`NatsAuth.accounts`), whose file-store quota is the sum of
the streams' and buckets' ``max_bytes`` (:mod:`phalanx.bus.topology`) and which
refuses a stream without ``max_bytes``: JetStream reserves each stream's
``max_bytes`` at creation, so no stream can take another's space. The server's
log names the account in a refusal (``"PHALANX/user:rank@J/w0" - Publish
Violation``). Monitoring (``http_port``) is rendered on loopback only.

Credentials travel in the environment, never in the URL (a URL is logged):
``PHALANX_NATS_USER`` and ``PHALANX_NATS_PASSWORD``. A launcher gets its own and
hands each worker its own: ``PHALANX_NATS_WORKER_CREDENTIALS`` (JSON, worker ->
user and password; :func:`worker_credentials`), or ``PHALANX_NATS_RANK_USER`` /
``PHALANX_NATS_RANK_PASSWORD`` for every worker not listed there. Passwords are
random per deployment (:meth:`NatsAuth.generate`); the rendered server config
holds them, so it is written with mode 0600.

>>> auth = NatsAuth.generate(jobs={"demo": ["node-a-w0", "node-a-w1", "node-b-w0", "node-b-w1"]})
>>> auth.write_config("nats.conf", listen="0.0.0.0:4222", store_dir="/data")
>>> auth.env("planner")
{'PHALANX_NATS_USER': 'planner', 'PHALANX_NATS_PASSWORD': '...'}
>>> auth.launcher_env("demo", "node-a")   # launcher@demo/node-a, and node-a-w0's and node-a-w1's logins

    python -m phalanx.natsauth write --config nats.conf --env-dir secrets/ \\
        --job demo:node-a-w0,node-a-w1,node-b-w0,node-b-w1
    python -m phalanx.natsauth show rank --job demo --worker node-a-w0
    python -m phalanx.natsauth show launcher --job demo --node node-a
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.bus._connection import ENV_NATS_PASSWORD, ENV_NATS_USER, inbox_prefix
from phalanx.bus.subjects import CATALOGUE, ERROR, HEALTH, Subject, Transport
from phalanx.bus.topology import (
    CKPT_BUCKET,
    CLUSTER_BUCKET,
    COMMANDS,
    EVENTS,
    JOBS_BUCKET,
    SCHED,
    STREAMS,
    account_max_file,
    stream_replicas,
)
from phalanx.proto import PARTIES

JS_API = "$JS.API"
ACCOUNT = "PHALANX"  # the account of every user (its JetStream quota: NatsAuth.accounts)
KV_STREAM = f"KV_{JOBS_BUCKET}"
KV_SUBJECTS = f"$KV.{JOBS_BUCKET}.>"
CLUSTER_KV_STREAM = f"KV_{CLUSTER_BUCKET}"
CLUSTER_KV_SUBJECTS = f"$KV.{CLUSTER_BUCKET}.>"  # written by admin only (phalanx cluster ...)
CKPT_KV_STREAM = f"KV_{CKPT_BUCKET}"
CKPT_KV_SUBJECTS = f"$KV.{CKPT_BUCKET}.>"  # written by the keepers (state-replication) only
ALL_STREAMS: tuple[str, ...] = (*(s.name for s in STREAMS), KV_STREAM, CLUSTER_KV_STREAM, CKPT_KV_STREAM)

PLANNER, DETECTOR, LAUNCHER, RANK = "planner", "detector", "launcher", "rank"
SCHEDULER, REPLICATION, OBSERVER, ADMIN = "scheduler", "replication", "observer", "admin"
POLICY = "policy"

# What a launcher hands its workers (phalanx.runtime.launcher): per-worker users, and
# the one user of every worker not listed there.
ENV_WORKER_CREDENTIALS = "PHALANX_NATS_WORKER_CREDENTIALS"
ENV_RANK_USER = "PHALANX_NATS_RANK_USER"
ENV_RANK_PASSWORD = "PHALANX_NATS_RANK_PASSWORD"
# A file of KEY=value lines (launcher-<job>-<node>.env) that ``phalanx run`` loads
# into its environment first: one node's logins, where a deployment can hand a pod
# a file chosen by its index but not environment variables (Kubernetes Indexed Jobs).
ENV_NATS_ENV_FILE = "PHALANX_NATS_ENV_FILE"

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # a job or worker name (as subjects take them)


@dataclass(frozen=True)
class Role:
    """What a role is allowed beyond its subjects: derived into :class:`Permissions`."""

    name: str
    party: str | None  # who it is in phalanx.proto.PARTIES (None: sends and receives nothing there)
    service: str | None = None  # a Phalanx service: owns phalanx.err.<service> and its health subject
    consumes: tuple[str, ...] = ()  # streams it runs JetStream consumers on
    creates_topology: bool = False  # Bus.connect(ensure=True): may create the streams and the bucket
    updates_topology: bool = False  # may change a stream's configuration
    writes_jobs_kv: bool = False  # may put/update/delete/purge keys of the phalanx_jobs bucket
    writes_ckpt_kv: bool = False  # may write the phalanx_ckpt bucket (checkpoint copies per tier)
    follows_plans: bool = False  # reads and watches its job's record, phalanx_jobs/<job>.plan
    per_job: bool = False  # rendered per job (rank: also per worker), see NatsAuth.with_job
    description: str = ""


ROLES: dict[str, Role] = {
    r.name: r
    for r in (
        Role(
            PLANNER,
            "elasticity-planner",
            "elasticity-planner",
            consumes=(COMMANDS.name, EVENTS.name, SCHED.name, KV_STREAM),
            creates_topology=True,
            updates_topology=True,
            writes_jobs_kv=True,
            description="the single writer of membership: plans, decisions, the phalanx_jobs bucket",
        ),
        Role(
            DETECTOR,
            "failure-detector",
            "failure-detector",
            consumes=(EVENTS.name, COMMANDS.name),
            creates_topology=True,
            description="turns heartbeats, node digests and process exits into verdicts",
        ),
        Role(
            LAUNCHER,
            "launcher",
            creates_topology=True,
            follows_plans=True,
            per_job=True,
            description="phalanx run: publishes the job spec, process exits and node digests",
        ),
        Role(
            RANK,
            "rank",
            follows_plans=True,
            per_job=True,
            description="a training rank or hot spare (user code: the least trusted)",
        ),
        Role(
            SCHEDULER,
            "scheduler-signal",
            "scheduler-signal",
            consumes=(CLUSTER_KV_STREAM,),  # the watch of the local cluster's records
            creates_topology=True,
            description="publishes capacity changes and preemption notices; watches phalanx_cluster",
        ),
        Role(
            REPLICATION,
            "state-replication",
            "state-replication",
            consumes=(COMMANDS.name, EVENTS.name, CKPT_KV_STREAM),
            creates_topology=True,
            writes_ckpt_kv=True,
            description="the node's checkpoint keeper: follows plans, moves state over its own TCP"
            " streams, writes the phalanx_ckpt bucket",
        ),
        Role(
            POLICY,
            "policy",
            consumes=(EVENTS.name, SCHED.name, COMMANDS.name),
            description="a user's own elasticity policy: reads events and signals, publishes proposals",
        ),
        Role(
            OBSERVER,
            None,
            consumes=ALL_STREAMS,
            description="dashboards, trace tools, tests: reads subjects and streams, publishes nothing",
        ),
        Role(ADMIN, None, description="provisioning and operators: everything"),
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


def _plan_follow(job: str) -> list[str]:
    """Read and watch the record ``<job>.plan`` (``*``: every job's) of the jobs bucket,
    only by the forms whose API subject names the key (the server checks the body
    against it): a direct get, and a :class:`~phalanx.bus.keywatch.KeyWatch` consumer."""
    key = f"$KV.{JOBS_BUCKET}.{job}.plan"
    return [
        f"{JS_API}.STREAM.INFO.{KV_STREAM}",  # js.key_value(bucket)
        f"{JS_API}.DIRECT.GET.{KV_STREAM}.{key}",  # kv.get (the bucket has direct gets)
        f"{JS_API}.CONSUMER.CREATE.{KV_STREAM}.*.{key}",  # KeyWatch: a consumer named with its filter
    ]


def _check_name(what: str, value: str) -> None:
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
        _check_name("job", job)
    if worker is not None:
        if role != RANK or job is None:
            raise ValueError("only a job's ranks have per-worker users")
        _check_name("worker", worker)
    if node is not None:
        if role != LAUNCHER or job is None:
            raise ValueError("only a job's launchers have per-node users")
        _check_name("node", node)
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
            elif s.transport is Transport.REQUEST:
                continue  # requests are the operator's (admin)
            else:
                pub.append(scoped(s))
        # ... and what it receives (a service answers only its own health subject).
        for s in received_by(r.party):
            sub.append(scoped(s))
    if r.service:
        pub.append(HEALTH.format(service=r.service))  # its own probe (the health check in its container)
    # JetStream: look at the streams (a job's users: only at their record), consume its own streams.
    if job is None:
        for stream in ALL_STREAMS:
            pub += _stream_read(stream)
    for stream in r.consumes:
        pub += _stream_consume(stream)
    if r.follows_plans:
        pub += _plan_follow(job or "*")
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
        allow_responses=r.service is not None,
    )


@dataclass(frozen=True)
class Credentials:
    role: str
    user: str
    password: str = field(repr=False)
    job: str | None = None  # a job's user (launcher@J/<node>, rank@J/<worker>; launcher@J, rank@J)
    worker: str | None = None
    node: str | None = None  # a launcher's node (its scope); a worker's node (whose launcher hands it over)

    def env(self) -> dict[str, str]:
        """The environment a process of this role connects with (``Bus.connect`` reads it)."""
        return {ENV_NATS_USER: self.user, ENV_NATS_PASSWORD: self.password}

    def permissions(self) -> Permissions:
        node = self.node if self.role == LAUNCHER else None
        return permissions(self.role, self.user, job=self.job, worker=self.worker, node=node)


def worker_credentials(spec: str | None, worker: str) -> dict[str, str]:
    """``worker``'s login from a launcher's ``PHALANX_NATS_WORKER_CREDENTIALS``.

    ``spec`` is JSON, ``{"<worker>": {"user": ..., "password": ...}, ...}``
    (:meth:`NatsAuth.launcher_env` writes it). Empty for no spec or a worker not in
    it (it then logs in as the launcher's ``PHALANX_NATS_RANK_USER``, if any).
    """
    if not spec:
        return {}
    try:
        table = json.loads(spec)
        entry = table.get(worker) if isinstance(table, dict) else None
        if entry is None:
            return {}
        return {ENV_NATS_USER: str(entry["user"]), ENV_NATS_PASSWORD: str(entry["password"])}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{ENV_WORKER_CREDENTIALS} is not a JSON object of worker -> {{user, password}}: {exc!r}"
        ) from None


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``KEY=value`` lines of ``path`` as :meth:`NatsAuth.write_env_files` writes
    them (values taken as they are, no quoting; blank lines and ``#`` lines skipped)."""
    out: dict[str, str] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"{path}:{n}: not a KEY=value line")
        out[key] = value
    return out


def _conf_value(value: object, indent: int) -> str:
    """NATS config syntax (a superset of JSON): strings are always quoted, so
    ``$JS.API.>`` is a subject, not a variable reference."""
    pad = "  " * indent
    if isinstance(value, Mapping):
        inner = "".join(f"{pad}  {k}: {_conf_value(v, indent + 1)}\n" for k, v in value.items())
        return "{\n" + inner + pad + "}"
    if isinstance(value, list | tuple):
        if all(isinstance(v, str) for v in value):
            items = "".join(f"{pad}  {json.dumps(v)}\n" for v in value)
            return "[\n" + items + pad + "]"
        return "[\n" + "".join(f"{pad}  {_conf_value(v, indent + 1)}\n" for v in value) + pad + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    return json.dumps(str(value))


def _write_private(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return path


def _password() -> str:
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class NatsAuth:
    """The users of one deployment, by user name, each with a random password:
    one per role, and each job's launcher and ranks (:meth:`with_job`)."""

    users: Mapping[str, Credentials]

    @classmethod
    def generate(
        cls, roles: Iterable[str] = tuple(ROLES), *, jobs: Mapping[str, Sequence[str]] | None = None
    ) -> NatsAuth:
        """Users for ``roles`` (role-wide), and for each of ``jobs`` (job -> its workers)."""
        users = {}
        for role in roles:
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
            users[role] = Credentials(role, role, _password())
        auth = cls(users)
        for job, workers in (jobs or {}).items():
            auth = auth.with_job(job, workers)
        return auth

    def with_job(self, job: str, workers: Sequence[str] = (), nodes: Sequence[str] = ()) -> NatsAuth:
        """These users plus ``job``'s: ``launcher@<job>/<node>`` for each node, and
        ``rank@<job>/<worker>`` for each of ``workers`` (none given: one ``rank@<job>``
        for all of them).

        Workers are named as ``phalanx run`` names them: ``w0``.. on one node,
        ``<node>-w0``.. when the job may span nodes (spares included). ``nodes``
        defaults to the nodes those names carry; a job without any (one node, or
        no workers listed) gets one ``launcher@<job>``, which may speak for any
        node of the job. A node's launcher is handed only its own workers' logins.
        """
        _check_name("job", job)
        for name in (*workers, *nodes):
            _check_name("worker or node", name)
        if len(set(workers)) != len(workers) or len(set(nodes)) != len(nodes):
            raise ValueError(f"job {job!r}: a worker or node is listed twice")
        if job in self.jobs:
            raise ValueError(f"job {job!r} already has users")
        node_of = {w: worker_node(w, nodes) or (nodes[0] if len(nodes) == 1 else None) for w in workers}
        if nodes and None in node_of.values():
            lost = sorted(w for w, n in node_of.items() if n is None)
            raise ValueError(
                f"job {job!r}: workers {lost} are on none of the nodes {list(nodes)} (<node>-w<i>)"
            )
        if not nodes and workers and None not in node_of.values():
            nodes = list(dict.fromkeys(n for n in node_of.values() if n is not None))
        if not nodes:
            node_of = dict.fromkeys(workers)  # one launcher for the job: it runs them all
        added = [
            Credentials(LAUNCHER, user_name(LAUNCHER, job, node=n), _password(), job, node=n) for n in nodes
        ]
        if not nodes:
            added.append(Credentials(LAUNCHER, user_name(LAUNCHER, job), _password(), job))
        if workers:
            added += [
                Credentials(RANK, user_name(RANK, job, w), _password(), job, w, node_of[w]) for w in workers
            ]
        else:
            added.append(Credentials(RANK, user_name(RANK, job), _password(), job))
        return NatsAuth({**self.users, **{c.user: c for c in added}})

    @property
    def jobs(self) -> list[str]:
        return list(dict.fromkeys(c.job for c in self.users.values() if c.job is not None))

    def credentials(
        self, role: str, job: str | None = None, worker: str | None = None, node: str | None = None
    ) -> Credentials:
        try:
            return self.users[user_name(role, job, worker, node)]
        except KeyError:
            raise KeyError(f"no user {user_name(role, job, worker, node)!r} in this deployment") from None

    def env(
        self, role: str, job: str | None = None, worker: str | None = None, node: str | None = None
    ) -> dict[str, str]:
        return self.credentials(role, job, worker, node).env()

    def nodes(self, job: str) -> list[str]:
        """The nodes of ``job`` with a launcher of their own (``launcher@<job>/<node>``)."""
        return [c.node for c in self.users.values() if c.job == job and c.role == LAUNCHER and c.node]

    def launcher_env(self, job: str, node: str | None = None) -> dict[str, str]:
        """Everything the launcher of ``job`` on ``node`` needs: its own login, and its
        workers' (per worker in ``PHALANX_NATS_WORKER_CREDENTIALS``, or the job's one
        rank user). ``node`` None: the job's one launcher (a job without per-node users)."""
        out = self.env(LAUNCHER, job, node=node)
        workers = {
            c.worker: c
            for c in self.users.values()
            if c.job == job and c.worker is not None and (node is None or c.node == node)
        }
        if workers:
            table = {w: {"user": c.user, "password": c.password} for w, c in workers.items()}
            out[ENV_WORKER_CREDENTIALS] = json.dumps(table, separators=(",", ":"))
        else:
            rank = self.credentials(RANK, job)
            out[ENV_RANK_USER], out[ENV_RANK_PASSWORD] = rank.user, rank.password
        return out

    def authorization(self) -> dict[str, object]:
        """The ``authorization`` block of a nats-server config (every user in the global account)."""
        return {
            "users": [
                {"user": c.user, "password": c.password, "permissions": c.permissions().as_config()}
                for c in self.users.values()
            ]
        }

    def accounts(self, replicas: int | None = None) -> dict[str, object]:
        """The ``accounts`` block: every user in the account :data:`ACCOUNT`, whose
        JetStream quota is the sum of the streams' and buckets' ``max_bytes``
        (:func:`~phalanx.bus.topology.account_max_file`, for ``replicas``: default
        ``PHALANX_STREAM_REPLICAS``), and which may create no stream without
        ``max_bytes``. JetStream reserves a stream's ``max_bytes`` against the quota
        when it is created, so no stream can take another's space: a flood of one
        rank's events never stops the planner's KV writes. Phalanx uses no memory
        streams; ``max_mem`` caps a misconfigured one."""
        quota = account_max_file(stream_replicas() if replicas is None else replicas)
        return {
            ACCOUNT: {
                "jetstream": {"max_file": quota, "max_mem": 64 << 20, "max_bytes_required": True},
                **self.authorization(),
            }
        }

    def render_config(
        self,
        *,
        listen: str | None = "127.0.0.1:4222",
        store_dir: str | os.PathLike[str] | None = None,
        jetstream: bool = True,
        server_name: str | None = None,
        http_port: int | None = None,
        authorization_only: bool = False,
        replicas: int | None = None,
    ) -> str:
        """A complete nats-server config: listen address, JetStream, the users in their
        account with its JetStream quota (:meth:`accounts`, for ``replicas``).

        Command-line flags given together with ``-c`` (as :class:`NatsServer` does)
        override ``listen`` and the JetStream store directory (which must then not be
        set here: the server refuses a store directory given twice). Monitoring
        (``http_port``) listens on loopback only: its pages show connections, users
        and subscriptions to anyone who reaches them, without authentication.
        ``authorization_only``: just the ``accounts`` block, for an existing config to
        ``include`` (e.g. the cluster config of deploy/k8s/base/nats).
        """
        conf: dict[str, object] = {}
        if authorization_only:
            pass
        elif listen:
            conf["listen"] = listen
        if server_name and not authorization_only:
            conf["server_name"] = server_name
        if http_port and not authorization_only:
            conf["http"] = f"127.0.0.1:{http_port}"
        if jetstream and not authorization_only:
            conf["jetstream"] = {"store_dir": os.fspath(store_dir)} if store_dir else {"enabled": True}
        conf["accounts"] = self.accounts(replicas)
        body = "".join(f"{k}: {_conf_value(v, 0)}\n" for k, v in conf.items())
        users = ", ".join(self.users)
        return (
            f"# nats-server config generated by phalanx.natsauth (users: {users}). Holds passwords.\n{body}"
        )

    def write_config(
        self,
        path: str | os.PathLike[str],
        *,
        listen: str | None = "127.0.0.1:4222",
        store_dir: str | os.PathLike[str] | None = None,
        jetstream: bool = True,
        server_name: str | None = None,
        http_port: int | None = None,
        authorization_only: bool = False,
        replicas: int | None = None,
    ) -> Path:
        """Write :meth:`render_config` to ``path``, readable by its owner only."""
        text = self.render_config(
            listen=listen,
            store_dir=store_dir,
            jetstream=jetstream,
            server_name=server_name,
            http_port=http_port,
            authorization_only=authorization_only,
            replicas=replicas,
        )
        return _write_private(Path(path), text)

    def write_env_files(self, directory: str | os.PathLike[str]) -> list[Path]:
        """``KEY=value`` files (mode 0600) for a compose ``env_file`` or ``kubectl
        create secret generic --from-env-file``: ``<role>.env`` per role-wide user,
        ``launcher-<job>-<node>.env`` per node of a job (``launcher-<job>.env`` for a
        job's one launcher; :meth:`launcher_env`: the launcher's login and its workers')."""
        d = Path(directory)
        written = []
        for cred in self.users.values():
            if cred.job is None:
                lines = "".join(f"{k}={v}\n" for k, v in cred.env().items())
                written.append(_write_private(d / f"{cred.role}.env", lines))
        for job in self.jobs:
            nodes: list[str | None] = [*self.nodes(job)] or [None]
            for node in nodes:
                lines = "".join(f"{k}={v}\n" for k, v in self.launcher_env(job, node).items())
                name = f"{LAUNCHER}-{job}" + (f"-{node}" if node else "")
                written.append(_write_private(d / f"{name}.env", lines))
        return written


def parse_job(spec: str) -> tuple[str, list[str]]:
    """``NAME`` or ``NAME:WORKER,WORKER,...`` (the ``--job`` argument)."""
    name, _, workers = spec.partition(":")
    return name.strip(), [w.strip() for w in workers.split(",") if w.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m phalanx.natsauth", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="generate users and write the server config and env files")
    w.add_argument("--config", required=True, help="nats-server config to write (mode 0600)")
    w.add_argument(
        "--env-dir", help="directory for <role>.env and launcher-<job>[-<node>].env files (mode 0600)"
    )
    w.add_argument("--listen", default="0.0.0.0:4222")
    w.add_argument("--store-dir", default="/data")
    w.add_argument("--server-name")
    w.add_argument("--http-port", type=int)
    w.add_argument(
        "--job",
        action="append",
        default=[],
        metavar="NAME[:WORKERS]",
        help="users of one job (repeat for more): rank@NAME/<worker> for each worker of the "
        "comma-separated list (all of the job's workers, spares included), or one rank@NAME "
        "without a list; launcher@NAME/<node> for each node the workers' names carry "
        "(<node>-w<i>), else one launcher@NAME",
    )
    w.add_argument(
        "--roles",
        help="comma-separated role-wide users (default: every role; with --job, every role "
        "but rank and launcher, whose job users replace them)",
    )
    w.add_argument(
        "--authorization-only", action="store_true", help="only the accounts block (the users), to include"
    )
    s = sub.add_parser("show", help="print one user's permissions as JSON")
    s.add_argument("role", choices=list(ROLES))
    s.add_argument("--job", help="the job's user of the role (launcher, rank)")
    s.add_argument("--worker", help="with --job: one worker's user (rank)")
    s.add_argument("--node", help="with --job: one node's user (launcher)")
    args = p.parse_args(argv)
    if args.cmd == "show":
        try:
            perms = permissions(args.role, job=args.job, worker=args.worker, node=args.node)
        except ValueError as exc:
            p.error(str(exc))
        print(json.dumps(perms.as_config(), indent=2))
        return 0
    jobs = dict(parse_job(j) for j in args.job)
    if args.roles is not None:
        roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    else:
        roles = [r for r in ROLES if not (jobs and ROLES[r].per_job)]
    try:
        auth = NatsAuth.generate(roles, jobs=jobs)
    except ValueError as exc:
        p.error(str(exc))
    auth.write_config(
        args.config,
        listen=args.listen,
        store_dir=args.store_dir,
        server_name=args.server_name,
        http_port=args.http_port,
        authorization_only=args.authorization_only,
    )
    print(f"wrote {args.config}", file=sys.stderr)
    if args.env_dir:
        for path in auth.write_env_files(args.env_dir):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Who may publish what: Phalanx roles as real nats-server permissions.

The wire contract says who sends and who receives each subject
(:data:`phalanx.contract.proto.PARTIES`, checked against what the code subscribes to and
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
not its subject's (:func:`phalanx.contract.subjects.sender_mismatch`), the detector and
the planner take a process exit only from the launcher of the node that runs the
worker (the planner's join answers say which), and the planner takes collective
errors and acknowledgements only from members of the current generation.

**A job's record is its own.** The record holds the plan, and the plan the
generation's rendezvous secret (:attr:`phalanx.contract.Plan.store_secret`), so a
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
import secrets
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.bus.auth import ENV_NATS_PASSWORD, ENV_NATS_USER
from phalanx.bus.credentials import (
    ENV_RANK_PASSWORD,
    ENV_RANK_USER,
    ENV_WORKER_CREDENTIALS,
)
from phalanx.bus.topology import (
    account_max_file,
    stream_replicas,
)
from phalanx.contract.permissions import (
    ACCOUNT,
    LAUNCHER,
    RANK,
    ROLES,
    Permissions,
    check_name,
    permissions,
    user_name,
    worker_node,
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
        check_name("job", job)
        for name in (*workers, *nodes):
            check_name("worker or node", name)
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

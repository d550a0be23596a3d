"""Who may publish what: Phalanx roles as real nats-server permissions.

The wire contract says who sends each subject (:data:`phalanx.proto.PARTIES`);
this module turns that table into NATS users with ``publish``/``subscribe``
permissions, so the *server* refuses an unauthorised publisher: a training rank
cannot publish a plan, only the planner can write the ``phalanx_jobs`` KV bucket,
and nothing it refuses reaches a stream, a consumer or a subscriber. The
client sees the refusal as ``-ERR 'Permissions Violation for Publish to
"<subject>"'``; :class:`phalanx.bus.Bus` logs it as ``permission_denied``.

Roles (one NATS user each, named after the role):

============ ==================== ====================================================
role         speaks for           may publish (besides what its JetStream use needs)
============ ==================== ====================================================
planner      elasticity-planner   plans, decisions, the ``phalanx_jobs`` KV bucket
detector     failure-detector     ``failed`` / ``hung`` verdicts
launcher     launcher             job specs, process exits
rank         rank (and spares)    heartbeats, registered, ack, comm_error, recovered
scheduler    scheduler-signal     capacity and preemption signals
replication  state-replication    its error events only (bulk state is not on NATS)
observer     --                   nothing: reads subjects and streams
admin        --                   everything (provisioning, operators, tests)
============ ==================== ====================================================

Every role reads ``phalanx.>`` (services also answer ``phalanx.health.<own
name>``), gets its replies on its own inbox ``_INBOX.<user>.>`` (``Bus.connect``
sets that prefix), may look at streams and KV entries (stream info, message
get), and runs JetStream consumers only on the streams it consumes. Only roles
that create the topology (``Bus.connect(ensure=True)``) may create streams, and
only the planner and admin may *update* one. Error events go to
``phalanx.err.<own service>``; ranks (named ``rank-<worker>``) may use any
``phalanx.err.*`` except a service's.

Credentials travel in the environment, never in the URL (a URL is logged):
``PHALANX_NATS_USER`` and ``PHALANX_NATS_PASSWORD``. Passwords are random per
deployment (:meth:`NatsAuth.generate`); the rendered server config holds them, so
it is written with mode 0600.

>>> auth = NatsAuth.generate()
>>> auth.write_config("nats.conf", listen="0.0.0.0:4222", store_dir="/data")
>>> auth.env("rank")
{'PHALANX_NATS_USER': 'rank', 'PHALANX_NATS_PASSWORD': '...'}

    python -m phalanx.natsauth write --config nats.conf --env-dir secrets/
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.bus._connection import ENV_NATS_PASSWORD, ENV_NATS_USER, inbox_prefix
from phalanx.bus.subjects import CATALOGUE, ERROR, HEALTH, Subject, Transport
from phalanx.bus.topology import COMMANDS, EVENTS, JOBS_BUCKET, SCHED, STREAMS
from phalanx.proto import PARTIES

JS_API = "$JS.API"
KV_STREAM = f"KV_{JOBS_BUCKET}"
KV_SUBJECTS = f"$KV.{JOBS_BUCKET}.>"
ALL_STREAMS: tuple[str, ...] = (*(s.name for s in STREAMS), KV_STREAM)

PLANNER, DETECTOR, LAUNCHER, RANK = "planner", "detector", "launcher", "rank"
SCHEDULER, REPLICATION, OBSERVER, ADMIN = "scheduler", "replication", "observer", "admin"


@dataclass(frozen=True)
class Role:
    """What a role is allowed beyond reading: derived into :class:`Permissions`."""

    name: str
    party: str | None  # the sender it is in phalanx.proto.PARTIES (None: sends nothing)
    service: str | None = None  # a Phalanx service: owns phalanx.err.<service> and its health subject
    consumes: tuple[str, ...] = ()  # streams it runs JetStream consumers on
    creates_topology: bool = False  # Bus.connect(ensure=True): may create the streams and the bucket
    updates_topology: bool = False  # may change a stream's configuration
    writes_jobs_kv: bool = False  # may put/update/delete/purge keys of the phalanx_jobs bucket
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
            description="turns heartbeats and process exits into failed/hung verdicts",
        ),
        Role(
            LAUNCHER,
            "launcher",
            creates_topology=True,
            description="phalanx run: publishes the job spec and process exits",
        ),
        Role(RANK, "rank", description="a training rank or hot spare (user code: the least trusted)"),
        Role(
            SCHEDULER,
            "scheduler-signal",
            "scheduler-signal",
            creates_topology=True,
            description="publishes capacity changes and preemption notices",
        ),
        Role(
            REPLICATION,
            "state-replication",
            "state-replication",
            consumes=(COMMANDS.name, EVENTS.name),
            creates_topology=True,
            description="follows plans and recoveries; moves state over its own TCP streams",
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


def _senders(party: str) -> list[Subject]:
    return [s for s in CATALOGUE if party in PARTIES.get(s.pattern, ((), ()))[0]]


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


def permissions(role: str, user: str | None = None) -> Permissions:
    """The NATS permissions of ``role`` (for the user named ``user``, default the role)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    user = user or role
    if role == ADMIN:
        return Permissions(publish_allow=(">",), subscribe_allow=(">",))
    r = ROLES[role]
    pub: list[str] = [f"{JS_API}.INFO", f"{JS_API}.STREAM.NAMES", f"{JS_API}.STREAM.LIST"]
    deny: list[str] = []
    # Application subjects: what the contract says this party sends.
    if r.party is not None:
        for s in _senders(r.party):
            if s is ERROR:
                if r.service:
                    pub.append(ERROR.format(service=r.service))
                else:  # ranks report as rank-<worker>: any name but a service's
                    pub.append(ERROR.wildcard())
                    deny += [ERROR.format(service=svc) for svc in SERVICES]
            elif s.transport is Transport.REQUEST:
                continue  # requests are the operator's (admin); a service may ping itself below
            else:
                pub.append(s.wildcard())
    if r.service:
        pub.append(HEALTH.format(service=r.service))  # its own probe (the health check in its container)
    # JetStream: read everything, consume only its own streams, change the topology if allowed.
    for stream in ALL_STREAMS:
        pub += _stream_read(stream)
    for stream in r.consumes:
        pub += _stream_consume(stream)
    if r.creates_topology:
        pub += [f"{JS_API}.STREAM.CREATE.{s}" for s in ALL_STREAMS]
    if r.updates_topology:
        pub += [f"{JS_API}.STREAM.UPDATE.{s}" for s in ALL_STREAMS]
    if r.writes_jobs_kv:
        pub.append(KV_SUBJECTS)
    else:
        deny.append(KV_SUBJECTS)
    # Never for these roles, whatever the allow list grows into.
    deny += [f"{JS_API}.STREAM.DELETE.>", f"{JS_API}.STREAM.PURGE.>", f"{JS_API}.STREAM.MSG.DELETE.>"]
    if not r.updates_topology:
        deny.append(f"{JS_API}.STREAM.UPDATE.>")
    sub = [
        "phalanx.hb.>",
        "phalanx.node.>",
        "phalanx.evt.>",
        "phalanx.cmd.>",
        "phalanx.sched.>",
        "phalanx.err.>",
        f"{inbox_prefix(user)}.>",
    ]
    if r.service:
        sub.append(HEALTH.format(service=r.service))
    if role == OBSERVER:
        sub.append("$JS.EVENT.>")  # JetStream advisories
    return Permissions(
        publish_allow=tuple(dict.fromkeys(pub)),
        publish_deny=tuple(dict.fromkeys(deny)),
        subscribe_allow=tuple(sub),
        allow_responses=r.service is not None,
    )


@dataclass(frozen=True)
class Credentials:
    role: str
    user: str
    password: str = field(repr=False)

    def env(self) -> dict[str, str]:
        """The environment a process of this role connects with (``Bus.connect`` reads it)."""
        return {ENV_NATS_USER: self.user, ENV_NATS_PASSWORD: self.password}


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


@dataclass(frozen=True)
class NatsAuth:
    """The users of one deployment: one per role, each with a random password."""

    users: Mapping[str, Credentials]

    @classmethod
    def generate(cls, roles: Iterable[str] = tuple(ROLES)) -> NatsAuth:
        users = {}
        for role in roles:
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
            users[role] = Credentials(role, role, secrets.token_urlsafe(24))
        return cls(users)

    def credentials(self, role: str) -> Credentials:
        try:
            return self.users[role]
        except KeyError:
            raise KeyError(f"no user for role {role!r} in this deployment") from None

    def env(self, role: str) -> dict[str, str]:
        return self.credentials(role).env()

    def authorization(self) -> dict[str, object]:
        """The ``authorization`` block of a nats-server config."""
        return {
            "users": [
                {
                    "user": c.user,
                    "password": c.password,
                    "permissions": permissions(c.role, c.user).as_config(),
                }
                for c in self.users.values()
            ]
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
    ) -> str:
        """A complete nats-server config: listen address, JetStream, authorization.

        Command-line flags given together with ``-c`` (as :class:`NatsServer` does)
        override ``listen`` and the JetStream store directory (which must then not be
        set here: the server refuses a store directory given twice).
        ``authorization_only``: just the ``authorization`` block, for an existing
        config to ``include`` (e.g. the cluster config of deploy/k8s/nats.yaml).
        """
        conf: dict[str, object] = {}
        if authorization_only:
            pass
        elif listen:
            conf["listen"] = listen
        if server_name and not authorization_only:
            conf["server_name"] = server_name
        if http_port and not authorization_only:
            conf["http_port"] = http_port
        if jetstream and not authorization_only:
            conf["jetstream"] = {"store_dir": os.fspath(store_dir)} if store_dir else {"enabled": True}
        conf["authorization"] = self.authorization()
        body = "".join(f"{k}: {_conf_value(v, 0)}\n" for k, v in conf.items())
        roles = ", ".join(self.users)
        return (
            f"# nats-server config generated by phalanx.natsauth (roles: {roles}). Holds passwords.\n{body}"
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
    ) -> Path:
        """Write :meth:`render_config` to ``path``, readable by its owner only."""
        text = self.render_config(
            listen=listen,
            store_dir=store_dir,
            jetstream=jetstream,
            server_name=server_name,
            http_port=http_port,
            authorization_only=authorization_only,
        )
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(out, 0o600)
        return out

    def write_env_files(self, directory: str | os.PathLike[str]) -> list[Path]:
        """One ``<role>.env`` per role (``KEY=value`` lines, mode 0600): a compose
        ``env_file`` or ``kubectl create secret generic --from-env-file``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        written = []
        for role, cred in self.users.items():
            p = d / f"{role}.env"
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.writelines(f"{k}={v}\n" for k, v in cred.env().items())
            os.chmod(p, 0o600)
            written.append(p)
        return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m phalanx.natsauth", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="generate users and write the server config and per-role env files")
    w.add_argument("--config", required=True, help="nats-server config to write (mode 0600)")
    w.add_argument("--env-dir", help="directory for <role>.env files (mode 0600)")
    w.add_argument("--listen", default="0.0.0.0:4222")
    w.add_argument("--store-dir", default="/data")
    w.add_argument("--server-name")
    w.add_argument("--http-port", type=int)
    w.add_argument("--roles", default=",".join(ROLES), help="comma-separated subset of the roles")
    w.add_argument(
        "--authorization-only", action="store_true", help="only the authorization block, to include"
    )
    s = sub.add_parser("show", help="print one role's permissions as JSON")
    s.add_argument("role", choices=list(ROLES))
    args = p.parse_args(argv)
    if args.cmd == "show":
        print(json.dumps(permissions(args.role).as_config(), indent=2))
        return 0
    auth = NatsAuth.generate([r.strip() for r in args.roles.split(",") if r.strip()])
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

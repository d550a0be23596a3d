"""The NATS users of the deployments, with their passwords left to the environment.

``phalanx.natsauth`` derives each role's permissions from the wire contract; this
script renders them as a nats-server ``accounts`` block whose passwords are
variable references (``password: $NATS_PASSWORD_PLANNER``). nats-server resolves a
reference it does not find in the config from its environment, so the checked-in
``auth.conf`` holds no secret: compose passes the passwords from ``deploy/.env``,
Kubernetes from the Secret ``phalanx-nats-passwords``; each Phalanx process gets
its own login (``PHALANX_NATS_USER`` / ``PHALANX_NATS_PASSWORD``) from the same
place.

    python deploy/nats/render.py auth            # rewrite the checked-in auth.conf files
    python deploy/nats/render.py auth --check    # exit 1 if they differ from the rendering
    python deploy/nats/render.py env > deploy/.env   # random passwords (mode: keep it private)

The users are in one account, ``PHALANX``, with a JetStream quota that covers
every stream's and bucket's ``max_bytes`` (phalanx.bus.topology) and refuses a
stream without one (``NatsAuth.accounts``).

Users: the four services, ``admin`` (operators: ``phalanx cluster offer``...), and for
each job (``--job``, default ``sample``) one launcher per node, ``launcher@<job>/<node>``,
and one rank user per worker, ``rank@<job>/<node>-w<i>``: a launcher speaks only for
its node, a rank only for itself (``phalanx.natsauth``). The nodes are the
deployment's (compose: ``node-a``, ``node-b``; Kubernetes: the Indexed Job's pods
``train-sample-<index>``), with ``WORKERS_PER_NODE`` names each: the 3 workers a
node starts, and the 3 the planner names them when the node's launcher is
replaced within the run (a worker it has no user for gets no login and fails
to start). Each launcher gets its own login and its workers' and nobody else's:

    python deploy/nats/render.py launchers --env deploy/.env --out DIR   # DIR/launcher-<job>-<node>.env

(compose writes the same values into each node's environment from ``deploy/.env``;
Kubernetes mounts the Secret ``phalanx-launchers-<job>`` made from DIR, and each pod
loads the file of its index: ``PHALANX_NATS_ENV_FILE``.)
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import string
import sys
from collections.abc import Callable
from pathlib import Path

from phalanx.bus.credentials import ENV_WORKER_CREDENTIALS, read_env_file
from phalanx.contract.permissions import ADMIN, DETECTOR, LAUNCHER, PLANNER, REPLICATION, SCHEDULER
from phalanx.natsauth import NatsAuth

HERE = Path(__file__).resolve().parent
DEPLOY = HERE.parent
# The nodes of each deployment (one launcher each), and the auth.conf it uses.
NODES = {"compose": ("node-a", "node-b"), "k8s": ("train-sample-0", "train-sample-1")}
PRODUCTION_AUTH = DEPLOY / "k8s" / "overlays" / "production" / "nats" / "auth.conf"
TARGETS = {
    HERE / "auth.conf": "compose",
    DEPLOY / "k8s" / "base" / "nats" / "auth.conf": "k8s",
    PRODUCTION_AUTH: "k8s",
}
ALL_NODES = tuple(n for nodes in NODES.values() for n in nodes)
WORKERS_PER_NODE = 6
ROLES = (PLANNER, DETECTOR, SCHEDULER, REPLICATION, ADMIN)
JOBS = ("sample",)
PASSWORD_ALPHABET = string.ascii_letters + string.digits
# The account's JetStream quota covers every stream at the deployment's replicas (the
# 3-node cluster of overlays/production: 3). nats-server refuses to start when the
# quota is above its store's max_file_store (nats.conf).
QUOTA_REPLICAS = {PRODUCTION_AUTH: 3}


def password_var(user: str) -> str:
    """The environment variable holding ``user``'s password: ``launcher@sample/node-a`` ->
    ``NATS_PASSWORD_LAUNCHER_SAMPLE_NODE_A``."""
    return "NATS_PASSWORD_" + re.sub(r"[^A-Za-z0-9]+", "_", user).upper()


def workers(nodes: tuple[str, ...]) -> list[str]:
    """The worker names the deployment has users for: ``<node>-w0``.. on each node."""
    return [f"{n}-w{i}" for n in nodes for i in range(WORKERS_PER_NODE)]


def deployment_auth(jobs: tuple[str, ...] = JOBS, nodes: tuple[str, ...] = ALL_NODES) -> NatsAuth:
    """The users of a deployment on ``nodes``, with placeholder passwords."""
    return NatsAuth.generate(ROLES, jobs={job: workers(nodes) for job in jobs})


def users(jobs: tuple[str, ...] = JOBS, nodes: tuple[str, ...] = ALL_NODES) -> dict[str, str]:
    """Every user of the deployments (default: of all of them) -> the variable of its password."""
    return {user: password_var(user) for user in deployment_auth(jobs, nodes).users}


def _compose_var(user: str) -> str:
    return f"${{{password_var(user)}:?set in deploy/.env}}"


def launcher_env(job: str, node: str, password: Callable[[str], str] = _compose_var) -> dict[str, str]:
    """What the launcher of ``job`` on ``node`` logs in with: its own user, and its
    workers' (``PHALANX_NATS_WORKER_CREDENTIALS``), each password ``password(user)``
    (default: the compose interpolation ``${NATS_PASSWORD_...:?...}``)."""
    auth = deployment_auth((job,), (node,))
    table = {
        c.worker: {"user": c.user, "password": password(c.user)}
        for c in auth.users.values()
        if c.job == job and c.worker is not None
    }
    user = auth.credentials(LAUNCHER, job, node=node).user
    return {
        "PHALANX_NATS_USER": user,
        "PHALANX_NATS_PASSWORD": password(user),
        ENV_WORKER_CREDENTIALS: json.dumps(table, separators=(",", ":")),
    }


def render(jobs: tuple[str, ...] = JOBS, nodes: tuple[str, ...] = NODES["compose"], replicas: int = 1) -> str:
    """The ``accounts`` block, passwords as ``$VAR`` references (unquoted: a
    quoted ``"$VAR"`` would be a literal string); the JetStream quota for streams of
    ``replicas``."""
    auth = deployment_auth(jobs, nodes)
    marked = NatsAuth(
        {
            user: type(cred)(cred.role, cred.user, f"${password_var(user)}", cred.job, cred.worker, cred.node)
            for user, cred in auth.users.items()
        }
    )
    body = marked.render_config(authorization_only=True, replicas=replicas).split("\n", 1)[1]
    body, n = re.subn(r'^(\s*password: )"(\$[A-Z0-9_]+)"$', r"\1\2", body, flags=re.M)
    assert n == len(auth.users), "every user's password is a variable reference"
    header = (
        "# Generated by deploy/nats/render.py from phalanx.natsauth: do not edit, run\n"
        "#   python deploy/nats/render.py auth\n"
        "# The passwords are nats-server variable references, resolved from the server's\n"
        "# environment (compose: deploy/.env; Kubernetes: Secret phalanx-nats-passwords).\n"
    )
    return header + body


def random_env(jobs: tuple[str, ...] = JOBS) -> str:
    """A ``deploy/.env`` with a random password per user (letters and digits only,
    starting with a letter: nats-server parses a variable's value as a config value,
    so ``true`` or ``123`` would not be strings), Grafana's admin password and the keepers'
    cluster key (``PHALANX_KEEPER_KEY``, 64 characters)."""

    def pw() -> str:
        return secrets.choice(string.ascii_letters) + "".join(
            secrets.choice(PASSWORD_ALPHABET) for _ in range(31)
        )

    lines = [f"{var}={pw()}" for var in users(jobs).values()]
    lines.append(f"GRAFANA_ADMIN_PASSWORD={pw()}")
    # The keepers' cluster key (state-replication only; ranks never get it): 32 bytes at least.
    lines.append(f"PHALANX_KEEPER_KEY={pw()}{pw()}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("auth", help="write (or --check) the checked-in auth.conf files")
    a.add_argument("--check", action="store_true")
    e = sub.add_parser("env", help="print a .env with random passwords")
    la = sub.add_parser("launchers", help="write each node's launcher-<job>-<node>.env from a .env")
    la.add_argument("--env", required=True, type=Path, help="the deployment's .env (render.py env)")
    la.add_argument("--out", required=True, type=Path, help="directory to write (mode 0600 files)")
    la.add_argument("--deployment", choices=sorted(NODES), default="k8s")
    for s in (a, e, la):
        s.add_argument("--job", action="append", help=f"a job's users (default: {', '.join(JOBS)})")
    args = p.parse_args(argv)
    jobs = tuple(args.job or JOBS)
    if args.cmd == "env":
        sys.stdout.write(random_env(jobs))
        return 0
    if args.cmd == "launchers":
        values = read_env_file(args.env)
        for job in jobs:
            for node in NODES[args.deployment]:
                env = launcher_env(job, node, lambda u: values[password_var(u)])
                path = args.out / f"{LAUNCHER}-{job}-{node}.env"
                args.out.mkdir(parents=True, exist_ok=True)
                path.touch(mode=0o600)
                path.chmod(0o600)  # (before the passwords go in)
                path.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
                print(f"wrote {path}", file=sys.stderr)
        return 0
    texts = {t: render(jobs, NODES[d], QUOTA_REPLICAS.get(t, 1)) for t, d in TARGETS.items()}
    stale = [t for t, text in texts.items() if not t.exists() or t.read_text() != text]
    if args.check:
        for t in stale:
            print(f"{t} differs from the rendering: python deploy/nats/render.py auth", file=sys.stderr)
        return 1 if stale else 0
    for t in stale:
        t.parent.mkdir(parents=True, exist_ok=True)
        t.write_text(texts[t])
        print(f"wrote {t}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A local control plane requires logins, and leaves them for the user who started it.

``LocalStack(auth=True, publish_logins=True)`` is what ``phalanx up`` and ``phalanx
run``'s private control plane start: the server refuses a client without a login; the
logins are in ``PHALANX_LOGINS_DIR/<host>-<port>/`` (0700, files 0600), which the
``phalanx`` commands of this user read (``admin`` for the CLI, ``run`` for a launcher
and its ranks), and which another uid can neither read nor replace with its own.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.bus.auth import ENV_NATS_PASSWORD, ENV_NATS_USER
from phalanx.bus.credentials import ENV_LOGINS_DIR, ENV_RANK_USER, LocalLogins
from phalanx.devstack.localstack import LocalStack
from tests.procs import NOBODY, as_uid, nats_connect_without_login, read_or_why


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalStack]:
    monkeypatch.setenv(ENV_LOGINS_DIR, str(tmp_path / "logins"))
    for k in (ENV_NATS_USER, ENV_NATS_PASSWORD, "NATS_URL"):
        monkeypatch.delenv(k, raising=False)
    with LocalStack(tmp_path / "stack", services=(), auth=True, publish_logins=True) as s:
        yield s


def cli(stack: LocalStack, *args: str) -> subprocess.CompletedProcess[str]:
    """A ``phalanx`` command of this user, with no login in its environment."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV_NATS_USER, ENV_NATS_PASSWORD)}
    return subprocess.run(
        [sys.executable, "-m", "phalanx.cli", *args],
        env={**env, "NATS_URL": stack.url},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_logins_are_this_users_alone_and_its_commands_use_them(stack: LocalStack) -> None:
    assert stack.users.logins is not None
    d = stack.users.logins.dir
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE(d.parent.stat().st_mode) == 0o700
    for name in ("admin", "run"):
        st = (d / f"{name}.env").stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    run = stack.users.logins.read("run")
    assert run[ENV_NATS_USER] == "launcher" and run[ENV_RANK_USER] == "rank"
    assert stack.users.logins.read("admin")[ENV_NATS_USER] == "admin"
    done = cli(stack, "cluster", "show", "--json")  # logs in as admin, from the file
    assert done.returncode == 0, done.stderr
    assert "authorization" not in done.stderr.lower()


def test_another_uid_is_refused_and_cannot_read_the_logins(stack: LocalStack) -> None:
    assert stack.users.logins is not None
    # where no login is asked for the server lets a client in: not this one
    assert "Authorization Violation" in as_uid(NOBODY, lambda: nats_connect_without_login(stack.url))
    path = stack.users.logins.dir / "admin.env"
    assert as_uid(NOBODY, lambda: read_or_why(path)).startswith("PermissionError")


def test_logins_another_user_could_have_planted_are_not_used(stack: LocalStack, tmp_path: Path) -> None:
    """A logins directory or file open to others, or a symlink, is refused with the reason
    (a login another user wrote would be someone else's)."""
    assert stack.users.logins is not None
    d = stack.users.logins.dir
    d.chmod(0o755)
    with pytest.raises(PermissionError, match="not this user's alone"):
        stack.users.logins.read("admin")
    done = cli(stack, "cluster", "show", "--json")
    assert done.returncode == 2 and "not this user's alone" in done.stderr, done.stderr
    d.chmod(0o700)
    (d / "admin.env").unlink()
    os.symlink(tmp_path / "elsewhere.env", d / "admin.env")
    with pytest.raises(PermissionError):
        LocalLogins(stack.url).read("admin")


def test_the_logins_go_with_the_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_LOGINS_DIR, str(tmp_path / "logins"))
    monkeypatch.delenv("NATS_URL", raising=False)
    with LocalStack(tmp_path / "stack", services=(), auth=True, publish_logins=True) as s:
        assert s.users.logins is not None
        d = s.users.logins.dir
        assert (d / "admin.env").exists()
    assert not d.exists()

"""A job's own directory under a directory every job of the node shares:
``<node>/slots/<job>`` (its snapshot slots) and ``<node>/dcp/<name>`` (its DCP files;
``name`` the job, for the set, or a part ``<job>=r<rank>``).

``slots/`` and ``dcp/`` are sticky and open to every uid (like ``/tmp``): each job
makes its own directory there and none can move another's. But any uid can make an
entry under a job's name before the job does: a directory of its own (every save of
the job would fail), or a symlink to a directory it can read (the job would write its
weights there). So a rank never follows the entry: it is a real directory, opened
without following symlinks, owned by the rank's uid and not writable by everyone --
or the name is *squatted*. A squatted name is refused loudly (logged with who holds
it; the keeper reports it as an error event too) and the job goes on in a *fallback*
directory beside it, ``<name>.<16 hex digits>``: a name nobody can guess, made by the
rank itself (``mkdir`` fails where it exists), checked the same way. Squatting thus
neither diverts a job's files nor stops its saves. A rank reuses a fallback of its own
uid that is already there (one directory from save to save, and across restarts).

The keeper takes an entry under either name as the job's (:func:`name_of_entry`), and
only where it checks it as the rank does: a real directory owned by the job's uid.

>>> import tempfile; node = Path(tempfile.mkdtemp()) / "n1"
>>> d = own_job_dir(node, "dcp", "j1=r0"); os.close(d.fd)
>>> (d.path.name, d.squatted)
('j1=r0', '')
>>> name_of_entry("j1=r0.0123456789abcdef"), name_of_entry("j1.x")
('j1=r0', None)
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import phalanx.checkpoint.paths as paths
from phalanx.telemetry import get_logger

SHARED_MODE = 0o1777  # <node>/slots and <node>/dcp: sticky, every job may create its directory
JOB_DIR_MODE = 0o770  # the job's uid and group (the keeper reaches it as a group member, or root)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}(=r(0|[1-9][0-9]{0,8}))?$")  # a job or a part, as a manifest's
_FALLBACK = re.compile(r"^(.+)\.[0-9a-f]{16}$")
_NOT_OURS = (errno.ENOTDIR, errno.ELOOP, errno.EACCES)  # opening a symlink, a file, another's 0700 dir
log = get_logger(component="checkpoint")


@dataclass(frozen=True)
class JobDir:
    """What :func:`own_job_dir` opened: the directory's descriptor (the caller closes it)
    and path, and why the job's own name could not be used ("" when it was)."""

    fd: int
    path: Path
    squatted: str = ""


class _Squatted(PermissionError):
    """An entry that is not this uid's own real directory."""


def name_of_entry(entry: str) -> str | None:
    """The job (or part) whose directory the entry ``entry`` of ``slots/`` or ``dcp/``
    is: ``name`` itself, or its fallback ``name.<16 hex>``; None for anything else."""
    m = _FALLBACK.match(entry)
    name = m.group(1) if m else entry
    return name if _NAME.match(name) else None


def own_job_dir(node_dir: Path, kind: str, name: str) -> JobDir:
    """``<node_dir>/<kind>/<name>``, this rank's own: created (mode 0770) if missing,
    or -- where another uid holds that name, or it is a symlink, or everyone may write
    it -- a fallback directory of this rank's own beside it, the squat logged as an
    error (see the module doc). ``<kind>`` is made sticky and open to every job if this
    rank comes before the keeper."""
    if not _NAME.match(name):
        raise ValueError(f"{name!r} is not a job name (1-64 of letters, digits, '_', '-'; or a part)")
    with _shared_dir(node_dir, kind) as kind_fd:
        try:
            fd = _open_own(kind_fd, name, node_dir / kind / name, made=_make(kind_fd, name))
            return JobDir(fd, node_dir / kind / name)
        except _Squatted as exc:
            why = str(exc)
        fd, entry = _fallback(kind_fd, node_dir / kind, name)
    where = node_dir / kind / entry
    log.error("job_dir_squatted", directory=str(node_dir / kind / name), reason=why, fallback=str(where))
    return JobDir(fd, where, why)


@contextlib.contextmanager
def _shared_dir(node_dir: Path, kind: str) -> Iterator[int]:
    node_dir.parent.mkdir(parents=True, exist_ok=True)  # the configured root: trusted
    with paths.dir_at(node_dir.parent, node_dir.name, create=0o755) as node_fd:
        try:
            os.mkdir(kind, SHARED_MODE, dir_fd=node_fd)
            with paths.dir_at(node_fd, kind) as kind_fd:
                os.fchmod(kind_fd, SHARED_MODE)  # the first comes before the keeper: open it to every job
        except FileExistsError:
            pass
        with paths.dir_at(node_fd, kind) as kind_fd:
            yield kind_fd


def _make(kind_fd: int, entry: str) -> bool:
    """Whether the entry ``entry`` of ``kind_fd`` was made (a directory) here and now."""
    try:
        os.mkdir(entry, JOB_DIR_MODE, dir_fd=kind_fd)
    except FileExistsError:
        return False
    return True


def _open_own(kind_fd: int, entry: str, where: Path, *, made: bool) -> int:
    """The entry ``entry`` of ``kind_fd``, opened (given mode 0770 past the umask if
    this rank just ``made`` it); :class:`_Squatted` unless it is a real directory of this
    uid not writable by everyone."""
    try:
        fd = paths.open_dir(kind_fd, entry)
    except OSError as exc:
        if exc.errno not in _NOT_OURS:
            raise
        raise _Squatted(f"{where} is {holder_of(kind_fd, entry)}, not this job's directory") from None
    try:
        if made:
            os.fchmod(fd, JOB_DIR_MODE)
        paths.check_owned(fd, os.geteuid(), str(where))
    except PermissionError as exc:
        os.close(fd)
        raise _Squatted(str(exc.strerror or exc)) from None
    return fd


def holder_of(dir_fd: int, entry: str) -> str:
    """What the entry ``entry`` of ``dir_fd`` is and whose ("a symlink of uid 65534"),
    nothing followed."""
    try:
        st = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return "gone"
    if stat.S_ISLNK(st.st_mode):
        what = "a symlink"
    else:
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "a file"
    return f"{what} of uid {st.st_uid}"


def _fallback(kind_fd: int, kind_dir: Path, name: str) -> tuple[int, str]:
    """A fallback directory of ``name`` of this uid's own (one already there, else a new
    one): its descriptor and entry."""
    for entry in sorted(os.listdir(kind_fd)):
        if entry != name and name_of_entry(entry) == name:
            with contextlib.suppress(_Squatted, FileNotFoundError):
                return _open_own(kind_fd, entry, kind_dir / entry, made=False), entry
    for _ in range(8):
        entry = f"{name}.{secrets.token_hex(8)}"
        if _make(kind_fd, entry):
            return _open_own(kind_fd, entry, kind_dir / entry, made=True), entry
    raise FileExistsError(errno.EEXIST, f"no fallback directory of {name} could be made in {kind_dir}")

"""Paths the keeper touches, resolved one component at a time without following symlinks.

Under ``<shm_root>/<node>`` several jobs (possibly several uids) share one
tmpfs. Whoever can write a directory there can plant a symlink in it, so the
keeper never hands a path string to ``open``/``rmtree``: it opens a trusted base
(a directory it configured and created), then each component below it with
``O_NOFOLLOW | O_DIRECTORY`` relative to the previous one (``openat``), and
files with ``O_NOFOLLOW`` relative to their directory. A symlink anywhere below
the base fails with ``ELOOP``/``ENOTDIR`` instead of redirecting a write or a
delete; :func:`rmtree_at` removes a tree through directory descriptors
(``shutil.rmtree(dir_fd=...)``), which refuses a symlink at the top and never
follows one inside.

Ownership: :func:`check_owned` refuses a directory owned by another uid than
expected, or writable by everyone.

>>> import tempfile; base = Path(tempfile.mkdtemp())
>>> with dir_at(base, "a", "b", create=0o750) as fd: os.path.isdir(base / "a" / "b")
True
>>> os.symlink(base / "a", base / "link")
>>> with dir_at(base, "link", "b"): pass
Traceback (most recent call last):
...
NotADirectoryError: [Errno 20] Not a directory: 'link'
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _components(parts: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for p in parts:
        for name in str(p).split("/"):
            if name in ("", ".", ".."):
                raise OSError(errno.EINVAL, f"unsafe path component {name!r} in {'/'.join(parts)!r}")
            out.append(name)
    return out


def open_dir(base: Path | int, *parts: str, create: int | None = None, group: int | None = None) -> int:
    """A descriptor of ``base/parts...``: ``base`` (a path the caller trusts, or an open
    directory descriptor, not consumed) and each component below it opened without
    following symlinks. ``create``: the mode of missing components (created, then
    ``fchmod``-ed past the umask; ``group``: and given that group). The caller closes it."""
    fd = os.open(base, DIR_FLAGS & ~os.O_NOFOLLOW) if not isinstance(base, int) else os.dup(base)
    try:
        for name in _components(parts):
            made = False
            if create is not None:
                try:
                    os.mkdir(name, create, dir_fd=fd)
                    made = True
                except FileExistsError:
                    pass
            nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
            if made:
                assert create is not None
                os.fchmod(fd, create)
                if group is not None:
                    os.fchown(fd, -1, group)
        return fd
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def dir_at(
    base: Path | int, *parts: str, create: int | None = None, group: int | None = None
) -> Iterator[int]:
    """:func:`open_dir` as a context manager."""
    fd = open_dir(base, *parts, create=create, group=group)
    try:
        yield fd
    finally:
        os.close(fd)


def open_file(dir_fd: int, rel: str, flags: int, mode: int = 0o640, *, create_dirs: int | None = None) -> int:
    """``rel`` (``a/b/file``) below the directory ``dir_fd``, every component without
    following symlinks; ``create_dirs``: the mode of missing intermediate directories.
    Only a regular file is returned (a FIFO or device planted there is refused)."""
    names = _components((rel,))
    parent = open_dir(dir_fd, *names[:-1], create=create_dirs)
    try:
        fd = os.open(names[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=parent)
    finally:
        os.close(parent)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{rel} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def rmtree_at(base: Path | int, *parts: str) -> bool:
    """Remove ``base/parts...`` (a directory tree) without following any symlink: a
    symlink at any component is an ``OSError``, its target untouched. False if it was
    not there."""
    names = _components(parts)
    try:
        parent = open_dir(base, *names[:-1])
    except FileNotFoundError:
        return False
    try:
        try:
            st = os.stat(names[-1], dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(
                errno.ELOOP if stat.S_ISLNK(st.st_mode) else errno.ENOTDIR, f"{names[-1]} is not a directory"
            )
        shutil.rmtree(names[-1], dir_fd=parent)
        return True
    finally:
        os.close(parent)


def rename_at(dir_fd: int, src: str, dst: str) -> None:
    """``src`` to ``dst``, both names in the directory ``dir_fd``."""
    os.rename(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def check_owned(fd: int, uid: int, what: str) -> os.stat_result:
    """The stat of the directory ``fd``; PermissionError unless ``uid`` owns it and
    other users may not write it."""
    st = os.fstat(fd)
    if st.st_uid != uid:
        raise PermissionError(errno.EPERM, f"{what} is owned by uid {st.st_uid}, expected uid {uid}")
    if st.st_mode & stat.S_IWOTH:
        raise PermissionError(
            errno.EPERM, f"{what} is writable by every user (mode {stat.filemode(st.st_mode)})"
        )
    return st


def regular_files(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """Every file below the directory ``dir_fd`` (relative names, sorted) with its
    ``lstat``; OSError on anything that is neither a directory nor a regular file (a
    symlink is never followed)."""
    out: list[tuple[str, os.stat_result]] = []
    for root, dirs, files, root_fd in os.fwalk(".", dir_fd=dir_fd, follow_symlinks=False):
        for name in dirs:  # fwalk lists a symlink to a directory here (and does not enter it)
            if not stat.S_ISDIR(os.stat(name, dir_fd=root_fd, follow_symlinks=False).st_mode):
                raise OSError(errno.ELOOP, f"{os.path.join(root, name)} is a symlink")
        for name in files:
            st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            rel = os.path.normpath(os.path.join(root, name))
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.ELOOP, f"{rel} is not a regular file (a symlink?)")
            out.append((rel, st))
    return sorted(out)

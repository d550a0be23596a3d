"""Processes a test started, from /proc: what is left running after a stop."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

NOBODY = 65534  # another local user, for the tests that need one (as root)


def descendants(pid: int) -> dict[int, bytes]:
    """pid -> command line of every descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes()
        except OSError:
            continue
    out: dict[int, bytes] = {}
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        for c, pp in parents.items():
            if pp == p:
                out[c] = cmdlines.get(c, b"")
                frontier.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def as_uid(uid: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` in a fork that dropped to ``uid`` (another local user: no supplementary
    groups, nothing of this process's but its memory): what it returned; an exception
    it raised fails the test."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                out: tuple[str, Any] = ("ok", fn())
            except BaseException as exc:
                out = ("raised", repr(exc))
            os.write(w, pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(w)
    raw = b""
    while chunk := os.read(r, 65536):
        raw += chunk
    os.close(r)
    os.waitpid(pid, 0)
    kind, value = pickle.loads(raw)
    assert kind == "ok", f"the child of uid {uid} failed: {value}"
    return value


def read_or_why(path: Path) -> str:
    """``path``'s text, or why it could not be read (``PermissionError: ...``)."""
    try:
        return path.read_text()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def unix_call(path: str, send: bytes, timeout_s: float = 30.0) -> bytes:
    """Connect to the Unix socket ``path``, send ``send`` (maybe nothing), and return
    all it answers (b"" if nothing within ``timeout_s``). A server that refuses a
    caller at accept answers its reason, then resets the connection: the answer is
    what counts."""
    out = b""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        with contextlib.suppress(OSError):  # refused before it was all read
            s.sendall(send)
        with contextlib.suppress(OSError):  # a reset after the reason, or a timeout
            while chunk := s.recv(65536):
                out += chunk
    return out


def nats_connect_without_login(url: str) -> str:
    """A NATS client's first words to ``url`` with no credentials, over a plain socket:
    the server's answer to ``CONNECT {}`` and ``PING`` (``PONG``: let in)."""
    parts = urlsplit(url)
    with socket.socket() as s:  # (no name lookup: a process of another uid may not read the codecs)
        s.settimeout(10)
        s.connect((parts.hostname or "127.0.0.1", parts.port or 4222))
        s.recv(65536)  # INFO
        s.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
        answer = b""
        while b"PONG" not in answer and b"-ERR" not in answer:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer.decode(errors="replace").strip()

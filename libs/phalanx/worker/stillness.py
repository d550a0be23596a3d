"""Whether a thread is standing still: the same Python stack, and no I/O by its process
or the processes it started.

An unmodified script says nothing about what it is doing, and outside its
collectives a rank that evaluates, saves or loads data alone (rank 0 in the usual
torchrun script, its peers waiting in the next all-reduce) looks no different in
its phase from one that spins, deadlocks or waits on a GPU that stopped answering.
What tells them apart is whether the rank gets anywhere: an evaluation pass moves
through the model's frames batch after batch, a ``torch.save`` writes, a data
loader reads, an upload or evaluation run as a child process reads and writes; a
busy loop, a deadlock and a hung device sync sit in one place.

:class:`Stillness` samples the watched thread's stack (every frame, by identity, and
its line: ``sys._current_frames``) and, while that stays the same, the I/O counters of the
process and its descendants (``rchar + wchar`` of ``/proc/<pid>/io``: ``read`` and
``write`` calls on files and pipes; its own reads of those files left out), and
answers since when both have stayed the same. Its limits, each on the side of no
verdict: a Python loop that runs over several lines or calls a function (a polling
loop) moves, and any thread's or child's file I/O counts as the rank moving. Its false
side: one call that takes longer than the straggler bound without file I/O stands
still -- a huge CPU matmul on rank 0 alone, a ``time.sleep``, a synchronous HTTP
request (socket traffic is not counted).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import FrameType

Stack = tuple[tuple[FrameType, int], ...]


def _stack_of(ident: int) -> Stack:
    """The thread's frames, innermost first, each with its line. Frames are compared by
    identity, not by their code: an evaluation pass calls ``Linear.forward`` layer after
    layer, batch after batch, each time a new frame at the same code and line (sampled
    by code and line alone, such a pass stood still for 1.5 s in a 10-minute soak, and
    was judged). Holding the last sample's frames keeps a new one from reusing a
    finished one's address; a frame that returned meanwhile (its locals with it) is
    kept until the next sample, 100 ms at most."""
    frame = sys._current_frames().get(ident)
    out: list[tuple[FrameType, int]] = []
    while frame is not None:
        out.append((frame, frame.f_lineno))
        frame = frame.f_back
    return tuple(out)


def _same(a: Stack, b: Stack) -> bool:
    return len(a) == len(b) and all(fa is fb and la == lb for (fa, la), (fb, lb) in zip(a, b, strict=True))


def _read(path: str) -> bytes:
    """The file's first 4 KiB, or nothing when it is gone (a child that exited)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return b""
    try:
        return os.read(fd, 4096)
    except OSError:
        return b""
    finally:
        os.close(fd)


class _IoCounter:
    """``rchar + wchar`` of the process ``root`` (this one by default) and its
    descendants, less what reading them cost this process (None: no /proc)."""

    def __init__(self, root: int | None = None) -> None:
        self._root = os.getpid() if root is None else root
        self._own = 0  # bytes of our own reads of /proc so far

    def _children(self, pid: int) -> list[int]:
        out: list[int] = []
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return out
        for tid in tasks:
            data = _read(f"/proc/{pid}/task/{tid}/children")
            self._own += len(data)
            out += [int(c) for c in data.split()]
        return out

    def read(self) -> int | None:
        if not os.path.exists(f"/proc/{self._root}/io"):
            return None
        # our own reads of earlier samples are in the rchar read first below; this
        # sample's come after it
        before = self._own
        total, todo, seen = 0, [self._root], set[int]()
        while todo and len(seen) < 256:  # a bounded walk of the tree
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            data = _read(f"/proc/{pid}/io")
            self._own += len(data)
            for line in data.split(b"\n"):
                if line.startswith((b"rchar:", b"wchar:")):
                    total += int(line.split(b":", 1)[1])
            todo += self._children(pid)
        return total - before if self._root == os.getpid() else total  # our reads: in our rchar


class Stillness:
    """Samples a thread (the main one by default); :meth:`sample` says since when it
    has stood still (monotonic seconds), or None while it moves. ``io_root``: the
    process whose tree's I/O counts (this one by default)."""

    def __init__(self, thread: threading.Thread | None = None, *, io_root: int | None = None) -> None:
        thread = thread or threading.main_thread()
        assert thread.ident is not None, "a started thread"
        self._ident = thread.ident
        self._io = _IoCounter(io_root)
        self._stack: Stack = ()
        self._bytes: int | None = None
        self._since: float | None = None

    def reset(self) -> None:
        """Forget the streak (the thread just did something: entered or left a collective)."""
        self._stack, self._bytes, self._since = (), None, None

    def sample(self, now: float | None = None) -> float | None:
        """One sample: the instant from which the thread has shown this same stack with no
        I/O by the process or its descendants, or None when it moved since the last
        sample. The counters are read only while the stack stays the same, so the first
        sample of a still stack is a moving one."""
        now = time.monotonic() if now is None else now
        stack = _stack_of(self._ident)
        io = self._io.read() if stack and _same(stack, self._stack) else None
        moved = io is None or io != self._bytes
        self._stack, self._bytes = stack, io
        if moved:
            self._since = now
            return None
        return self._since

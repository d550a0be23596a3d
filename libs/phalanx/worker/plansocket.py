"""A node's plan, from its launcher to its workers over a local datagram socket.

The launcher follows the job's plan as deltas (:mod:`phalanx.launcher.planview`) and
hands each of its workers the node's part, a :class:`~phalanx.contract.NodePlan`, as
one datagram to the worker's own socket (``PHALANX_PLAN_SOCKET``, a path in the
launcher's private directory). So 16,000 ranks never read the job's record or its
plan subject: their launchers' deltas are all the plan traffic NATS carries.

The worker checks the sender with the kernel (``SO_PASSCRED``): only its parent, the
launcher that started it, may hand it a plan; anything else is refused and counted.
It acknowledges by heartbeat (``Heartbeat.plan``: the newest generation it holds);
the launcher sends the plan again to a worker whose heartbeat says it holds an
older one (a datagram lost to a full buffer, a worker that started after the plan),
and acknowledges the node's members to the planner at once (``NodeAck``).

>>> inbox = PlanInbox(path, on_plan)   # in the worker's agent, on its loop
>>> inbox.start()
>>> send_plan(sock, path, node_plan)   # in the launcher
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path

from phalanx.contract import DecodeError, NodePlan, decode, encode, headers_for

SOCKET_ENV = "PHALANX_PLAN_SOCKET"
MAX_DATAGRAM = 64 * 1024  # a node's part is a few KB; more is refused
_HEADERS = headers_for(NodePlan)
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def send_plan(sock: socket.socket, path: str, plan: NodePlan) -> bool:
    """Hand ``plan`` to the worker listening at ``path``; False when it could not go now
    (no such socket yet, a full buffer): the worker's next heartbeat asks again."""
    payload, _ = encode(plan)
    try:
        sock.sendto(payload, path)
        return True
    except OSError:
        return False


class PlanInbox:
    """The worker's end: binds ``path``, decodes each datagram from its launcher and
    calls ``on_plan``. Runs on the agent's event loop; never blocks it."""

    def __init__(
        self, path: str, on_plan: Callable[[NodePlan], None], launcher_pid: int | None = None
    ) -> None:
        self.path = Path(path)
        self.on_plan = on_plan
        self.launcher_pid = os.getppid() if launcher_pid is None else launcher_pid
        self.received = 0
        self.refused = 0
        self._sock: socket.socket | None = None

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # left by an earlier incarnation of this worker
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.setblocking(False)
        sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._drain)

    def stop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _drain(self) -> None:
        sock = self._sock
        while sock is not None:
            try:
                data, anc, _, _ = sock.recvmsg(MAX_DATAGRAM + 1, socket.CMSG_SPACE(_CREDS.size))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self._take(data, _sender(anc))

    def _take(self, data: bytes, sender: int | None) -> None:
        if sender != self.launcher_pid or len(data) > MAX_DATAGRAM:
            self.refused += 1  # not our launcher, or too big to be a node's part
            return
        try:
            plan = decode(data, _HEADERS, NodePlan)
        except DecodeError:
            self.refused += 1
            return
        self.received += 1
        self.on_plan(plan)


def _sender(ancdata: list[tuple[int, int, bytes]]) -> int | None:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDS.size:
            return int(_CREDS.unpack_from(data)[0])
    return None

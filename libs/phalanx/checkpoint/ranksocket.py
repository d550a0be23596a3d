"""The keeper's Unix socket for the ranks of its node (``<shm_root>/<node>/keeper.sock``):
``list``, ``load``, ``register`` (a DCP directory: a rank's part, or with ``parts``
and ``files`` the set that ties the parts) and ``skipped``, one request a connection.
Every job's ranks connect; ``SO_PEERCRED`` says which job a caller may speak for."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from pathlib import Path
from typing import Any

import phalanx.checkpoint.wire as wire
from phalanx.checkpoint.intake import Intake
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.manifest import ManifestError
from phalanx.checkpoint.record import Recorder
from phalanx.checkpoint.restore import Restorer


class RankSocket:
    def __init__(
        self, cfg: KeeperConfig, intake: Intake, restorer: Restorer, rec: Recorder, log: Any
    ) -> None:
        self.cfg, self.intake, self.restorer, self.rec, self.log = cfg, intake, restorer, rec, log
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.cfg.socket_path.unlink()
        self._server = await asyncio.start_unix_server(
            self._serve, str(self.cfg.socket_path), limit=wire.PIECE
        )
        os.chmod(self.cfg.socket_path, 0o666)  # every job's ranks connect; SO_PEERCRED says who

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.cfg.socket_path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            req = await wire.read_frame(reader, timeout_s=self.cfg.io_timeout_s)
            op, job = req.get("op"), req.get("job")
            if not isinstance(job, str) or not job:
                raise wire.WireError("a request needs its job")
            try:
                self._check_caller(writer, job)  # a process speaks for its own job only
            except PermissionError as exc:
                self.log.error("caller_refused", op=str(op)[:32], job=job[:64], error=str(exc))
                raise
            if op == "list":
                reply = {"ok": True, "checkpoints": await self.restorer.checkpoints(job)}
            elif op == "load":
                step = req.get("step")
                if step is not None and type(step) is not int:
                    raise wire.WireError("step must be an int or absent")
                reply = await self.restorer.load(job, step)
            elif op == "register":
                step, directory = req.get("step"), req.get("dir")
                if type(step) is not int or step < 0 or not isinstance(directory, str):
                    raise wire.WireError("register needs a step (int >= 0) and a dir")
                parts, files = _names(req, "parts"), _names(req, "files")
                try:
                    m = await self.intake.register_directory(
                        job, step, Path(directory), parts=parts, files=files
                    )
                except (OSError, ManifestError) as exc:
                    self.log.error("register_refused", job=job, step=step, dir=directory, error=str(exc))
                    raise
                reply = {"ok": True, "manifest": m.encode()}
            elif op == "skipped":
                step, reason = req.get("step"), req.get("reason")
                if type(step) is not int or step < 0 or not isinstance(reason, str):
                    raise wire.WireError("skipped needs a step (int >= 0) and a reason")
                await self.rec.skipped(job, step, f"{req.get('worker')!s:.64}: {reason:.400}")
                reply = {"ok": True}
            else:
                raise wire.WireError(f"unknown op {op!r}")
        except (wire.WireError, ManifestError, OSError, ValueError, TimeoutError) as exc:
            reply = {"ok": False, "error": str(exc)[:1000]}
        try:
            await wire.write_frame(writer, reply)
        finally:
            writer.close()

    def _check_caller(self, writer: asyncio.StreamWriter, job: str) -> None:
        """PermissionError unless the process at the other end of this Unix socket
        (``SO_PEERCRED``) runs as ``job``'s uid (or as root)."""
        sock = writer.get_extra_info("socket")
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        want = self.cfg.job_uid(job)
        if uid not in (0, want):
            raise PermissionError(f"pid {pid} runs as uid {uid}, not as job {job!r}'s uid {want}")


def _names(req: dict[str, Any], key: str) -> list[str] | None:
    """``req[key]``: absent (None) or a list of strings (a set's parts, or its files)."""
    value = req.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise wire.WireError(f"{key} must be a list of strings")
    return value

"""The keeper's Unix socket for the ranks of its node (``<shm_root>/<node>/keeper.sock``):
``list``, ``load``, ``register`` (a DCP directory: a rank's part, or with ``parts``
and ``files`` the set that ties the parts) and ``skipped``, one request a connection.
Every job's ranks connect; ``SO_PEERCRED`` says which job a caller may speak for.

Bounded before it trusts: at accept, before a byte is read, the caller's uid must be
one that may ask for anything (:attr:`KeeperConfig.rank_uids`) and within the
connections allowed per uid and in total; a request is at most
:attr:`KeeperConfig.max_request_bytes`. A refusal is answered with its reason,
counted (``rank_refused``) and logged, a few lines per cause and period."""

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
from phalanx.limits import ConnectionLimits, ThrottledLog


class RankSocket:
    def __init__(
        self, cfg: KeeperConfig, intake: Intake, restorer: Restorer, rec: Recorder, log: Any
    ) -> None:
        self.cfg, self.intake, self.restorer, self.rec, self.log = cfg, intake, restorer, rec, log
        self.limits = ConnectionLimits(cfg.rank_max_connections, cfg.rank_max_connections_per_uid)
        self._refusals = ThrottledLog(log)
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
        """One rank's connection: its caller checked and counted before anything is read."""
        pid, uid = _peer(writer)
        refused = self._admit(pid, uid)
        if refused:
            await self._answer(writer, {"ok": False, "error": refused})
            return
        try:
            reply = await self._request(reader, writer)
        finally:
            self.limits.close(uid)
        await self._answer(writer, reply)

    def _admit(self, pid: int, uid: int) -> str:
        """Why the caller ``pid`` (running as ``uid``) may not be served now; "" if it may
        (then it is counted in :attr:`limits`)."""
        if uid not in self.cfg.rank_uids:
            why = (
                f"pid {pid} runs as uid {uid}, which no job on this node runs as"
                " (PHALANX_CKPT_JOB_UIDS): refused"
            )
        else:
            why = self.limits.open(uid)
            if why:
                why = f"uid {uid}: {why} (PHALANX_KEEPER_RANK_MAX_CONNECTIONS, _PER_UID): refused"
        if why:
            self.rec.counters["rank_refused"] = self.rec.counters.get("rank_refused", 0) + 1
            self._refusals.warning("caller_refused", uid, pid=pid, uid=uid, error=why)
        return why

    async def _request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> dict[str, Any]:
        """Read one request (at most :attr:`KeeperConfig.max_request_bytes`) and carry it out:
        the reply, ``ok`` or the reason it was refused."""
        try:
            req = await wire.read_frame(
                reader, timeout_s=self.cfg.io_timeout_s, max_bytes=self.cfg.max_request_bytes
            )
            op, job = req.get("op"), req.get("job")
            if not isinstance(job, str) or not job:
                raise wire.WireError("a request needs its job")
            try:
                self._check_caller(writer, job)  # a process speaks for its own job only
            except PermissionError as exc:
                self.log.error("caller_refused", op=str(op)[:32], job=job[:64], error=str(exc))
                raise
            if op == "list":
                return {"ok": True, "checkpoints": await self.restorer.checkpoints(job)}
            if op == "load":
                step = req.get("step")
                if step is not None and type(step) is not int:
                    raise wire.WireError("step must be an int or absent")
                return await self.restorer.load(job, step)
            if op == "register":
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
                return {"ok": True, "manifest": m.encode()}
            if op == "skipped":
                step, reason = req.get("step"), req.get("reason")
                if type(step) is not int or step < 0 or not isinstance(reason, str):
                    raise wire.WireError("skipped needs a step (int >= 0) and a reason")
                await self.rec.skipped(job, step, f"{req.get('worker')!s:.64}: {reason:.400}")
                return {"ok": True}
            raise wire.WireError(f"unknown op {op!r}")
        except wire.FrameTooLarge as exc:
            self.rec.counters["rank_refused"] = self.rec.counters.get("rank_refused", 0) + 1
            why = f"{exc} (the keeper's PHALANX_KEEPER_MAX_REQUEST_BYTES): refused"
            self._refusals.warning("request_refused", "too large", error=why)
            return {"ok": False, "error": why}
        except (wire.WireError, ManifestError, OSError, ValueError, TimeoutError) as exc:
            return {"ok": False, "error": str(exc)[:1000]}

    async def _answer(self, writer: asyncio.StreamWriter, reply: dict[str, Any]) -> None:
        """Send ``reply`` and close; a caller that went away meanwhile is only counted."""
        try:
            await wire.write_frame(writer, reply, self.cfg.io_timeout_s)
        except (ConnectionError, TimeoutError):
            self.rec.counters["rank_dropped"] = self.rec.counters.get("rank_dropped", 0) + 1
        finally:
            writer.close()

    def _check_caller(self, writer: asyncio.StreamWriter, job: str) -> None:
        """PermissionError unless the process at the other end of this Unix socket
        (``SO_PEERCRED``) runs as ``job``'s uid (or as root)."""
        pid, uid = _peer(writer)
        want = self.cfg.job_uid(job)
        if uid not in (0, want):
            raise PermissionError(f"pid {pid} runs as uid {uid}, not as job {job!r}'s uid {want}")


def _peer(writer: asyncio.StreamWriter) -> tuple[int, int]:
    """The pid and uid of the process at the other end of this Unix socket (``SO_PEERCRED``:
    the kernel's, as of its connect)."""
    sock = writer.get_extra_info("socket")
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def _names(req: dict[str, Any], key: str) -> list[str] | None:
    """``req[key]``: absent (None) or a list of strings (a set's parts, or its files)."""
    value = req.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise wire.WireError(f"{key} must be a list of strings")
    return value

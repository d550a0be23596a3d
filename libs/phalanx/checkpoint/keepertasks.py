"""The keeper's background tasks: each one logged if it fails, all cancelled on stop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any


class KeeperTasks:
    """Every task a keeper spawns (takes, replications, drains, retries, peer connections)."""

    def __init__(self, log: Any, node: str) -> None:
        self.log, self.node = log, node
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._log_failure)
        return task

    def _log_failure(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.log.error("keeper_task_failed", task=task.get_name(), error=repr(task.exception()))

    async def idle(self, timeout_s: float) -> None:
        """Wait until no take, replication or drain is in flight (peer connections and
        retries waiting for their turn do not count)."""
        deadline = time.monotonic() + timeout_s
        while any(
            not t.done()
            for t in self._tasks
            if t.get_name() != "keeper-peer" and not t.get_name().startswith("keeper-retry")
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"keeper {self.node} still busy after {timeout_s}s")
            await asyncio.sleep(0.02)

    async def cancel(self) -> None:
        pending = [t for t in self._tasks if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

"""What the parts of the bus need of it (:class:`Core`): the connection, its log, its tasks.

:class:`~phalanx.bus.Bus` is composed of parts (consumers, stream reads, KV buckets, the
refused-input reporter), each in a module of its own and each handed the bus it belongs to.
They see it through this protocol, so none of them imports the module of the class that
composes them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

from nats.aio.client import Client
from nats.js import JetStreamContext

from phalanx.bus.outage import Outage
from phalanx.contract import DecodeError, Message
from phalanx.contract.subjects import Subject


class Core(Protocol):
    """A bus as its parts see it (:class:`phalanx.bus.Bus` is one)."""

    name: str
    user: str | None  # the NATS user it logged in as (None: no authorization)
    log: Any
    nc: Client
    js: JetStreamContext
    reconnects: int
    outage: Outage
    ERROR_EVENTS_PER_S: float
    ERROR_EVENTS_BURST: int
    ERROR_EVENTS_IN_FLIGHT: int

    @property
    def closing(self) -> bool: ...

    def spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]: ...

    async def publish(
        self,
        subject: Subject,
        msg: Message,
        *,
        msg_id: str | None = None,
        retry_for_s: float = 30.0,
        traced: bool = True,
        **tokens: str,
    ) -> None: ...

    async def report_bad_input(self, subject: str, err: DecodeError) -> None: ...

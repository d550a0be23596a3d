"""Base class and registry of every message that crosses the bus.

Each concrete message has a stable ``KIND`` (the wire tag) and a ``SCHEMA_VERSION``.
Both travel in message headers so a receiver can refuse a message it does not
understand before it looks at the payload.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field

M = TypeVar("M", bound="Message")

_REGISTRY: dict[str, type[Message]] = {}


def now() -> float:
    """Wall-clock seconds since the epoch; every timestamp on the wire uses it."""
    return time.time()


class Message(BaseModel):
    """A bus message: a frozen pydantic model that rejects unknown fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    KIND: ClassVar[str] = ""
    SCHEMA_VERSION: ClassVar[int] = 1
    COMPRESSED: ClassVar[bool] = False
    """Sent as zlib-compressed msgpack (``Phalanx-Encoding: msgpack+zlib``): the plan and
    the job record, whose runs of similar names shrink several times more."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("KIND")
        if kind:
            if kind in _REGISTRY and _REGISTRY[kind] is not cls:
                raise TypeError(f"message kind {kind!r} registered twice")
            _REGISTRY[kind] = cls


class JobMessage(Message):
    """A message that belongs to one training job."""

    job: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    ts: float = Field(default_factory=now, description="Wall-clock time the sender made it.")


def registry() -> dict[str, type[Message]]:
    """Every registered message class by kind."""
    return dict(_REGISTRY)


def message_class(kind: str) -> type[Message] | None:
    return _REGISTRY.get(kind)

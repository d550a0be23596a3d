"""How a settings model is read: the common base, the cache, and the one-line refusal.

Every model reads ``PHALANX_<FIELD>`` (an empty variable counts as unset) unless a field
names its variable itself (``validation_alias``): a field whose name carries a unit the
variable lacks (``heartbeat_interval_ms`` reads ``PHALANX_HEARTBEAT_MS``), and
``NATS_URL``, spelled as the NATS tools spell it.

Models are cached per model and per value of the process's ``PHALANX_*``/``NATS_URL``
variables: a process that changes its own environment (the local stack logging
in-process services in as their roles, tests with ``monkeypatch.setenv``) reads the
new values.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from typing import TypeVar, cast

from pydantic import AliasChoices, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict


class SettingsError(ValueError):
    """One or more ``PHALANX_*`` variables are malformed; the message names each."""


class PhalanxSettings(BaseSettings):
    """The base of every settings model: ``PHALANX_`` prefix, frozen, unknown variables ignored.

    Fields may also be given by name (``DetectorSettings(heartbeat_interval_ms=50)``), as
    tests do; a process reads its model with :func:`load` or :func:`load_or_exit`.
    """

    model_config = SettingsConfigDict(
        env_prefix="PHALANX_",
        extra="ignore",
        frozen=True,
        env_ignore_empty=True,
        validate_by_name=True,
        validate_by_alias=True,
    )


S = TypeVar("S", bound=PhalanxSettings)


def env_name(field: str, model: type[PhalanxSettings] | None = None) -> str:
    """The environment variable of ``field`` (of ``model``, whose field may name its own).

    >>> from phalanx.settings import DetectorSettings
    >>> env_name("heartbeat_interval_ms", DetectorSettings), env_name("detector_phi")
    ('PHALANX_HEARTBEAT_MS', 'PHALANX_DETECTOR_PHI')
    """
    if field == "NATS_URL" or field.startswith("PHALANX_"):
        return field  # already a variable (a validation error's location)
    info = model.model_fields.get(field) if model is not None else None
    alias = info.validation_alias if info is not None else None
    if isinstance(alias, str):
        return alias
    if isinstance(alias, AliasChoices):  # the first is the preferred spelling
        first = alias.choices[0]
        return first if isinstance(first, str) else str(first)
    return f"PHALANX_{field.upper()}"


def _explain(model: type[PhalanxSettings], exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else "?"
        lines.append(f"{env_name(field, model)}={err.get('input')!r}: {err['msg']}")
    return "bad setting: " + "; ".join(lines)


def _ours(name: str) -> bool:
    upper = name.upper()
    return upper.startswith("PHALANX_") or upper == "NATS_URL"


def load(model: type[S]) -> S:
    """``model`` read from this process's environment; :class:`SettingsError` naming each
    bad variable at once."""
    environ = tuple(sorted((k, v) for k, v in os.environ.items() if _ours(k)))
    return cast(S, _load(model, environ))


@lru_cache(maxsize=64)
def _load(model: type[PhalanxSettings], environ: tuple[tuple[str, str], ...]) -> PhalanxSettings:
    """``environ`` is the cache key only: the model reads the same from os.environ."""
    try:
        return model()
    except ValidationError as exc:
        raise SettingsError(_explain(model, exc)) from None


def load_or_exit(model: type[S], program: str) -> S:
    """:func:`load` for an entry point: on a bad setting, print
    ``<program>: bad setting: PHALANX_X='-1': ...`` (one line) to stderr and exit with status 2."""
    try:
        return load(model)
    except SettingsError as exc:
        print(f"{program}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

"""Is a NATS server there at all? Answered within seconds.

nats.py retries a first connection forever when reconnects are unbounded (as
:meth:`phalanx.bus.Bus.connect` asks, so that a running service rides out a server
restart), which made ``phalanx run`` against a dead address wait silently until
killed. A NATS server greets every TCP client with an ``INFO {...}`` line before
anything else (TLS or not), so reading that line tells "nothing listens" and
"something that is not NATS" apart from a server, without credentials.

>>> await probe("nats://127.0.0.1:4222")
'127.0.0.1:4222'
>>> await probe("nats://127.0.0.1:1")
Unreachable: no NATS server at 127.0.0.1:1 (connection refused)
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit


class Unreachable(ConnectionError):
    """No server of the URL answered as a NATS server would."""


def _addresses(url: str) -> list[tuple[str, int]]:
    out = []
    for part in url.split(","):
        u = urlsplit(part.strip() if "://" in part else f"nats://{part.strip()}")
        out.append((u.hostname or "127.0.0.1", u.port or 4222))
    return out


async def _greeting(host: str, port: int, timeout_s: float) -> None:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    try:
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    if not line.startswith(b"INFO "):
        raise Unreachable(f"{host}:{port} answers, but not as a NATS server ({line[:40]!r})")


async def probe(url: str, timeout_s: float = 3.0) -> str:
    """The first ``host:port`` of ``url`` (comma-separated servers) where a NATS server
    greets within ``timeout_s``; :class:`Unreachable` naming why each failed otherwise."""
    why = []
    for host, port in _addresses(url):
        try:
            await _greeting(host, port, timeout_s)
            return f"{host}:{port}"
        except Unreachable as exc:
            why.append(str(exc))
        except TimeoutError:
            why.append(f"{host}:{port}: no answer within {timeout_s:g} s")
        except ConnectionRefusedError:
            why.append(f"{host}:{port}: connection refused")
        except OSError as exc:
            why.append(f"{host}:{port}: {exc.strerror or exc}")
    raise Unreachable("no NATS server at " + "; ".join(why))

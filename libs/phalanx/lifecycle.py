"""Stop what a process started when the process itself is stopped.

Python runs ``finally`` blocks and ``__exit__`` on Ctrl-C (KeyboardInterrupt) but
not on SIGTERM, which kills it outright: a benchmark under ``timeout 60`` used to
leave its nats-server running (servers run in their own session, so the signal
does not reach them either). :func:`exit_on_sigterm` turns SIGTERM into
``SystemExit(143)`` in the main thread, so the same cleanup runs as for Ctrl-C.
Whatever starts servers or services calls it (:class:`phalanx.devstack.natsserver.NatsServer`,
:class:`phalanx.devstack.localstack.LocalStack`, :class:`phalanx.devstack.s3server.S3Server`,
``phalanx up``).

It only replaces the default action: a handler someone installed (an asyncio
loop's, a service's drain) is left alone.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

SIGTERM_EXIT = 128 + signal.SIGTERM


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> bool:
    """SIGTERM raises ``SystemExit(143)`` in the main thread from now on, if it would
    otherwise kill the process; True when installed (or already installed)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGTERM)
    if current is _raise_exit:
        return True
    if current not in (signal.SIG_DFL, None):
        return False
    signal.signal(signal.SIGTERM, _raise_exit)
    return True


def exit_watchdog(after_s: float, code: Callable[[], int], what: str) -> threading.Timer:
    """Make sure this process ends: ``after_s`` seconds from now, if it still runs, write
    every thread's stack to stderr (the log says what was stuck) and ``os._exit(code())``.

    For the end of a process whose shutdown waits on others (child processes, a server's
    drain, a tracing exporter, executor threads that ``asyncio.run`` joins without a
    bound): one of them stuck must not keep it alive, nor whoever waits for it. The
    timer's thread is a daemon: a process that ends in time never hears of it.
    """

    def fire() -> None:
        sys.stderr.write(f"{what}: still running {after_s:g} s after it should end; every thread's stack:\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(code())

    timer = threading.Timer(after_s, fire)
    timer.daemon = True
    timer.start()
    return timer

"""Stillness: a thread that stays in one place with no I/O stands still; one that moves
through frames, or a process that reads or writes, does not."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from phalanx.worker.stillness import Stillness


@contextmanager
def running(body: Callable[[list[bool]], object]) -> Iterator[threading.Thread]:
    """``body(stop)`` on a thread until the block ends (``stop[0]`` set)."""
    stop = [False]
    t = threading.Thread(target=body, args=(stop,), daemon=True)
    t.start()
    time.sleep(0.05)
    try:
        yield t
    finally:
        stop[0] = True
        t.join(5)


def samples(still: Stillness, n: int = 8, every_s: float = 0.05) -> list[float | None]:
    out = []
    for _ in range(n):
        out.append(still.sample())
        time.sleep(every_s)
    return out


def spin(stop: list[bool]) -> None:
    while not stop[0]:  # one line, one frame: a livelock
        pass


def blocked(stop: list[bool]) -> None:
    ev = threading.Event()
    while not stop[0]:
        ev.wait(0.5)  # a native wait: the same frame for half a second at a time


def _a(n: int) -> int:
    return sum(range(n))


def _b(n: int) -> int:
    return len([i for i in range(n)])


def busy_moving(stop: list[bool]) -> None:
    while not stop[0]:  # calls in and out of other frames, as a pass over a model does
        _a(2000)
        _b(2000)


def test_a_thread_spinning_on_one_line_stands_still_from_its_first_sample(quiet: int) -> None:
    with running(spin) as t:
        still = Stillness(t, io_root=quiet)
        got = samples(still)
    # the first sample has no stack to compare with, the second no I/O counters (they
    # are read only while the stack stays): still from the third on, timed from the second
    assert got[:2] == [None, None], got
    assert all(s is not None for s in got[2:]), got
    assert len(set(got[2:])) == 1, "the streak is timed from where it began"


def test_a_thread_blocked_in_a_native_wait_stands_still(quiet: int) -> None:
    with running(blocked) as t:
        got = samples(Stillness(t, io_root=quiet), n=6)
    assert sum(s is not None for s in got[1:]) >= 3, got


def test_a_thread_moving_through_frames_does_not(quiet: int) -> None:
    with running(busy_moving) as t:
        got = samples(Stillness(t, io_root=quiet), n=12)
    assert sum(s is None for s in got) >= 6, got


def _layer() -> None:
    time.sleep(0.02)  # a native op: every call stops on this same line


def layer_after_layer(stop: list[bool]) -> None:
    while not stop[0]:
        _layer()


def test_calls_at_the_same_code_and_line_move_each_a_new_frame(quiet: int) -> None:
    # an evaluation pass: Linear.forward, layer after layer, batch after batch (sampled
    # by code and line alone, such a pass stood still and was judged hung in a soak)
    with running(layer_after_layer) as t:
        got = samples(Stillness(t, io_root=quiet), n=12)
    assert all(s is None for s in got), got


def test_io_by_the_process_counts_as_moving(tmp_path: Path) -> None:
    def write(stop: list[bool]) -> None:
        with open(tmp_path / "out", "wb") as f:
            while not stop[0]:
                f.write(b"x" * 4096)
                f.flush()
                time.sleep(0.01)

    with running(spin) as spinner, running(write):
        got = samples(Stillness(spinner))
    assert all(s is None for s in got), got


def test_io_by_a_child_process_counts_as_moving(tmp_path: Path) -> None:
    # rank 0 waiting on an upload or an evaluation it runs as a child process
    writer = (
        "import sys, time\n"
        "with open(sys.argv[1], 'wb') as f:\n"
        "    while True:\n"
        "        f.write(b'x' * 4096); f.flush(); time.sleep(0.01)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", writer, str(tmp_path / "out")])
    try:
        time.sleep(0.3)
        with running(blocked) as waiter:
            got = samples(Stillness(waiter))
    finally:
        child.kill()
        child.wait()
    assert all(s is None for s in got), got


def test_reset_starts_a_new_streak(quiet: int) -> None:
    with running(spin) as t:
        still = Stillness(t, io_root=quiet)
        first = samples(still, n=3)[-1]
        still.reset()
        assert still.sample() is None and still.sample() is None
        time.sleep(0.05)
        again = still.sample()
    assert first is not None and again is not None and again > first

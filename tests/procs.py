"""Processes a test started, from /proc: what is left running after a stop."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> dict[int, bytes]:
    """pid -> command line of every descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes()
        except OSError:
            continue
    out: dict[int, bytes] = {}
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        for c, pp in parents.items():
            if pp == p:
                out[c] = cmdlines.get(c, b"")
                frontier.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"

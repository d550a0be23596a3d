"""Compact wire forms of the long lists in a plan and the job record.

A 16,384-rank job names 18,000 workers (``node0417-w3``). Spelled out one per
entry, its membership, its planner's books and its batch split are megabytes;
nearly all of it is runs: consecutive names of one node, ranks that follow each
other, equal shard sizes. On the wire those lists travel as runs, in memory they
stay plain lists and dicts, so no code that reads a plan changes:

- names: ``[prefix, first, count]`` stands for ``prefix<first> .. prefix<first+count-1>``;
  a name that does not end in digits is ``[name, -1, 1]``:

  >>> to_runs(["n1-w0", "n1-w1", "n1-w2", "n2-w0", "solo"])
  [['n1-w', 0, 3], ['n2-w', 0, 1], ['solo', -1, 1]]
  >>> from_runs([['n1-w', 0, 2]])
  ['n1-w0', 'n1-w1']

- a worker -> node map: ``[node, prefix, first, count]`` per run of one node's names;
- integers: ``[value, count]`` (run-length).

Readers accept the spelled-out form as well. A run may not expand past
:data:`MAX_EXPANDED` entries in all: a few bytes on the wire must never become
gigabytes in a receiver (:func:`from_runs` raises ``ValueError``, which pydantic
reports as a validation error, so a bad payload is refused like any other).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

MAX_EXPANDED = 1 << 21  # 2M entries: past any job Phalanx plans (the planner's own limit is far lower)

_DIGITS = "0123456789"
_NAME_RUN_SCHEMA = {
    "type": "array",
    "description": "runs of names: [prefix, first, count] = prefix<first>..prefix<first+count-1>"
    " ([name, -1, 1] for a name without a trailing number); the spelled-out list is also read",
    "items": {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": ["string", "integer"]}, "minItems": 3, "maxItems": 3},
        ]
    },
}
_INT_RUN_SCHEMA = {
    "type": "array",
    "description": "run-length integers: [value, count]; the spelled-out list is also read",
    "items": {
        "anyOf": [
            {"type": "integer"},
            {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
        ]
    },
}
_NODE_RUN_SCHEMA = {
    "type": "array",
    "description": "worker -> node as runs: [node, prefix, first, count] (a mapping is also read)",
    "items": {"type": "array", "items": {"type": ["string", "integer"]}, "minItems": 4, "maxItems": 4},
}


def split_name(name: str) -> tuple[str, int]:
    """``(prefix, number)`` of a name ending in a number, else ``(name, -1)``: ``n1-w3`` -> ``(n1-w, 3)``."""
    prefix = name.rstrip(_DIGITS)
    digits = name[len(prefix) :]
    if not digits or (len(digits) > 1 and digits[0] == "0") or not digits.isascii():
        return name, -1  # no trailing number, or one with a leading zero (not re-spellable)
    return prefix, int(digits)


def to_runs(names: Iterable[str]) -> list[list[Any]]:
    """``names`` (order kept) as runs of consecutive numbers under one prefix.

    A name equal to the one that would extend the last run is taken without splitting it
    (it is ``prefix + str(first + count)``, so :func:`split_name` would give just that):
    the planner encodes its record on every transaction, and most names continue a run.
    """
    runs: list[list[Any]] = []
    expect = None  # the name that extends the last run
    for name in names:
        if name == expect:
            last = runs[-1]
            last[2] += 1
            expect = f"{last[0]}{last[1] + last[2]}"
            continue
        prefix, n = split_name(name)
        if n >= 0 and runs:
            last = runs[-1]
            if last[0] == prefix and last[1] >= 0 and last[1] + last[2] == n:
                last[2] += 1
                expect = f"{prefix}{n + 1}"
                continue
        runs.append([prefix, n, 1])
        expect = f"{prefix}{n + 1}" if n >= 0 else None
    return runs


def _check_run(run: Any, width: int) -> None:
    if not isinstance(run, list | tuple) or len(run) != width:
        raise ValueError(f"a run is a list of {width} items, got {run!r:.80}")


def from_runs(runs: Iterable[Any], budget: list[int] | None = None) -> list[str]:
    """The names ``runs`` stand for; plain strings among them are taken as they are."""
    budget = budget if budget is not None else [MAX_EXPANDED]
    out: list[str] = []
    for run in runs:
        if isinstance(run, str):
            out.append(run)
            budget[0] -= 1
        else:
            _check_run(run, 3)
            prefix, first, count = run
            if not isinstance(prefix, str) or not isinstance(first, int) or not isinstance(count, int):
                raise ValueError(f"a name run is [str, int, int], got {run!r:.80}")
            if first == -1 and count == 1:
                out.append(prefix)
            elif first < 0 or count < 1:
                raise ValueError(f"a name run needs first >= 0 and count >= 1, got {run!r:.80}")
            else:
                budget[0] -= count
                if budget[0] < 0:
                    break
                out.extend(f"{prefix}{first + i}" for i in range(count))
        if budget[0] < 0:
            break
    if budget[0] < 0:
        raise ValueError(f"runs expand past {MAX_EXPANDED} entries")
    return out


def _names_in(value: Any) -> Any:
    if isinstance(value, list | tuple) and any(not isinstance(v, str) for v in value):
        return from_runs(value)
    return value


def _names_out(value: Iterable[str]) -> list[list[Any]]:
    return to_runs(sorted(value) if isinstance(value, set | frozenset) else value)


def int_runs(values: Iterable[int]) -> list[list[int]]:
    """Run-length ``values``: ``[[value, count], ...]``."""
    return [[v, sum(1 for _ in group)] for v, group in itertools.groupby(values)]


def _ints_in(value: Any) -> Any:
    if not isinstance(value, list | tuple) or all(isinstance(v, int) for v in value):
        return value
    out: list[int] = []
    for run in value:
        if isinstance(run, int):
            out.append(run)
            continue
        _check_run(run, 2)
        v, count = run
        if not isinstance(v, int) or not isinstance(count, int) or count < 1:
            raise ValueError(f"an integer run is [value, count >= 1], got {run!r:.80}")
        if len(out) + count > MAX_EXPANDED:
            raise ValueError(f"runs expand past {MAX_EXPANDED} entries")
        out.extend([v] * count)
    return out


def node_runs(nodes: Mapping[str, str]) -> list[list[Any]]:
    """A worker -> node map as ``[node, prefix, first, count]`` runs (insertion order kept):
    the :func:`to_runs` of each stretch of consecutive workers on one node."""
    return [
        [node, *run]
        for node, stretch in itertools.groupby(nodes.items(), key=lambda item: item[1])
        for run in to_runs(worker for worker, _ in stretch)
    ]


def _nodes_in(value: Any) -> Any:
    if not isinstance(value, list | tuple):
        return value
    out: dict[str, str] = {}
    budget = [MAX_EXPANDED]
    for run in value:
        _check_run(run, 4)
        if not isinstance(run[0], str):
            raise ValueError(f"a node run is [node, prefix, first, count], got {run!r:.80}")
        for worker in from_runs([run[1:]], budget):
            out[worker] = run[0]
    return out


Names = Annotated[
    list[str],
    BeforeValidator(_names_in),
    PlainSerializer(_names_out, when_used="json"),
    WithJsonSchema(_NAME_RUN_SCHEMA),
]
"""A list of worker names, as runs on the wire."""

NameSet = Annotated[
    set[str],
    BeforeValidator(_names_in),
    PlainSerializer(_names_out, when_used="json"),
    WithJsonSchema(_NAME_RUN_SCHEMA),
]
"""A set of worker names, as runs (of the sorted names) on the wire."""

Ints = Annotated[
    list[int],
    BeforeValidator(_ints_in),
    PlainSerializer(int_runs, when_used="json"),
    WithJsonSchema(_INT_RUN_SCHEMA),
]
"""A list of integers, run-length on the wire."""

NodeMap = Annotated[
    dict[str, str],
    BeforeValidator(_nodes_in),
    PlainSerializer(node_runs, when_used="json"),
    WithJsonSchema(_NODE_RUN_SCHEMA),
]
"""worker -> node, as runs of one node's consecutive names on the wire."""

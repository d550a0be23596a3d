"""Where a sharded job's ranks go: pure functions of the nodes and the group size.

A sharded model (``elastic.group_size`` G > 1, FSDP2/HSDP) survives the loss of
a rank only while another replica group holds the same shard: rank ``r`` holds
shard ``r % G``. So the planner lays a replica group's G ranks on one node where
it can (sharding stays inside a node, as HSDP is normally laid out) and puts
consecutive groups on different nodes (replication crosses nodes), and it says
which shards have every replica on one node -- losing that node leaves no peer
to recover them from, only a checkpoint.

>>> place([("n0", ["a0", "a1"]), ("n1", ["b0", "b1"])], 2)
['a0', 'a1', 'b0', 'b1']
>>> place([("n0", ["a0", "a1", "a2", "a3"])], 2)
['a0', 'a1', 'a2', 'a3']
>>> lone_shards(['a0', 'a1', 'a2', 'a3'], {"a0": "n0", "a1": "n0", "a2": "n0", "a3": "n0"}, 2)
{0: 'n0', 1: 'n0'}
"""

from __future__ import annotations

from collections.abc import Mapping


def place(nodes: list[tuple[str, list[str]]], group_size: int) -> list[str]:
    """The ranks' workers in rank order: whole groups from one node each, the nodes
    taken in turn; what does not fill a group on one node goes last, in node order.
    With ``group_size`` 1 the order is the nodes' (replicated ranks: nothing to place)."""
    if group_size <= 1:
        return [w for _, workers in nodes for w in workers]
    left = {node: list(workers) for node, workers in nodes}
    order: list[str] = []
    while True:
        progressed = False
        for node, _ in nodes:
            if len(left[node]) >= group_size:
                order += left[node][:group_size]
                left[node] = left[node][group_size:]
                progressed = True
        if not progressed:
            break
    return order + [w for node, _ in nodes for w in left[node]]


def lone_shards(order: list[str], node_of: Mapping[str, str | None], group_size: int) -> dict[int, str]:
    """``{shard: node}`` for every shard all of whose replicas are on one node."""
    if group_size <= 1 or len(order) % group_size:
        return {}
    out: dict[int, str] = {}
    for shard in range(group_size):
        where = {node_of.get(w) for w in order[shard::group_size]}
        if len(where) == 1 and (node := next(iter(where))) is not None:
            out[shard] = node
    return out


def describe(lone: dict[int, str], group_size: int) -> str:
    """The planner's words for :func:`lone_shards` (empty when there is nothing to say)."""
    if not lone:
        return ""
    by_node: dict[str, list[int]] = {}
    for shard, node in sorted(lone.items()):
        by_node.setdefault(node, []).append(shard)
    where = "; ".join(f"shard(s) {shards} only on node {node}" for node, shards in by_node.items())
    return (
        f"placement: {where} (replica groups of {group_size}): losing such a node leaves no replica"
        " to recover from, the job resumes from its newest checkpoint"
    )

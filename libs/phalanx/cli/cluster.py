"""``phalanx cluster``: drive the local cluster that scheduler-signal watches.

``offer`` and ``reclaim`` change the cluster's record in the ``phalanx_cluster``
bucket (compare-and-set, see :mod:`phalanx.cluster`); scheduler-signal turns the
change into ``CapacityChanged`` / ``PreemptionNotice`` for the planner. Needs the
``admin`` NATS role when authorization is on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import click

from phalanx.cli._common import Failed, console, server_url, use_local_login

F = TypeVar("F", bound=Callable[..., object])


def _cluster_option(f: F) -> F:
    return click.option(
        "--cluster",
        default="local",
        show_default=True,
        help="The cluster's name: its key in the phalanx_cluster bucket.",
    )(f)  # type: ignore[return-value]


def _quiet() -> None:
    from phalanx.telemetry import setup_logging

    setup_logging("phalanx-cluster", level="CRITICAL")  # the one-line error says it all


@click.group("cluster")
def cluster_group() -> None:
    """Drive the local cluster: offer worker slots on a node, reclaim a node, show it."""
    use_local_login(server_url(), "admin")  # the cluster's record is admin's to write


@cluster_group.command("offer", context_settings={"ignore_unknown_options": True})  # N may read "-3"
@click.argument("slots", type=int, metavar="N")
@click.option("--node", required=True, help="The node offering them (its launcher's --node-id).")
@_cluster_option
def offer(slots: int, node: str, cluster: str) -> int:
    """Offer N (>= 1) more worker slots on a node, beyond what its launchers run."""
    from phalanx import cluster as local

    _quiet()
    try:
        rec = asyncio.run(local.offer(slots, node, cluster=cluster))
    except local.BadInput as exc:
        raise Failed(str(exc)) from None
    except local.ClusterError as exc:
        raise Failed(str(exc), code=1) from None
    found = rec.state.node(node)
    console.print(
        f"cluster {cluster}: node {node} offers {found.slots if found else 0} slot(s) "
        f"(+{slots}), {rec.state.available_slots} in all (revision {rec.revision})"
    )
    return 0


@cluster_group.command("reclaim")
@click.argument("node")
@click.option(
    "--grace",
    default="30s",
    show_default=True,
    help="Time its workers get to leave: 10s, 500ms, 2m or seconds.",
)
@_cluster_option
def reclaim(node: str, grace: str, cluster: str) -> int:
    """Take NODE back: it offers nothing more and its workers must leave within the grace."""
    from phalanx import cluster as local

    _quiet()
    try:
        seconds = local.parse_grace(grace)
        rec = asyncio.run(local.reclaim(node, seconds, cluster=cluster))
    except local.BadInput as exc:
        raise Failed(str(exc)) from None
    except local.ClusterError as exc:
        raise Failed(str(exc), code=1) from None
    notice = rec.preemption.id if rec.preemption else "?"
    console.print(
        f"cluster {cluster}: node {node} reclaimed, its workers must leave within "
        f"{seconds:g} s (preemption {notice}, revision {rec.revision})"
    )
    return 0


@cluster_group.command("show")
@click.option("--json", "as_json", is_flag=True, help="The record as stored (JSON) instead of a table.")
@_cluster_option
def show(as_json: bool, cluster: str) -> int:
    """Print the cluster's nodes, slots and preemptions."""
    from phalanx import cluster as local

    _quiet()
    try:
        rec = asyncio.run(local.read(cluster))
    except local.BadInput as exc:
        raise Failed(str(exc)) from None
    except local.ClusterError as exc:
        raise Failed(str(exc), code=1) from None
    print(rec.state.model_dump_json(indent=2) if as_json else local.describe(rec))
    return 0


COMMANDS = [cluster_group]

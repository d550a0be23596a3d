"""``phalanx ckpt list|show|rm``: a job's tiered checkpoints, as the catalog records them.

``list JOB``: every checkpoint of JOB, newest first, and which tiers hold a complete
copy. ``show JOB [STEP]``: every copy of one checkpoint (the newest without STEP) in
every tier -- state, size, age -- its manifest's kind, origin and files, and the peer
replicas its origin keeper still misses (it retries until they exist). ``rm JOB
STEP``: remove a checkpoint everywhere: its tombstone is written and its manifest
deleted from the catalog at once (nothing lists or loads it any more), then every
keeper removes the copies it holds (:mod:`phalanx.checkpoint.removal`); the command
waits ``--wait`` seconds for them and says what is left. ``--json`` prints the same
for scripts.

Everything is read from the ``phalanx_ckpt`` KV bucket (:mod:`phalanx.checkpoint.catalog`);
nothing here talks to a keeper. Reading needs any role-wide user (``observer`` will
do); ``rm`` writes the bucket, which only ``admin`` may besides the keepers where the
server enforces roles.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import socket
import time
from typing import Any

import click
import nats.errors
from nats.js.errors import NotFoundError
from rich.markup import escape
from rich.table import Table

from phalanx.bus import Bus
from phalanx.checkpoint.catalog import SHARED_NODE, Catalog, Copy, Entry, ReplicasShort, is_job_name
from phalanx.checkpoint.manifest import Manifest, is_part, job_of
from phalanx.checkpoint.tiers import Tier
from phalanx.cli._common import Failed, connect, console, server_url
from phalanx.contract.streams import CKPT_BUCKET

TIERS = tuple(Tier)  # memory, disk, shared, object: fastest first
REQUEST_TIMEOUT_S = 2.0  # each catalog request (a refused write is seen only as no answer)
FILES_SHOWN = 20


def _quiet() -> None:
    from phalanx.telemetry import setup_logging

    setup_logging("phalanx-ckpt", level="CRITICAL")  # the one-line error says it all


def _job(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not is_job_name(value):
        raise click.BadParameter(
            f"{value!r} is not a job name (1-64 of letters, digits, '_', '-'; or a part <job>=r<rank>)"
        )
    return value


def size(n: int) -> str:
    """``n`` bytes for a person.

    >>> size(512), size(3 << 20), size(5 << 30)
    ('512 B', '3.0 MiB', '5.0 GiB')
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def age(seconds: float) -> str:
    """How long ago, for a person.

    >>> age(12), age(300), age(4 * 3600), age(3 * 86400)
    ('12 s', '5 min', '4.0 h', '3.0 d')
    """
    if seconds < 90:
        return f"{max(seconds, 0):.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


# -- reading the catalog --------------------------------------------------------------------
async def _catalog(bus: Bus, url: str) -> Catalog:
    try:
        return await Catalog.open(bus, create=False, timeout_s=REQUEST_TIMEOUT_S)
    except NotFoundError:
        raise Failed(
            f"no checkpoint catalog (bucket {CKPT_BUCKET}) on {url}: no keeper has run there "
            "(checkpoints are kept by the state-replication service, `phalanx up` starts it)"
        ) from None


def _nats_failed(bus: Bus, exc: Exception, writing: bool = False) -> Failed:
    """What to say when the catalog did not answer: a refusal names the admin role."""
    if bus.denied:
        need = (
            f"only the admin role (and the keepers) may write bucket {CKPT_BUCKET}: set "
            "PHALANX_NATS_USER=admin and PHALANX_NATS_PASSWORD"
            if writing
            else "read it as a role-wide user (observer will do)"
        )
        return Failed(f"the NATS server refused {', '.join(sorted(bus.denied))}: {need}", code=1)
    return Failed(f"the checkpoint catalog did not answer ({exc!r})", code=1)


async def _entries(catalog: Catalog, job: str) -> dict[int, Entry]:
    """``job``'s checkpoints: those with a manifest, and those with copies still listed."""
    return {s: e for s, e in (await catalog.entries(job)).items() if e.manifest is not None or e.copies}


def _order(c: Copy) -> tuple[int, str]:
    return TIERS.index(c.tier), c.node


def _summary(e: Entry) -> dict[str, Any]:
    m = e.manifest
    return {
        "step": e.step,
        "kind": m.kind if m else None,
        "origin": m.origin if m else None,
        "created": m.created if m else None,
        "bytes": m.total_bytes if m else None,
        "files": len(m.files) if m else None,
        "tiers": {t.value: sorted(c.node for c in e.complete() if c.tier is t) for t in TIERS},
        "copies": len(e.copies),
        "manifest": m is not None,
        "removed": e.removed is not None,
    }


def _copy(c: Copy, now: float) -> dict[str, Any]:
    return {
        "tier": c.tier.value,
        "node": c.node,
        "state": c.state,
        "bytes": c.bytes,
        "at": c.at,
        "age_s": round(now - c.at, 3) if c.at else None,
        "by": c.by,
        "addr": c.addr,
    }


def _detail(e: Entry, now: float) -> dict[str, Any]:
    m = e.manifest
    return {
        "job": e.job,
        "step": e.step,
        "manifest": None
        if m is None
        else {
            "kind": m.kind,
            "origin": m.origin,
            "created": m.created,
            "bytes": m.total_bytes,
            "files": [{"name": f.name, "size": f.size} for f in m.files],
            "parts": sorted(m.parts),
        },
        "copies": [_copy(c, now) for c in sorted(e.copies, key=_order)],
        "removed": None if e.removed is None else {"at": e.removed.at, "by": e.removed.by},
        "replicas_missing": None if e.replicas is None else _missing(e.replicas, now),
    }


def _missing(r: ReplicasShort, now: float) -> dict[str, Any]:
    return {
        "missing": r.missing,
        "wanted": r.wanted,
        "made": list(r.made),
        "error": r.error,
        "by": r.by,
        "since_s": round(now - r.since, 3) if r.since else None,
    }


def _note(e: Entry) -> str:
    if e.removed is not None and e.manifest is None:
        return f"removed: {len(e.copies)} copies left" if e.copies else "removed"
    if e.manifest is None:
        return "no manifest"
    return f"{e.replicas.missing} replica(s) missing" if e.replicas is not None else ""


# -- the commands ---------------------------------------------------------------------------
async def _read(job: str) -> tuple[str, dict[int, Entry]]:
    """The server's URL and every checkpoint of ``job`` its catalog holds."""
    url = server_url()
    bus = await connect(url, name="phalanx-ckpt", ensure=False)
    try:
        try:
            return url, await _entries(await _catalog(bus, url), job)
        except (nats.errors.Error, TimeoutError) as exc:
            raise _nats_failed(bus, exc) from None
    finally:
        await bus.close()


async def _list(job: str, as_json: bool) -> int:
    url, entries = await _read(job)
    steps = sorted(entries, reverse=True)
    if as_json:
        print(json.dumps({"job": job, "checkpoints": [_summary(entries[s]) for s in steps]}), flush=True)
        return 0
    if not steps:
        console.print(f"no checkpoints of job {job} in the catalog on {url}")
        return 0
    now = time.time()
    notes = {s: _note(entries[s]) for s in steps}
    t = Table(title=f"checkpoints of {job} (newest first)", title_justify="left")
    for col in ("step", "kind", "origin", "size", "age", *(x.value for x in TIERS)):
        wraps = col in (Tier.MEMORY.value, Tier.DISK.value)  # node lists; the rest stays on one line
        t.add_column(col, justify="right" if col in ("step", "size") else "left", no_wrap=not wraps)
    if any(notes.values()):
        t.add_column("note")
    for s in steps:
        e, m = entries[s], entries[s].manifest
        held = _summary(e)["tiers"]
        t.add_row(
            str(s),
            m.kind if m else "-",
            m.origin if m else "-",
            size(m.total_bytes) if m else "-",
            age(now - m.created) if m else "-",
            *(_held(x, held[x.value]) for x in TIERS),
            *([notes[s]] if any(notes.values()) else []),
        )
    console.print(t)
    return 0


def _held(tier: Tier, nodes: list[str]) -> str:
    if not nodes:
        return "-"
    return "yes" if tier in (Tier.SHARED, Tier.OBJECT) else ",".join(nodes)


async def _show(job: str, step: int | None, as_json: bool) -> int:
    url, entries = await _read(job)
    if step is None:
        with_manifest = [s for s, e in entries.items() if e.manifest is not None]
        if not with_manifest:
            raise Failed(f"no checkpoint of job {job!r} in the catalog on {url}")
        step = max(with_manifest)
    e = entries.get(step)
    if e is None:
        raise Failed(
            f"no checkpoint {job}@{step} in the catalog on {url} (`phalanx ckpt list {job}` lists them)"
        )
    now = time.time()
    if as_json:
        print(json.dumps(_detail(e, now)), flush=True)
        return 0
    m = e.manifest
    if m is None:
        head = f"[bold]{job}@{step}[/]  no manifest"
    else:
        head = (
            f"[bold]{job}@{step}[/]  {m.kind}  origin {m.origin}  {m.total_bytes} bytes ({size(m.total_bytes)})"
            f"  created {age(now - m.created)} ago  {len(m.files)} file(s)"
            + (f"  {len(m.parts)} part(s): {', '.join(sorted(m.parts))}" if m.parts else "")
        )
    if e.removed is not None:
        head += f"\nremoved {age(now - e.removed.at)} ago by {e.removed.by or '?'}"
    if e.replicas is not None:
        r = e.replicas
        head += (
            f"\n[yellow]replicas missing: {r.missing} of {r.wanted}[/] (made on: {', '.join(r.made) or 'none'})"
            f" for {age(now - r.since)}, retried with backoff by {r.by or '?'}"
            f" -- last error: {escape(r.error or '?')}"
        )
    console.print(head)
    copies = Table(title="copies", title_justify="left")
    for col in ("tier", "node", "state", "bytes", "size", "age", "written by"):
        copies.add_column(col, justify="right" if col in ("bytes", "size", "age") else "left", no_wrap=True)
    for c in sorted(e.copies, key=_order):
        copies.add_row(
            c.tier.value,
            c.node,
            c.state,
            str(c.bytes),
            size(c.bytes),
            age(now - c.at) if c.at else "-",
            c.by or "-",
        )
    console.print(copies if e.copies else "no copies listed")
    if m is not None:
        files = Table(title="files", title_justify="left")
        for col in ("file", "bytes", "size"):
            files.add_column(col, justify="left" if col == "file" else "right")
        for f in m.files[:FILES_SHOWN]:
            files.add_row(f.name, str(f.size), size(f.size))
        if len(m.files) > FILES_SHOWN:
            files.add_row(f"... {len(m.files) - FILES_SHOWN} more (--json lists them all)", "", "")
        console.print(files)
    return 0


async def _rm(job: str, step: int, wait_s: float, as_json: bool) -> int:
    url = server_url()
    bus = await connect(url, name="phalanx-ckpt", ensure=False)
    try:
        catalog = await _catalog(bus, url)
        try:
            removed, before, left = await _remove(catalog, job, step, wait_s, url)
        except (nats.errors.Error, TimeoutError) as exc:
            raise _nats_failed(bus, exc, writing=True) from None
    finally:
        await bus.close()
    still = {_key(c) for c in left}
    gone = [c for c in before if _key(c) not in still]
    if as_json:
        out = {
            "job": job,
            "step": step,
            "removed": [f"{m.job}@{m.step}" for m in removed],
            "copies_removed": [_where(c) for c in gone],
            "copies_left": [_where(c) for c in left],
        }
        print(json.dumps(out), flush=True)
        return 0
    parts = f" and its {len(removed) - 1} part(s)" if len(removed) > 1 else ""
    console.print(f"removed {job}@{step}{parts} from the catalog: nothing lists or loads it any more")
    if gone:
        console.print(f"{len(gone)} copies removed: {', '.join(_say(c) for c in gone)}")
    if left:
        console.print(
            f"[yellow]{len(left)} copies still listed after {wait_s:g} s:[/] {', '.join(_say(c) for c in left)}"
            " -- each goes when its keeper runs"
        )
    return 0


def _where(c: tuple[str, int, Copy]) -> dict[str, Any]:
    return {"job": c[0], "step": c[1], "tier": c[2].tier.value, "node": c[2].node, "state": c[2].state}


def _key(c: tuple[str, int, Copy]) -> tuple[str, int, Tier, str]:
    return c[0], c[1], c[2].tier, c[2].node


def _say(c: tuple[str, int, Copy]) -> str:
    where = c[2].tier.value + ("" if c[2].node == SHARED_NODE else f" on {c[2].node}")
    return f"{where} ({c[0]})" if is_part(c[0]) else where


async def _remove(
    catalog: Catalog, job: str, step: int, wait_s: float, url: str
) -> tuple[list[Manifest], list[tuple[str, int, Copy]], list[tuple[str, int, Copy]]]:
    """Tombstone and delete the manifest of ``job@step`` (and of its parts, a DCP set's),
    then wait up to ``wait_s`` for the keepers to remove the copies. Returns the manifests
    removed, the copies listed before, and those still listed."""
    entry = (await catalog.entries(job)).get(step)
    if entry is None or entry.manifest is None:
        why = "removed already" if entry is not None and entry.removed else "no such checkpoint"
        raise Failed(f"no checkpoint {job}@{step} in the catalog on {url} ({why}; `phalanx ckpt list {job}`)")
    targets = [entry.manifest]
    for part in sorted(entry.manifest.parts):
        m = await catalog.manifest(part, step)
        if m is not None:
            targets.append(m)
    before = await _copies(catalog, targets)
    by = f"{getpass.getuser()}@{socket.gethostname()}"
    for m in targets:  # the set first: nothing loads it once its manifest is gone
        await catalog.mark_removed(m, by)
        if not await catalog.remove_manifest(m.job, m.step, m.created):
            raise Failed(
                f"{m.job}@{m.step} was saved again while being removed: the new save is kept", code=1
            )
    left = before
    deadline = time.monotonic() + wait_s
    while left and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        left = await _copies(catalog, targets)
    return targets, before, left


async def _copies(catalog: Catalog, targets: list[Manifest]) -> list[tuple[str, int, Copy]]:
    out = []
    for m in targets:
        e = (await catalog.entries(m.job)).get(m.step)
        out += [(m.job, m.step, c) for c in sorted(e.copies, key=_order)] if e is not None else []
    return out


# -- click ----------------------------------------------------------------------------------
_json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")


@click.group("ckpt")
def ckpt_group() -> None:
    """A job's tiered checkpoints: list them, show one's copies, remove one everywhere."""


@ckpt_group.command("list")
@click.argument("job", callback=_job)
@_json_option
def list_command(job: str, as_json: bool) -> int:
    """Every checkpoint of JOB, newest first, with the tiers that hold a complete copy."""
    _quiet()
    return asyncio.run(_list(job, as_json))


@ckpt_group.command("show")
@click.argument("job", callback=_job)
@click.argument("step", type=click.IntRange(min=0), required=False)
@_json_option
def show_command(job: str, step: int | None, as_json: bool) -> int:
    """Every copy of JOB's checkpoint STEP (default: the newest) in every tier -- state,
    size, age -- and its manifest's kind, origin and files."""
    _quiet()
    return asyncio.run(_show(job, step, as_json))


@ckpt_group.command("rm")
@click.argument("job", callback=_job)
@click.argument("step", type=click.IntRange(min=0))
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    help="Seconds to wait for the keepers to remove the copies (0: do not wait).",
)
@_json_option
def rm_command(job: str, step: int, wait_s: float, as_json: bool) -> int:
    """Remove JOB's checkpoint STEP everywhere: its manifest leaves the catalog at once
    (nothing lists or loads it), and each keeper removes the copies it holds -- memory,
    disk, shared, object. Needs the admin role where the server enforces roles."""
    if is_part(job):
        raise Failed(
            f"{job} is one rank's part of a DCP checkpoint: remove {job_of(job)} {step} with its parts"
        )
    _quiet()
    return asyncio.run(_rm(job, step, wait_s, as_json))


COMMANDS = [ckpt_group]

"""Rendezvous benchmark: ``python -m bench.rendezvous --ranks 2048``.

What one generation's members do on the job's store(s) before their communicator is
usable, at N simulated ranks, for two designs in the same run:

- **today** (the design before :mod:`phalanx.runtime.rendezvous`): every rank meets on
  one store; the arrival polls ``check`` of all N arrival keys every 0.5 ms
  (:func:`~phalanx.runtime.rendezvous.polling_arrival`, the same code); gloo's eager
  full mesh as torch 2.13 runs it (each rank ``set`` s one key of ~160 + 8N bytes --
  its address and one pair id per peer -- then ``wait`` + ``get`` s every rank's key);
  NCCL's unique id (rank 0 ``set`` s 128 bytes, every other rank ``get`` s it).
- **new**: the counted arrival (:func:`~phalanx.runtime.rendezvous.counted_arrival`,
  the same code: set + add + a server-side wait on a clone); gloo's lazy pairs (one key
  of ~160 bytes per rank; ``wait`` + ``get`` only of the peers a first all-reduce and
  barrier talk to: the ring's neighbours and the dissemination barrier's r +- 2^k);
  NCCL's id as above.
- **spread** (``--stores K`` > 1): *new*, with gloo's and NCCL's keys routed over K
  stores by :class:`~phalanx.runtime.rendezvous.SpreadStore` (the same class; the
  arrival stays on the first store).

Simulated ranks are threads spread over ``--procs`` processes, each with its own
client connection(s) to real store servers started the way the launcher starts
them (``python -m phalanx.runtime.store --fd N``, told each run's secret as a launcher
is told each plan's; every client proves it). All connect first, then start
together; a rank's time is from that start to when it holds everything its
communicator needs. Every request is counted per store (requests, bytes sent and
received, by the client side). A run still going at ``--limit-s`` stops, and says how
many ranks finished.

Then the **e2e** part: real ranks (threads across ``--e2e-procs`` processes, real
gloo) run :meth:`phalanx.runtime.comm.Communicator.configure` on a real plan and one
all-reduce, for both designs, at ``--e2e-ranks``.

Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGNS = ("today", "new", "spread")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- stores, started as the launcher starts them ------------------------------------------------


class Stores:
    """K store processes (``python -m phalanx.runtime.store --fd N --host 127.0.0.1``)."""

    def __init__(self, k: int) -> None:
        from phalanx.launcher.store import STORE_MODULE
        from phalanx.worker.addr import listen_socket

        self.procs: list[subprocess.Popen[bytes]] = []
        self.addrs: list[str] = []
        try:
            for _ in range(k):
                sock = listen_socket("127.0.0.1", 0)
                port = sock.getsockname()[1]
                proc = subprocess.Popen(
                    [sys.executable, "-m", STORE_MODULE, "--fd", str(sock.fileno()), "--host", "127.0.0.1"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    pass_fds=(sock.fileno(),),
                )
                sock.close()
                self.procs.append(proc)
                self.addrs.append(f"127.0.0.1:{port}")
            for proc in self.procs:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                if not line.startswith(b"ready "):
                    raise RuntimeError(f"store process {proc.pid} ended before it served")
        except BaseException:
            self.close()
            raise

    def allow(self, secret: str) -> None:
        """Serve the generation of ``secret`` (what a launcher writes for each plan)."""
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(f"allow {secret}\n".encode())
            proc.stdin.flush()

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- a simulated rank ---------------------------------------------------------------------------


class Counted:
    """A store client that counts its requests and bytes (one per store, shared by a
    process's ranks: the counts are summed, never read while ranks run)."""

    def __init__(self, client: Any, counts: dict[str, int]) -> None:
        self.client, self.counts = client, counts

    def _n(self, op: str, sent: int, got: int = 0) -> None:
        c = self.counts
        c["requests"] = c.get("requests", 0) + 1
        c[op] = c.get(op, 0) + 1
        c["bytes"] = c.get("bytes", 0) + sent + got


def counted_store(client: Any, counts: dict[str, int]) -> Any:
    """``client`` as a ``dist.Store`` (so the rendezvous code and gloo's key routing
    run over it unchanged) that counts what it asks."""
    import torch.distributed as dist

    class Store(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.c = Counted(client, counts)

        def set(self, key: str, value: str | bytes) -> None:
            self.c._n("set", len(key) + len(value))
            client.set(key, value)

        def get(self, key: str) -> bytes:
            value: bytes = client.get(key)
            self.c._n("get", len(key), len(value))
            return value

        def add(self, key: str, value: int) -> int:
            self.c._n("add", len(key) + 8, 8)
            return int(client.add(key, value))

        def check(self, keys: list[str]) -> bool:
            self.c._n("check", sum(len(k) for k in keys))
            return bool(client.check(keys))

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            self.c._n("wait", sum(len(k) for k in keys))
            if timeout is None:
                client.wait(keys)
            else:
                client.wait(keys, timeout)

        def clone(self) -> Any:
            self.c._n("connect", 0)
            return counted_store(client.clone(), counts)

        def set_timeout(self, timeout: timedelta) -> None:
            client.set_timeout(timeout)

    return Store()


def lazy_peers(rank: int, n: int) -> list[int]:
    """The peers a first all-reduce (gloo's ring) and barrier (dissemination) talk to."""
    peers = {(rank + 1) % n, (rank - 1) % n}
    d = 1
    while d < n:
        peers.update(((rank + d) % n, (rank - d) % n))
        d <<= 1
    peers.discard(rank)
    return sorted(peers)


def sim_rank(
    design: str, rank: int, n: int, root: Any, keys_store: Any, base: str, deadline: float, waiter: Any = None
) -> None:
    """What ``rank`` asks of the store(s) until its communicator could be built."""
    from phalanx.runtime import rendezvous

    remaining = max(0.001, deadline - time.monotonic())
    if design == "today":
        rendezvous.polling_arrival(root, base, rank, n, lambda: False, remaining)
        keys_store.set(f"{base}/pg/{rank}", b"x" * (160 + 8 * n))
        for i in range(n):  # gloo's eager mesh (torch 2.13): every rank's key, its own too
            if time.monotonic() > deadline:
                raise TimeoutError("limit")
            keys_store.wait([f"{base}/pg/{i}"])
            keys_store.get(f"{base}/pg/{i}")
    else:
        # cancelled() is asked every 50 ms, not 2: it costs no request, and 2,048 ranks as
        # threads of 4 processes asking it every 2 ms starve the 2 cores (53 s at 2,048)
        rendezvous.counted_arrival(root, base, rank, n, lambda: False, remaining, 0.05, waiter=waiter)
        keys_store.set(f"{base}/pg/{rank}", b"x" * 160)
        for i in lazy_peers(rank, n):
            keys_store.wait([f"{base}/pg/{i}"])
            keys_store.get(f"{base}/pg/{i}")
    if rank == 0:  # NCCL's unique id: an O(1) broadcast through the store
        keys_store.set(f"{base}/nccl/0", b"i" * 128)
    else:
        keys_store.get(f"{base}/nccl/0")  # TCPStore's get waits for the key


def sim_worker() -> None:
    """One process of simulated ranks, kept for every run: each run is a spec line on
    stdin; connect all, say ``ready``, start on ``go``, print the result line."""
    for spec_line in sys.stdin:
        if not sim_once(json.loads(spec_line)):
            break
    sys.stdout.flush()
    os._exit(0)  # threads still blocked in a store call at a limit do not hold the exit


def sim_once(spec: dict[str, Any]) -> bool:
    """One run; False when a rank is still blocked at its end (this process then ends)."""
    import torch.distributed as dist

    from phalanx.runtime.comm import connect_store
    from phalanx.runtime.rendezvous import SpreadStore

    design, n, addrs, base = spec["design"], spec["n"], spec["addrs"], spec["base"]
    ranks = list(range(spec["lo"], spec["hi"]))
    counts: list[dict[str, int]] = [{} for _ in addrs]
    lock = threading.Lock()
    clients: list[Any] = []  # closed after the run: a store client lives until closed

    def connect(addr: str) -> Any:
        with lock:
            counts[addrs.index(addr)]["connect"] = counts[addrs.index(addr)].get("connect", 0) + 1
        client = connect_store(addr, 60.0)
        client.prove(base.partition("/")[0])  # raw keys <secret>/<prefix>/...: as a member's
        with lock:
            clients.append(client)
        return counted_store(client, counts[addrs.index(addr)])

    stores: dict[int, tuple[Any, Any, Any]] = {}

    def setup(
        r: int,
    ) -> None:  # every connection before the start (what a rank holds from earlier generations)
        root = connect(addrs[0])
        waiter = connect(addrs[0]) if design != "today" else None  # the arrival's second client
        keys: dist.Store = root
        if design == "spread":
            keys = SpreadStore(addrs, connect)
            keys.connect_all()
        stores[r] = (root, keys, waiter)

    # In parallel: on a host without DNS torch's connect stalls 5 s in a reverse lookup now and then
    setups = [threading.Thread(target=setup, args=(r,), daemon=True) for r in ranks]
    for t in setups:
        t.start()
    for t in setups:
        t.join()
    if len(stores) < len(ranks):
        raise RuntimeError(f"{len(ranks) - len(stores)} simulated ranks could not connect")
    print("ready", flush=True)
    line = sys.stdin.readline().split()
    t0, limit_s = float(line[1]), float(line[2])
    deadline = time.monotonic() + limit_s - max(0.0, time.time() - t0)
    done: dict[int, float] = {}
    errors: dict[int, str] = {}
    go = threading.Event()

    def body(r: int) -> None:
        go.wait()
        try:
            sim_rank(design, r, n, stores[r][0], stores[r][1], base, deadline, stores[r][2])
            done[r] = time.time() - t0
        except BaseException as exc:
            errors[r] = f"{type(exc).__name__}: {str(exc)[:200]}"

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    while time.time() < t0:
        time.sleep(0.0005)
    go.set()
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic() + 30.0))
    result = {"done": done, "errors": dict(list(errors.items())[:3]), "failed": len(errors), "counts": counts}
    print(json.dumps(result), flush=True)
    blocked = any(t.is_alive() for t in threads)
    if not blocked:
        for client in clients:
            client.close()
    return not blocked


class Pool:
    """``size`` worker processes (``--sim-worker``), started once and reused by every run
    (a torch import each costs seconds on this box); one that ends is started again."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.procs: list[subprocess.Popen[str]] = []

    def get(self, k: int) -> list[subprocess.Popen[str]]:
        self.procs = [p for p in self.procs if p.poll() is None]
        while len(self.procs) < min(k, self.size):
            self.procs.append(spawn("--sim-worker"))
        return self.procs[:k]

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def spawn(kind: str, arg: str = "") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.rendezvous", kind, *([arg] if arg else [])],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def start_and_collect(
    procs: list[subprocess.Popen[str]], limit_s: float, specs: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Hand each worker its spec (``specs``: pooled workers), wait for every ``ready``,
    start them together, read their results."""
    for p, spec in zip(procs, specs or [], strict=False):
        assert p.stdin is not None
        p.stdin.write(json.dumps(spec) + "\n")
        p.stdin.flush()
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"worker {p.pid} ended before it was ready")
    t0 = time.time() + 0.2
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(f"go {t0} {limit_s}\n")
        p.stdin.flush()
    results = []
    for p in procs:
        assert p.stdout is not None
        out = p.stdout.readline()
        results.append(json.loads(out) if out else {"done": {}, "failed": 0, "counts": [], "errors": {}})
    return results


def split(n: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(parts, n))
    edges = [n * i // parts for i in range(parts + 1)]
    return list(itertools.pairwise(edges))


def pct(xs: list[float], q: float, digits: int = 4) -> float | None:
    """The ``q`` quantile of ``xs``, rounded; None when no rank got there (valid JSON, not NaN)."""
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], digits)


def sim_run(design: str, n: int, stores: Stores, pool: Pool, limit_s: float) -> dict[str, Any]:
    addrs = stores.addrs if design == "spread" else stores.addrs[:1]
    secret = uuid.uuid4().hex[:16]
    base = f"{secret}/bench/{design}-{n}"  # the secret, then the prefix: as a generation's keys
    stores.allow(secret)
    specs = [
        {"design": design, "n": n, "addrs": addrs, "base": base, "lo": lo, "hi": hi}
        for lo, hi in split(n, pool.size)
    ]
    t = time.monotonic()
    results = start_and_collect(pool.get(len(specs)), limit_s, specs)
    times = [float(v) for r in results for v in r["done"].values()]
    per_store: list[dict[str, int]] = [{} for _ in addrs]
    for r in results:
        for i, c in enumerate(r["counts"]):
            for k, v in c.items():
                per_store[i][k] = per_store[i].get(k, 0) + v
    errors = [e for r in results for e in r["errors"].values()]
    run = {
        "design": design,
        "ranks": n,
        "stores": len(addrs),
        "finished": len(times),
        "failed": sum(r["failed"] for r in results),
        "all_s": round(max(times), 4) if len(times) == n else None,
        "p50_s": pct(times, 0.5, 4),
        "p90_s": pct(times, 0.9, 4),
        "max_s": round(max(times), 4) if times else None,
        "requests_max_store": max(s.get("requests", 0) for s in per_store),
        "requests_total": sum(s.get("requests", 0) for s in per_store),
        "mb_max_store": round(max(s.get("bytes", 0) for s in per_store) / 1e6, 2),
        "per_store_ops": per_store[0]
        if len(per_store) == 1
        else {"max_requests": [s.get("requests", 0) for s in per_store]},
        "wall_s": round(time.monotonic() - t, 2),
    }
    if errors:
        run["error_sample"] = errors[0]
    return run


# -- e2e: the real runtime, real gloo -----------------------------------------------------------


def e2e_worker(spec: dict[str, Any]) -> None:
    """Real ranks as threads: ``Communicator.configure`` on one plan, then an all-reduce."""
    import torch

    from phalanx.contract import NodePlan
    from phalanx.runtime import rendezvous
    from phalanx.runtime.comm import CommError, Communicator

    if spec["design"] == "today":  # the design before: polled arrival, eager gloo mesh
        rendezvous.COUNTED_FROM = rendezvous.LAZY_FROM = 1 << 30
    n = spec["n"]
    ranks = list(range(spec["lo"], spec["hi"]))
    plan = NodePlan(  # what a launcher hands its ranks: this process is the bench's "node"
        job="bench",
        generation=1,
        world_size=n,
        reason="bench",
        store_prefix=spec["prefix"],
        store_secret=spec["secret"],
        store_addr=spec["addr"],
        node="bench",
        ranks={f"w{r}": r for r in ranks},
    )
    comms = {
        r: Communicator(
            f"w{r}",
            spec["addr"],
            bind="127.0.0.1",
            backstop_s=spec["limit_s"],
            store_connect_s=spec["limit_s"],
        )
        for r in ranks
    }

    def setup(comm: Communicator) -> None:
        for _ in range(5):  # a burst of connects to one store: some time out on this box, not timed
            try:
                comm.store_at(spare=True)
                return
            except CommError:
                continue

    setups = [  # both clients a rank holds from earlier generations, connected in parallel
        threading.Thread(target=setup, args=(c,), daemon=True) for c in comms.values()
    ]
    for t in setups:
        t.start()
    for t in setups:
        t.join()
    print("ready", flush=True)
    line = sys.stdin.readline().split()
    t0 = float(line[1])
    configured: dict[int, float] = {}
    reduced: dict[int, float] = {}
    errors: dict[int, str] = {}
    go = threading.Event()

    def body(r: int) -> None:
        go.wait()
        comm = comms[r]
        try:
            comm.configure(
                plan, cancelled=lambda: False, arrival_s=spec["limit_s"], connect_s=spec["limit_s"]
            )
            configured[r] = time.time() - t0
            t = torch.ones(4)
            comm.allreduce_sum_(t, timeout_s=spec["limit_s"])
            if t[0].item() != n:
                raise RuntimeError(f"all-reduce gave {t[0].item()}, not {n}")
            reduced[r] = time.time() - t0
        except BaseException as exc:
            errors[r] = f"{type(exc).__name__}: {str(exc)[:300]}"

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    while time.time() < t0:
        time.sleep(0.0005)
    go.set()
    for t in threads:
        t.join(spec["limit_s"] + 30)
    print(
        json.dumps(
            {
                "configured": configured,
                "reduced": reduced,
                "errors": dict(list(errors.items())[:3]),
                "failed": len(errors),
            }
        )
    )
    sys.stdout.flush()
    os._exit(0)  # the groups' teardown is not what is measured


def e2e_run(design: str, n: int, stores: Stores, procs: int, limit_s: float) -> dict[str, Any]:
    addr = stores.addrs[0]
    specs = [
        {
            "design": design,
            "n": n,
            "addr": addr,
            "prefix": f"bench/e2e/{design}-{n}-{uuid.uuid4().hex[:6]}",
            "secret": uuid.uuid4().hex[:16],
            "lo": lo,
            "hi": hi,
            "limit_s": limit_s,
        }
        for lo, hi in split(n, procs)
    ]
    prefix, secret = specs[0]["prefix"], specs[0]["secret"]
    stores.allow(str(secret))
    for s in specs:
        s["prefix"], s["secret"] = prefix, secret
    t = time.monotonic()
    workers = [spawn("--e2e-worker", json.dumps(s)) for s in specs]
    try:
        results = start_and_collect(workers, limit_s)
    finally:
        for p in workers:
            try:
                p.wait(limit_s + 60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    conf = [float(v) for r in results for v in r.get("configured", {}).values()]
    red = [float(v) for r in results for v in r.get("reduced", {}).values()]
    errors = [e for r in results for e in r.get("errors", {}).values()]
    run = {
        "design": design,
        "ranks": n,
        "reduced": len(red),
        "configure_p50_s": pct(conf, 0.5, 3),
        "configure_max_s": round(max(conf), 3) if conf else None,
        "allreduce_all_s": round(max(red), 3) if len(red) == n else None,
        "wall_s": round(time.monotonic() - t, 2),
    }
    if errors:
        run["error_sample"] = errors[0]
    return run


# -- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in and args_in[0] in ("--sim-worker", "--e2e-worker"):
        if args_in[0] == "--sim-worker":
            sim_worker()
        else:
            e2e_worker(json.loads(args_in[1]))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.rendezvous", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2048, help="the largest simulated size")
    p.add_argument("--sizes", default="", help="simulated sizes, comma-separated (default: 8, N/16, N/4, N)")
    p.add_argument("--procs", type=int, default=4, help="processes the simulated ranks are spread over")
    p.add_argument("--stores", type=int, default=8, help="stores of the spread design")
    p.add_argument(
        "--repeat", type=int, default=3, help="runs of each design and size (today's: 1 above 256)"
    )
    p.add_argument("--designs", default=",".join(DESIGNS), help="which designs, comma-separated")
    p.add_argument("--limit-s", type=float, default=90.0, help="a run still going then stops")
    p.add_argument("--e2e-ranks", type=int, default=256, help="real gloo ranks (0: skip)")
    p.add_argument("--e2e-procs", type=int, default=4)
    args = p.parse_args(args_in)
    n = args.ranks
    sizes = sorted(
        {int(s) for s in args.sizes.split(",") if s} or {min(8, n), max(2, n // 16), max(2, n // 4), n}
    )
    stores = Stores(max(1, args.stores))
    pool = Pool(args.procs)
    sim: list[dict[str, Any]] = []
    e2e: list[dict[str, Any]] = []
    try:
        for size in sizes:
            for design in DESIGNS:
                if design not in args.designs.split(",") or (design == "spread" and args.stores < 2):
                    continue
                repeat = 1 if design == "today" and size > 256 else args.repeat
                for _ in range(repeat):
                    run = sim_run(design, size, stores, pool, args.limit_s)
                    sim.append(run)
                    log(json.dumps(run))
        if args.e2e_ranks:
            for design in ("today", "new"):
                run = e2e_run(design, args.e2e_ranks, stores, args.e2e_procs, args.limit_s)
                e2e.append(run)
                log(json.dumps(run))
    finally:
        pool.close()
        stores.close()

    def best(design: str, size: int, key: str) -> float | None:
        vals = [r[key] for r in sim if r["design"] == design and r["ranks"] == size and r[key] is not None]
        return statistics.median(vals) if vals else None

    summary: dict[str, Any] = {"ranks": n, "sizes": sizes, "stores": args.stores, "procs": args.procs}
    for design in DESIGNS:
        summary[design] = {
            str(size): {
                "all_s": best(design, size, "all_s"),
                "p50_s": best(design, size, "p50_s"),
                "p90_s": best(design, size, "p90_s"),
                "max_s": best(design, size, "max_s"),
                "finished": min(
                    (r["finished"] for r in sim if r["design"] == design and r["ranks"] == size), default=0
                ),
                "requests_max_store": best(design, size, "requests_max_store"),
                "mb_max_store": best(design, size, "mb_max_store"),
            }
            for size in sizes
            if any(r["design"] == design and r["ranks"] == size for r in sim)
        }
    summary["limit_s"] = args.limit_s
    summary["e2e"] = e2e
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Several "nodes" on one machine, one network namespace each, for tests and benchmarks.

A multi-node job, the loss of a whole node and a network partition can then be
exercised for real on a single host (see docs/netns.md). Every node is
a network namespace with its own loopback and one veth interface; the host-side
ends of the veths hang on a bridge this object creates, and a private /24 under
10.0.0.0/8 that overlaps no route or address of the host exists only on that
bridge. The root namespace gets one address on the bridge (:attr:`host_ip`) so
the test process itself can reach services in the namespaces. Nothing is routed
anywhere else: no default route in the namespaces, no routes or forwarding
settings changed in the root namespace, host interfaces never touched.

>>> with NetnsCluster(["a", "b"]) as cl:
...     srv = cl.popen("a", [sys.executable, "-m", "http.server", "--bind", cl.ip("a"), "8000"])
...     cl.partition("a"); cl.heal("a"); cl.kill_node("a")

Needs root and iproute2 (:meth:`NetnsCluster.available` says why not). Names are
``<prefix><6 hex>...`` per run; a state file ``/run/phalanx-netns/<run>.json``
records the creating process, so :meth:`NetnsCluster.start` can sweep what an
earlier run with the same prefix left behind when it died without ``stop()``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

STATE_DIR = Path("/run/phalanx-netns")
IFNAMSIZ = 15  # the kernel's limit on interface names (16 with the NUL)
HOST_OCTET = 254


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, or refused)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _proc_start(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (tells a reused pid apart)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, start: int | None) -> bool:
    now = _proc_start(pid)
    return now is not None and (start is None or now == start)


def _netns_pids(ns: str) -> list[int]:
    res = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split() if p.strip().isdigit()] if res.returncode == 0 else []


def _kill_netns(ns: str, deadline_s: float = 10.0) -> None:
    """SIGKILL every process in ``ns`` until none is left (children may fork meanwhile)."""
    end = time.monotonic() + deadline_s
    while True:
        pids = [p for p in _netns_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > end:
            raise RuntimeError(f"processes {pids} in namespace {ns} survive SIGKILL")
        time.sleep(0.01)  # let the kernel tear the killed processes down before looking again


def _link_exists(name: str) -> bool:
    return _ip("link", "show", "dev", name, check=False).returncode == 0


def _remove(netns: Sequence[str], links: Sequence[str]) -> list[str]:
    """Kill the namespaces' processes, delete them and the links; returns the errors."""
    errors: list[str] = []
    existing = set(_list_netns())
    for ns in netns:
        if ns not in existing:
            continue
        try:
            _kill_netns(ns)
        except RuntimeError as e:
            errors.append(str(e))
        res = _ip("netns", "del", ns, check=False)
        if res.returncode != 0:
            errors.append(f"ip netns del {ns}: {res.stderr.strip()}")
    for link in links:  # host-side veths go with their peers; the bridge stays until deleted
        if _link_exists(link):
            res = _ip("link", "del", "dev", link, check=False)
            if res.returncode != 0 and _link_exists(link):
                errors.append(f"ip link del {link}: {res.stderr.strip()}")
    return errors


def _list_netns() -> list[str]:
    res = _ip("netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 route (all tables) and address of the root namespace."""
    nets: list[ipaddress.IPv4Network] = []
    for r in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = r.get("dst", "")
        if dst == "default":
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.IPv4Network(dst, strict=False))
    for link in json.loads(_ip("-j", "-4", "addr").stdout or "[]"):
        for a in link.get("addr_info", []):
            with contextlib.suppress(ValueError, KeyError):
                nets.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
    return nets


class NetnsCluster:
    """Several 'nodes' on one machine: one network namespace each, veth pairs on a bridge
    this object creates, a private /24 that exists only on that bridge."""

    def __init__(self, nodes: Sequence[str], *, prefix: str = "phx") -> None:
        if not nodes or len(set(nodes)) != len(nodes):
            raise ValueError(f"need distinct node names, got {list(nodes)}")
        if len(nodes) > 200:
            raise ValueError("at most 200 nodes")
        if not prefix.isalnum() or len(prefix) > 6:
            raise ValueError("prefix: 1-6 letters or digits (interface names are limited to 15 chars)")
        self.nodes = list(nodes)
        self.prefix = prefix
        self.run = f"{prefix}{secrets.token_hex(3)}"
        self.bridge = f"{self.run}br"
        self._index = {n: i for i, n in enumerate(self.nodes)}
        for name in (self.bridge, self._ifname(len(nodes) - 1), self._hostif(len(nodes) - 1)):
            assert len(name) <= IFNAMSIZ, name
        self._subnet: ipaddress.IPv4Network | None = None
        self._started = False
        self.state_file = STATE_DIR / f"{self.run}.json"

    # -- names and addresses ------------------------------------------------------------

    def _i(self, node: str) -> int:
        try:
            return self._index[node]
        except KeyError:
            raise KeyError(f"no node {node!r} in {self.nodes}") from None

    def _ifname(self, i: int) -> str:
        return f"{self.run}v{i}"

    def _hostif(self, i: int) -> str:
        return f"{self.run}h{i}"

    def netns(self, node: str) -> str:
        """The namespace's name."""
        return f"{self.run}-{node}" if len(node) <= 32 else f"{self.run}-n{self._i(node)}"

    def ifname(self, node: str) -> str:
        """The node's veth interface inside its namespace (e.g. for ``GLOO_SOCKET_IFNAME``)."""
        return self._ifname(self._i(node))

    @property
    def subnet(self) -> str:
        """The private /24, e.g. ``"10.213.57.0/24"``."""
        return str(self._net())

    def _net(self) -> ipaddress.IPv4Network:
        if self._subnet is None:
            raise RuntimeError("the cluster is not started")
        return self._subnet

    def ip(self, node: str) -> str:
        """The node's address in the private subnet (``.1`` for the first node, ...)."""
        return str(self._net().network_address + 1 + self._i(node))

    @property
    def host_ip(self) -> str:
        """The root namespace's address on the bridge (``.254``): the test process can
        reach services in the namespaces through it."""
        return str(self._net().network_address + HOST_OCTET)

    # -- availability ----------------------------------------------------------------

    @staticmethod
    def available() -> tuple[bool, str]:
        """``(True, "")`` when namespaces can be made here, else ``(False, reason)``;
        actually creates and removes a probe namespace."""
        if shutil.which("ip") is None:
            return False, "iproute2's `ip` is not installed"
        if os.geteuid() != 0:
            return False, "network namespaces need root"
        probe = f"phxprobe{secrets.token_hex(3)}"
        try:
            res = _ip("netns", "add", probe, check=False)
            if res.returncode != 0:
                return False, f"`ip netns add` refused: {res.stderr.strip()}"
            res = _ip("netns", "exec", probe, "ip", "link", "set", "lo", "up", check=False)
            if res.returncode != 0:
                return False, f"`ip netns exec` refused: {res.stderr.strip()}"
            return True, ""
        except (OSError, subprocess.SubprocessError) as e:
            return False, f"`ip netns` failed: {e}"
        finally:
            _ip("netns", "del", probe, check=False)

    # -- lifecycle -------------------------------------------------------------------

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        used = _used_networks()
        for state in self._states():
            with contextlib.suppress(KeyError, ValueError):
                used.append(ipaddress.IPv4Network(state["subnet"]))
        for _ in range(1000):
            net = ipaddress.IPv4Network(f"10.{secrets.randbelow(256)}.{secrets.randbelow(256)}.0/24")
            if not any(net.overlaps(u) for u in used):
                return net
        raise NetnsUnavailable("found no free /24 under 10.0.0.0/8")

    @staticmethod
    def _states() -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if STATE_DIR.is_dir():
            for f in STATE_DIR.glob("*.json"):
                with contextlib.suppress(OSError, ValueError):
                    state = json.loads(f.read_text())
                    state["_file"] = str(f)
                    out.append(state)
        return out

    def sweep(self) -> list[str]:
        """Remove what earlier runs with this prefix left behind when their creating
        process died without ``stop()``; returns the runs removed."""
        swept = []
        for state in self._states():
            if state.get("prefix") != self.prefix or state.get("run") == self.run:
                continue
            if _alive(int(state.get("pid", 0)), state.get("pid_start")):
                continue
            errors = _remove(state.get("netns", []), [*state.get("links", []), state.get("bridge", "")])
            if not errors:
                Path(state["_file"]).unlink(missing_ok=True)
                swept.append(str(state.get("run")))
        return swept

    def _write_state(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {
            "run": self.run,
            "prefix": self.prefix,
            "pid": os.getpid(),
            "pid_start": _proc_start(os.getpid()),
            "subnet": str(self._net()),
            "bridge": self.bridge,
            "netns": [self.netns(n) for n in self.nodes],
            "links": [self._hostif(i) for i in range(len(self.nodes))],
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_file)

    def start(self) -> NetnsCluster:
        """Create the bridge, the namespaces and the veths; sweep leftovers first."""
        if self._started:
            return self
        ok, why = self.available()
        if not ok:
            raise NetnsUnavailable(why)
        self.sweep()
        self._subnet = self._pick_subnet()
        self._write_state()  # before anything exists, so a crash below is swept next time
        self._started = True
        try:
            plen = self._net().prefixlen
            _ip("link", "add", "name", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host_ip}/{plen}", "dev", self.bridge)
            _ip("link", "set", "dev", self.bridge, "up")
            for node in self.nodes:
                i, ns = self._i(node), self.netns(node)
                inner, outer = self._ifname(i), self._hostif(i)
                _ip("netns", "add", ns)
                _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
                _ip("link", "add", "name", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", "dev", outer, "master", self.bridge)
                _ip("link", "set", "dev", outer, "up")
                _ip("link", "set", "dev", inner, "netns", ns)
                self._in(node, "ip", "addr", "add", f"{self.ip(node)}/{plen}", "dev", inner)
                self._in(node, "ip", "link", "set", "dev", inner, "up")
        except subprocess.CalledProcessError as e:
            self.stop()
            raise NetnsUnavailable(f"{' '.join(e.cmd)}: {(e.stderr or '').strip()}") from e
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill every process in the namespaces, delete them, the veths and the bridge."""
        if not self._started:
            return
        errors = _remove(
            [self.netns(n) for n in self.nodes],
            [*(self._hostif(i) for i in range(len(self.nodes))), self.bridge],
        )
        if errors:
            raise RuntimeError("netns cleanup incomplete: " + "; ".join(errors))
        self.state_file.unlink(missing_ok=True)
        self._started = False

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- processes and faults --------------------------------------------------------

    def _in(self, node: str, *argv: str) -> subprocess.CompletedProcess[str]:
        return _ip("netns", "exec", self.netns(node), *argv)

    def argv(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the node's namespace (same environment and file system)."""
        return ["ip", "netns", "exec", self.netns(node), *argv]

    def popen(self, node: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` on the node; ``ip netns exec`` execs it, so the Popen's pid is
        the process itself."""
        return subprocess.Popen(self.argv(node, argv), **kwargs)

    def pids(self, node: str) -> list[int]:
        """Every process in the node's namespace."""
        return _netns_pids(self.netns(node))

    def kill_node(self, node: str) -> float:
        """SIGKILL every process of the node (a node loss); returns ``time.time()`` taken
        just before the kills."""
        ns = self.netns(node)
        self._i(node)
        t = time.time()
        _kill_netns(ns)
        return t

    def partition(self, node: str) -> None:
        """Cut the node off the others: its veth goes down (inside its namespace)."""
        self._in(node, "ip", "link", "set", "dev", self.ifname(node), "down")

    def heal(self, node: str) -> None:
        """Undo :meth:`partition` (the kernel restores the subnet's route with the link)."""
        self._in(node, "ip", "link", "set", "dev", self.ifname(node), "up")

    def blackhole(self, node: str, port: int, peers: Sequence[str], *, on: bool = True) -> None:
        """Drop every TCP segment between ``port`` on ``node`` and the ``peers``' addresses,
        both ways (``on=False`` removes the rules): a server there falls silent to those
        nodes, with no reset and no error, and answers everyone else (its own node, the
        host). Needs ``iptables`` (the rules live in the node's namespace and go with it).
        """
        op = "-I" if on else "-D"
        for peer in peers:
            ip = self.ip(peer)
            for rule in (
                ["INPUT", "-s", ip, "-p", "tcp", "--dport", str(port)],
                ["OUTPUT", "-d", ip, "-p", "tcp", "--sport", str(port)],
            ):
                self._in(node, "iptables", "-w", op, *rule, "-j", "DROP")

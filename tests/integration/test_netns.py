"""phalanx.devstack.netns: several network-namespace "nodes" on this machine.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
Waits are deadlines for something to happen, never assertions about how long it took.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from phalanx.devstack.natsserver import NatsServer
from phalanx.devstack.netns import STATE_DIR, NetnsCluster

OK, WHY = NetnsCluster.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")

PORT = 9555
# Echo server: prints "ready" once listening, answers each connection with what it got.
ECHO = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    with c:
        c.sendall(b"echo:" + c.recv(100))
"""
# Client: one round trip with the echo server; prints the answer, exits 1 on failure.
CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:
        s.sendall(b"hi")
        print(s.recv(100).decode())
except OSError as e:
    print(f"error: {e!r}")
    sys.exit(1)
"""


def names_left(cl: NetnsCluster) -> list[str]:
    """Namespaces and links of this run that still exist."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = json.loads(
        subprocess.run(["ip", "-j", "link"], capture_output=True, text=True, check=True).stdout
    )
    left = [line.split()[0] for line in netns.splitlines() if line.startswith(cl.run)]
    return left + [link["ifname"] for link in links if link["ifname"].startswith(cl.run)]


@pytest.fixture
def cluster() -> Iterator[NetnsCluster]:
    with NetnsCluster(["a", "b", "ctl"], prefix="phxt") as cl:
        yield cl
    assert names_left(cl) == []


def echo_server(cl: NetnsCluster, node: str, port: int = PORT) -> subprocess.Popen[bytes]:
    p = cl.popen(node, [sys.executable, "-c", ECHO, cl.ip(node), str(port)], stdout=subprocess.PIPE)
    assert p.stdout is not None
    assert p.stdout.readline() == b"ready\n"
    return p


def client(cl: NetnsCluster, node: str, host: str, timeout: float = 5.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cl.argv(node, [sys.executable, "-c", CLIENT, host, str(PORT), str(timeout)]),
        capture_output=True,
        text=True,
        timeout=60,
    )


def host_roundtrip(host: str, timeout: float = 5.0) -> str:
    with socket.create_connection((host, PORT), timeout=timeout) as s:
        s.sendall(b"hi")
        return s.recv(100).decode()


def test_addresses(cluster: NetnsCluster) -> None:
    import ipaddress

    net = ipaddress.IPv4Network(cluster.subnet)
    assert net.prefixlen == 24 and net.subnet_of(ipaddress.IPv4Network("10.0.0.0/8"))
    ips = {cluster.ip(n) for n in cluster.nodes} | {cluster.host_ip}
    assert len(ips) == 4 and all(ipaddress.ip_address(i) in net for i in ips)
    assert cluster.argv("a", ["true"]) == ["ip", "netns", "exec", cluster.netns("a"), "true"]
    assert all(len(cluster.ifname(n)) <= 15 for n in cluster.nodes)
    # loopback is up inside the namespaces
    assert subprocess.run(cluster.argv("b", ["ip", "-j", "addr", "show", "lo"]), capture_output=True).stdout


def test_nodes_reach_each_other_and_the_host_reaches_them(cluster: NetnsCluster) -> None:
    server = echo_server(cluster, "a")
    assert server.pid in cluster.pids("a")
    res = client(cluster, "b", cluster.ip("a"))
    assert res.returncode == 0 and res.stdout.strip() == "echo:hi", res
    assert host_roundtrip(cluster.ip("a")) == "echo:hi"


def test_partition_and_heal(cluster: NetnsCluster) -> None:
    echo_server(cluster, "a")
    cluster.partition("a")
    res = client(cluster, "b", cluster.ip("a"), timeout=1.0)
    assert res.returncode == 1 and "error" in res.stdout, res
    with pytest.raises(OSError):
        host_roundtrip(cluster.ip("a"), timeout=1.0)
    cluster.heal("a")
    deadline = time.monotonic() + 30
    while (res := client(cluster, "b", cluster.ip("a"), timeout=2.0)).returncode != 0:
        assert time.monotonic() < deadline, f"still unreachable after heal: {res}"
    assert res.stdout.strip() == "echo:hi"
    assert host_roundtrip(cluster.ip("a")) == "echo:hi"


def test_kill_node_kills_every_process_in_it(cluster: NetnsCluster) -> None:
    server = echo_server(cluster, "a")
    # a shell with a child of its own, both in node a
    shell = cluster.popen("a", ["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE)
    assert shell.stdout is not None
    child = int(shell.stdout.readline())
    bystander = echo_server(cluster, "b")
    assert {server.pid, shell.pid, child} <= set(cluster.pids("a"))
    before = time.time()
    t = cluster.kill_node("a")
    assert before <= t <= time.time()
    assert cluster.pids("a") == []
    assert server.wait(10) == -9 and shell.wait(10) == -9
    assert bystander.poll() is None and bystander.pid in cluster.pids("b")


def test_stop_removes_everything_also_when_the_body_raises() -> None:
    cl = NetnsCluster(["a", "b"], prefix="phxt")
    with pytest.raises(ZeroDivisionError), cl:
        echo_server(cl, "a")
        assert len(names_left(cl)) == 5  # 2 namespaces, 2 host-side veths, the bridge
        assert cl.state_file.exists()
        _ = 1 / 0
    assert names_left(cl) == []
    assert not cl.state_file.exists()


def test_start_sweeps_what_a_dead_run_left() -> None:
    crashed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from phalanx.devstack.netns import NetnsCluster\n"
            "cl = NetnsCluster(['x'], prefix='phxs').start(); print(cl.run, flush=True); os._exit(0)",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    run = crashed.stdout.strip()
    assert (STATE_DIR / f"{run}.json").exists()
    with NetnsCluster(["y"], prefix="phxs") as cl:
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
        assert run not in netns and run not in links
        assert not (STATE_DIR / f"{run}.json").exists()
        assert cl.netns("y") in netns


async def test_nats_server_inside_a_namespace_answers_from_the_host(
    cluster: NetnsCluster, tmp_path: Path
) -> None:
    srv = NatsServer(store_dir=tmp_path / "nats", host=cluster.ip("ctl"), argv_prefix=cluster.argv("ctl", []))
    with srv:
        assert srv.url.startswith(f"nats://{cluster.ip('ctl')}:")
        assert srv.proc is not None and srv.proc.pid in cluster.pids("ctl")
        nc = await nats.connect(srv.url, connect_timeout=5, max_reconnect_attempts=0)
        try:
            sub = await nc.subscribe("netns.test")
            await nc.publish("netns.test", b"ping")
            msg = await sub.next_msg(timeout=10)
            assert msg.data == b"ping"
        finally:
            await nc.close()

"""Every NATS call goes through :class:`phalanx.bus.Bus`: outside ``libs/phalanx/bus/`` no code
reaches for the client under it (``bus.nc``, ``bus.js``) or for nats.py's connection,
JetStream and KV types. (Exceptions and ``Msg``, the raw message a handler is handed beside
the decoded one, may still be named.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUS = ROOT / "libs/phalanx/bus"
# nats.py modules whose use means talking to NATS by hand (errors and Msg are fine)
RAW_MODULES = ("nats.aio.client", "nats.js.kv", "nats.js.client", "nats.aio.subscription")
RAW_NAMES = {"JetStreamContext", "KeyValue", "Client", "Subscription"}
# bench/detect.py: a 16,000-rank simulator publishes pre-encoded digests and speaks JSON to its
# worker processes, measured as it is (its figures are the baseline of the detector's bench).
# Benchmark harnesses: their raw uses are the harness's own (control requests to its
# simulator processes, the client's byte counters), not Phalanx's protocol, which they
# speak through the Bus.
EXEMPT = {ROOT / "bench/detect.py", ROOT / "bench/scale.py", ROOT / "bench/scalesim.py"}


def raw_uses(source: str) -> list[str]:
    """``.nc`` / ``.js`` attributes and imports of nats.py's client, JetStream and KV types."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Attribute) and n.attr in ("nc", "js"):
            out.append(f"{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.ImportFrom) and n.module is not None:
            names = {a.name for a in n.names}
            if n.module in RAW_MODULES or (n.module.startswith("nats") and names & RAW_NAMES):
                out.append(f"{n.lineno}: from {n.module} import {', '.join(sorted(names))}")
    return out


def test_the_check_finds_raw_nats_calls() -> None:
    for src in (
        "await self.bus.nc.subscribe(s, cb=cb)",
        "kv = await bus.js.key_value(B)",
        "from nats.js.kv import KeyValue",
        "from nats.js import JetStreamContext",
    ):
        assert raw_uses(src), src
    assert not raw_uses("from nats.aio.msg import Msg\nfrom nats.js.errors import NotFoundError")


def test_no_nats_call_bypasses_the_bus() -> None:
    offenders = []
    for base in ("libs", "services", "examples", "bench"):
        for path in sorted((ROOT / base).rglob("*.py")):
            if BUS in path.parents or path in EXEMPT:
                continue
            offenders += [f"{path.relative_to(ROOT)}:{hit}" for hit in raw_uses(path.read_text())]
    assert not offenders, "go through phalanx.bus.Bus (bus.subscribe, bus.kv, bus.streams):\n" + "\n".join(
        offenders
    )

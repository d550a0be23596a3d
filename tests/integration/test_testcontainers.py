"""The bus through testcontainers' NATS module (a ``nats`` container with JetStream).

Needs a Docker engine; where none answers (these machines, CI) it is skipped with
the reason. The binary nats-server is the default everywhere else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from nats.aio.msg import Msg

from _docker import docker_available
from phalanx.bus import Bus
from phalanx.contract import FaultCause, Message, RankFailed
from phalanx.contract.streams import EVENTS
from phalanx.contract.subjects import FAILED

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def container_url() -> Iterator[str]:
    ok, why = docker_available()
    if not ok:
        pytest.skip(f"testcontainers NATS needs a Docker engine: {why}")
    from testcontainers.community.nats import NatsContainer

    with NatsContainer(jetstream=True) as nats:
        yield nats.nats_uri()


async def test_publish_and_durable_consume_through_testcontainers(container_url: str) -> None:
    bus = await Bus.connect(container_url, name="tc")
    got: list[str] = []

    async def handler(msg: Message, raw: Msg) -> None:
        assert isinstance(msg, RankFailed)
        got.append(msg.incident)

    bus.consume(EVENTS, "tc-consumer", [FAILED.wildcard()], handler, (RankFailed,))
    for i in range(3):
        event = RankFailed(
            job="j1",
            incident=f"tc{i}",
            worker="w1",
            rank=1,
            generation=1,
            cause=FaultCause.PROCESS_EXIT,
            fault_at=1.0,
        )
        await bus.publish(FAILED, event, job="j1", msg_id=f"tc{i}")
    await bus.publish(FAILED, event, job="j1", msg_id="tc2")  # a duplicate
    deadline = asyncio.get_running_loop().time() + 30
    while len(got) < 3:
        assert asyncio.get_running_loop().time() < deadline, got
        await asyncio.sleep(0.05)
    info = await bus.js.stream_info(EVENTS.name)
    assert info.state.messages == 3
    assert got == ["tc0", "tc1", "tc2"]
    await bus.close()

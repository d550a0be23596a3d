"""End-to-end fixtures: a real local stack (nats-server, failure-detector and
elasticity-planner as separate processes) and real multi-process training jobs
of the example GPT under the launcher."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from examples.train_gpt import SMALL
from examples.train_gpt import command as train_command
from phalanx.devstack.jobwatch import JobResult
from phalanx.devstack.localstack import LocalStack
from phalanx.devstack.netns import NetnsCluster

STEPS = 16
SMALL_GPT = SMALL


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.corpus import build_corpus

    path = tmp_path_factory.mktemp("data") / "corpus.bin"
    build_corpus(path, max_bytes=1 << 20)
    return path


def stack_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What the services and ranks of an e2e stack run with."""
    return {
        "PHALANX_STALL_FLOOR_MS": "1500",
        "PHALANX_STALL_INITIAL_MS": "10000",
        "PHALANX_PLANNER_COMM_GRACE_S": "1.0",
        # The phi detector's floor on the heartbeat deviation (20 ms) makes about 230 ms of
        # silence a hang. Ranks now get plans from their launcher, so their agents' loops
        # are quiet and their heartbeats' deviation sits at that floor; rank 0 of an FSDP
        # job on this 2-core box is silent ~280 ms in its first DCP save (measured: the
        # tiered-checkpoint test's fault-free run was declared hung there, 3 runs of 3).
        # No test here measures detection; bench.detect does, with the defaults.
        "PHALANX_DETECTOR_MIN_STD_MS": "60",
        # data order and prepared shards in the test's own directory, not /dev/shm
        "PHALANX_DATA_CACHE_DIR": str(tmp_path_factory.mktemp("datacache")),
    }


@contextlib.contextmanager
def netns_cluster(nodes: list[str]) -> Iterator[NetnsCluster]:
    """One network namespace per node (bridged, torn down after); the test is skipped,
    with the reason, where namespaces cannot be made."""
    ok, why = NetnsCluster.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    with NetnsCluster(nodes) as cl:
        yield cl


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    services = ("failure-detector", "elasticity-planner")
    with LocalStack(
        tmp_path_factory.mktemp("stack"), services=services, env=stack_env(tmp_path_factory)
    ) as s:
        yield s


RunJob = Callable[..., tuple[JobResult, dict[str, torch.Tensor] | None]]


def runner(stack: LocalStack, corpus: Path, out: Path) -> RunJob:
    """Run the small GPT as a job on ``stack``: (its result, its final weights)."""
    counter = iter(range(1_000_000))

    def run(
        *,
        nproc: int = 3,
        spares: int = 0,
        faults: str = "",
        steps: int = STEPS,
        timeout_s: float = 180.0,
        min_nproc: int | None = None,
        env: dict[str, str] | None = None,
    ) -> tuple[JobResult, dict[str, torch.Tensor] | None]:
        job = f"{out.name}{next(counter)}"
        save = out / f"{job}.pt"
        cmd = train_command(steps, corpus, *SMALL_GPT, save=save)
        result = stack.run_job(
            job,
            cmd,
            nproc=nproc,
            spares=spares,
            faults=faults,
            global_batch=12,
            timeout_s=timeout_s,
            min_nproc=min_nproc,
            env=env,
        )
        weights = torch.load(save) if save.exists() else None
        return result, weights

    return run


@pytest.fixture(scope="session")
def run_job(stack: LocalStack, corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> RunJob:
    return runner(stack, corpus, tmp_path_factory.mktemp("e2e"))


Reference = Callable[[int], dict[str, torch.Tensor]]


@pytest.fixture(scope="session")
def reference(run_job: RunJob) -> Reference:
    """Final weights of the fault-free run of ``nproc`` ranks, which every faulty run
    of that size must equal bit for bit (computed once per size)."""
    cache: dict[int, dict[str, torch.Tensor]] = {}

    def get(nproc: int = 3) -> dict[str, torch.Tensor]:
        if nproc not in cache:
            result, weights = run_job(nproc=nproc)
            assert result.returncode == 0, result
            assert weights is not None
            cache[nproc] = weights
        return cache[nproc]

    return get

"""The whole stack with NATS server authorization on (``LocalStack(auth=True)``).

Every process logs in as its role (phalanx.natsauth): the four services, the
launcher, the ranks and the stack's observer. A rank killed mid-run is replaced
by the hot spare exactly as without authorization, ending bitwise equal to the
fault-free run, and the server refused nobody anything the roles need.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from phalanx.localstack import SERVICE_MODULES, LocalStack
from phalanx.schemas import Action
from tests.e2e.conftest import SMALL_GPT, STEPS, Reference
from tests.e2e.test_recovery import actions

pytestmark = pytest.mark.slow

VIOLATION = re.compile(r'"\$G/user:(?P<user>[^"]+)" - (?P<what>\w+) Violation - Subject "(?P<subject>[^"]+)"')


@pytest.fixture(scope="module")
def auth_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    env = {
        "PHALANX_STALL_FLOOR_MS": "1500",
        "PHALANX_STALL_INITIAL_MS": "10000",
        "PHALANX_DATA_CACHE_DIR": str(tmp_path_factory.mktemp("datacache")),
    }
    with LocalStack(
        tmp_path_factory.mktemp("authstack"), services=tuple(SERVICE_MODULES), env=env, auth=True
    ) as s:
        yield s


def test_recovery_with_every_process_in_its_role(
    auth_stack: LocalStack, corpus: Path, reference: Reference, tmp_path: Path
) -> None:
    assert auth_stack.auth is not None and auth_stack.server is not None
    save = tmp_path / "weights.pt"
    cmd = [
        sys.executable,
        "-m",
        "examples.train_gpt",
        "--steps",
        str(STEPS),
        "--data",
        str(corpus),
        "--save",
        str(save),
        *SMALL_GPT,
    ]
    result = auth_stack.run_job(
        "authe2e", cmd, nproc=3, spares=1, faults="kill:w1@step=5", global_batch=12, timeout_s=180.0
    )
    assert result.returncode == 0, result.decisions
    assert actions(result) == [Action.START, Action.REPLACE]
    assert result.plans[-1].rank_of("w3") == 1
    weights = torch.load(save)
    assert all(torch.equal(weights[k], v) for k, v in reference(3).items())

    refused = [m.groupdict() for m in VIOLATION.finditer(auth_stack.server.log_file.read_text())]
    # The launcher purges a finished job's plan from the bucket only the planner may
    # write: refused (and harmless for a fresh job id). Nothing else may be refused.
    assert all(r["user"] == "launcher" and r["subject"].startswith("$KV.phalanx_jobs.") for r in refused), (
        refused
    )

"""The whole stack with NATS server authorization on (``LocalStack(auth=True)``).

Every process logs in as its role (phalanx.natsauth): the four services and the
stack's observer as their role-wide users; the job's launcher and ranks as the
job's own users, added to the running server by a config reload: ``launcher@<job>``
and one ``rank@<job>/<worker>`` per worker, which the launcher hands each worker
(``PHALANX_NATS_WORKER_CREDENTIALS``). A rank killed mid-run is replaced by the hot
spare exactly as without authorization, ending bitwise equal to the fault-free run,
and the server refused nobody anything: what a job's users may do is enough to
run, follow plans (KV watch included) and recover.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from phalanx.services import SERVICE_MODULES

from examples.train_gpt import command as train_command
from phalanx.bus.credentials import ENV_WORKER_CREDENTIALS
from phalanx.contract import Action
from phalanx.devstack.localstack import LocalStack
from phalanx.natsauth import NatsAuth
from tests.e2e.conftest import SMALL_GPT, STEPS, Reference
from tests.e2e.test_recovery import actions

pytestmark = pytest.mark.slow

# the users are in the account phalanx.natsauth.ACCOUNT (PHALANX), not the global $G
VIOLATION = re.compile(r'"\w+/user:(?P<user>[^"]+)" - (?P<what>\w+) Violation - Subject "(?P<subject>[^"]+)"')


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


JOB = "authe2e"
WORKERS = ["w0", "w1", "w2", "w3"]  # 3 ranks and 1 spare on one node


def test_recovery_with_every_process_in_its_role(
    auth_stack: LocalStack,
    corpus: Path,
    reference: Reference,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert auth_stack.auth is not None and auth_stack.server is not None
    # The job's users replace the role-wide rank and launcher users on the running
    # server (as an operator would: render, reload): the job can run only as its own.
    others = {u: c for u, c in auth_stack.auth.users.items() if c.role not in ("rank", "launcher")}
    auth = NatsAuth(others).with_job(JOB, WORKERS)
    auth.write_config(auth_stack.workdir / "nats.conf", listen=None)  # where LocalStack wrote it
    auth_stack.server.reload()
    stack_env = auth_stack.users.env
    job_env = {"launcher": auth.env("launcher", JOB), "rank": {}}  # ranks: each its own, from the launcher
    monkeypatch.setattr(
        auth_stack.users, "env", lambda role: job_env[role] if role in job_env else stack_env(role)
    )
    save = tmp_path / "weights.pt"
    cmd = train_command(STEPS, corpus, *SMALL_GPT, save=save)
    handed = {k: v for k, v in auth.launcher_env(JOB).items() if k == ENV_WORKER_CREDENTIALS}
    result = auth_stack.run_job(
        JOB, cmd, nproc=3, spares=1, faults="kill:w1@step=5", global_batch=12, timeout_s=180.0, env=handed
    )
    assert result.returncode == 0, result.decisions
    assert actions(result) == [Action.START, Action.REPLACE]
    assert result.plans[-1].rank_of("w3") == 1
    weights = torch.load(save)
    assert all(torch.equal(weights[k], v) for k, v in reference(3).items())

    log = auth_stack.server.log_file.read_text()
    refused = [m.groupdict() for m in VIOLATION.finditer(log)]
    assert not refused, refused
    assert "Reloaded server configuration" in log

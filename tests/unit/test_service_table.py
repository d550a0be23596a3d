"""One table of the services (``phalanx.services.SERVICE_MODULES``), used by ``phalanx up``,
``phalanx service`` and the development stack alike."""

from __future__ import annotations

import importlib.util

from phalanx.services import SERVICE_MODULES

from phalanx.cli import up
from phalanx.contract.permissions import SERVICES
from phalanx.devstack import localstack


def test_every_service_of_the_permissions_has_a_runnable_module() -> None:
    assert sorted(SERVICE_MODULES) == sorted(SERVICES)
    for module in SERVICE_MODULES.values():
        assert importlib.util.find_spec(f"{module}.__main__") is not None, module


def test_the_cli_and_the_stack_start_services_from_the_same_table() -> None:
    assert up.SERVICE_MODULES is SERVICE_MODULES
    assert localstack.SERVICE_MODULES is SERVICE_MODULES

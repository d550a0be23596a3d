"""``python -m phalanx.services.state_replication``: run the state-replication service."""

import asyncio

from phalanx.services.state_replication.service import StateReplication

from phalanx.service import run_service
from phalanx.settings import settings_or_exit

settings_or_exit(StateReplication.name)  # a bad PHALANX_* value: one line, exit status 2
asyncio.run(run_service(StateReplication))

"""``python -m phalanx.services.state_replication``: run the state-replication service."""

import asyncio

from phalanx.services.state_replication.service import StateReplication

from phalanx.service import run_service

asyncio.run(run_service(StateReplication))

"""``python -m phalanx.services.state_replication``: run the state-replication service."""

import asyncio
import sys

from phalanx.services.state_replication.service import StateReplication

from phalanx.checkpoint.peerauth import load_key
from phalanx.service import run_service
from phalanx.settings import SettingsError, settings_or_exit

settings = settings_or_exit(StateReplication.name)  # a bad PHALANX_* value: one line, exit status 2
try:
    load_key(settings)  # no keeper key: refused now, in one line, not deep in the start
except SettingsError as exc:
    print(f"{StateReplication.name}: {exc}", file=sys.stderr)
    raise SystemExit(2) from None
asyncio.run(run_service(StateReplication))

"""``python -m phalanx.services.state_replication``: run the state-replication service."""

import asyncio
import sys

from phalanx.services.state_replication.service import StateReplication

from phalanx.checkpoint.peerauth import load_key
from phalanx.service import run_service
from phalanx.settings import SettingsError, load_or_exit

# a bad PHALANX_* value: one line, exit status 2
settings = load_or_exit(StateReplication.settings_type, StateReplication.name)
try:
    load_key(settings)  # no keeper key: refused now, in one line, not deep in the start
except SettingsError as exc:
    print(f"{StateReplication.name}: {exc}", file=sys.stderr)
    raise SystemExit(2) from None
asyncio.run(run_service(StateReplication))

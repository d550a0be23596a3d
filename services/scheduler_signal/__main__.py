"""``python -m phalanx.services.scheduler_signal``: run the scheduler-signal service."""

import asyncio

from phalanx.services.scheduler_signal.service import SchedulerSignal

from phalanx.service import run_service
from phalanx.settings import load_or_exit

# a bad PHALANX_* value: one line, exit status 2
load_or_exit(SchedulerSignal.settings_type, SchedulerSignal.name)
asyncio.run(run_service(SchedulerSignal))

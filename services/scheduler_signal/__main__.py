"""``python -m phalanx.services.scheduler_signal``: run the scheduler-signal service."""

import asyncio

from phalanx.services.scheduler_signal.service import SchedulerSignal

from phalanx.service import run_service
from phalanx.settings import settings_or_exit

settings_or_exit(SchedulerSignal.name)  # a bad PHALANX_* value: one line, exit status 2
asyncio.run(run_service(SchedulerSignal))

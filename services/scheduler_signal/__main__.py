"""``python -m phalanx.services.scheduler_signal``: run the scheduler-signal service."""

import asyncio

from phalanx.services.scheduler_signal.service import SchedulerSignal

from phalanx.service import run_service

asyncio.run(run_service(SchedulerSignal))

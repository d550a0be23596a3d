"""``python -m phalanx.services.failure_detector``: run the detector until SIGTERM.

Configuration comes from the environment (see :mod:`.service`).
"""

from __future__ import annotations

import asyncio
import gc

from phalanx.services.failure_detector.service import FailureDetector

from phalanx.service import run_service
from phalanx.settings import load_or_exit


def main() -> None:
    # a bad PHALANX_* value: one line, exit status 2
    load_or_exit(FailureDetector.settings_type, FailureDetector.name)
    # Objects alive after start-up (modules, pydantic schemas) never die: keep them
    # out of the collector's way so its pauses stay short.
    gc.freeze()
    asyncio.run(run_service(FailureDetector))


if __name__ == "__main__":
    main()

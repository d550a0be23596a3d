"""``python -m phalanx.services.elasticity_planner``: run the planner until SIGTERM."""

import asyncio

from phalanx.services.elasticity_planner.service import ElasticityPlanner

from phalanx.service import run_service
from phalanx.settings import load_or_exit

# a bad PHALANX_* value: one line, exit status 2
load_or_exit(ElasticityPlanner.settings_type, ElasticityPlanner.name)
asyncio.run(run_service(ElasticityPlanner))

import asyncio

from phalanx.services.elasticity_planner.service import ElasticityPlanner

from phalanx.service import run_service
from phalanx.settings import settings_or_exit

settings_or_exit(ElasticityPlanner.name)  # a bad PHALANX_* value: one line, exit status 2
asyncio.run(run_service(ElasticityPlanner))

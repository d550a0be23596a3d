import asyncio

from phalanx.service import run_service
from phalanx.services.elasticity_planner.service import ElasticityPlanner

asyncio.run(run_service(ElasticityPlanner))

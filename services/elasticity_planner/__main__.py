import asyncio

from phalanx.services.elasticity_planner.service import ElasticityPlanner

from phalanx.service import run_service

asyncio.run(run_service(ElasticityPlanner))

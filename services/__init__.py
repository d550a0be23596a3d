"""The four services of the control plane, each run as ``python -m <module>``.

:data:`SERVICE_MODULES` is the one table of them: ``phalanx up`` / ``phalanx service``
(:mod:`phalanx.cli.up`) and the development stack (:mod:`phalanx.devstack.localstack`)
both start services from it. Its order is ``phalanx up --metrics-port``'s: the N-th
service gets the N-th port.
"""

SERVICE_MODULES: dict[str, str] = {
    "failure-detector": "phalanx.services.failure_detector",
    "scheduler-signal": "phalanx.services.scheduler_signal",
    "elasticity-planner": "phalanx.services.elasticity_planner",
    "state-replication": "phalanx.services.state_replication",
}

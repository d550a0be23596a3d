"""scheduler-signal: cluster signals -> CapacityChanged / PreemptionNotice.

Watches a local simulated cluster (a JSON file) and, in a Kubernetes cluster,
nodes and the job's pods, and publishes capacity changes and preemption notices
on ``phalanx.sched.<cluster>.*``, each exactly once (``Nats-Msg-Id``).
"""

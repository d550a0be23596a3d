"""elasticity-planner: the single writer of job membership.

Job specs, registrations, faults (RankFailed / RankHung / NodeLost), exits,
acknowledgements, collective errors, proposals and scheduler signals come in as
typed events (:mod:`.events`); the pure reducer (:mod:`.reducer`) turns each into
the job's next state and effects, asking a :class:`~.failure_policy.FailurePolicy`
and a :class:`~.scaling_policy.ScalingPolicy` for the decisions; the service
(:mod:`.service`) commits the new state by compare-and-set in KV, then runs the
effects (:mod:`.runner`): a membership change is published as a Plan.
"""

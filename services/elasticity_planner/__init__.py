"""elasticity-planner: the single writer of job membership.

Faults (RankFailed / RankHung), registrations and job specs come in; a
:class:`~phalanx.services.elasticity_planner.policy.Policy` turns each incident
into a :class:`~phalanx.services.elasticity_planner.policy.Decision`; a decision
that changes membership is committed as a new generation in KV by
compare-and-set, then published as a Plan.
"""

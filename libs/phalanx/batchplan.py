"""Splitting a constant global batch over a changing number of replicas.

The planner puts a :class:`~phalanx.contract.BatchPlan` in every plan; ranks train
by it. Replica ``r`` of ``W`` takes the ``r``-th contiguous shard of the global
batch (``ceil(G/W)`` samples for the first ``G % W`` ranks, ``floor(G/W)`` for the
rest) and weights its loss by ``n / E``, so the update is the gradient of the mean
loss over the ``E`` samples trained, whatever ``W`` is: the global batch is held
exactly even when ``W`` does not divide it (DDP's averaging all-reduce cannot do
that; a SUM of ``n/E``-weighted losses can).

It cannot be held when a replica's share exceeds its cap (``micro_batch`` x
``max_accum``, memory or time per step): each replica then trains the first
``cap`` samples of its shard, the effective batch ``E`` is the sum, and the
learning rate is scaled by the job's rule:

>>> plan_batch(24, 3).describe()
'global batch 24 held: 3 replicas x 8 samples'
>>> p = plan_batch(24, 2, micro_batch=4, max_accum=2, lr_rule=LrRule.SQRT)
>>> p.effective_batch, round(p.lr_scale, 4)
(16, 0.8165)
"""

from __future__ import annotations

import math

from phalanx.contract import BatchPlan, Elastic, LrRule


def shard_sizes(global_batch: int, world_size: int) -> list[int]:
    """Samples of each rank's shard: contiguous, the first ``G % W`` one larger."""
    if world_size < 1 or global_batch < world_size:
        raise ValueError(f"cannot split a global batch of {global_batch} over {world_size} replicas")
    base, extra = divmod(global_batch, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def lr_scale(rule: LrRule, effective: int, global_batch: int) -> float:
    ratio = effective / global_batch
    if rule is LrRule.LINEAR:
        return ratio
    if rule is LrRule.SQRT:
        return math.sqrt(ratio)
    return 1.0


def plan_batch(
    global_batch: int,
    world_size: int,
    *,
    micro_batch: int = 0,
    max_accum: int = 0,
    lr_rule: LrRule = LrRule.NONE,
) -> BatchPlan:
    """How ``world_size`` replicas train a global batch of ``global_batch``."""
    shards = shard_sizes(global_batch, world_size)
    if micro_batch and max_accum:
        cap = micro_batch * max_accum
        shards = [min(n, cap) for n in shards]
    effective = sum(shards)
    accum = math.ceil(max(shards) / micro_batch) if micro_batch else 1
    return BatchPlan(
        global_batch=global_batch,
        effective_batch=effective,
        world_size=world_size,
        shards=shards,
        micro_batch=micro_batch,
        accum=max(1, accum),
        lr_rule=lr_rule,
        lr_scale=lr_scale(lr_rule, effective, global_batch),
    )


def plan_for(elastic: Elastic, global_batch: int, world_size: int) -> BatchPlan:
    """:func:`plan_batch` with a job's elastic settings."""
    return plan_batch(
        global_batch,
        world_size,
        micro_batch=elastic.micro_batch,
        max_accum=elastic.max_accum,
        lr_rule=elastic.lr_rule,
    )


__all__ = ["lr_scale", "plan_batch", "plan_for", "shard_sizes"]

"""state-replication: the per-node keeper of in-memory state snapshots.

It follows every job's plans and recoveries (durable consumers, one set per
node), which is what it will act on to replicate snapshots to peer nodes, serve
recovering ranks and drain to the disk/shared/object tiers.
"""

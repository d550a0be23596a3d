"""state-replication: each node's checkpoint keeper (phalanx.checkpoint.keeper).

It takes the snapshots the node's ranks leave in shared memory, replicates them
to keepers on other nodes over TCP, drains them to local disk, a shared path and
object storage, records every copy in the ``phalanx_ckpt`` KV bucket, and serves
restores from the fastest tier holding a good copy. It also follows every job's
plans and recoveries (durable consumers, one set per node).
"""

"""Managed tiered checkpointing: the recovery of last resort, when no live peer holds the state.

A rank's :class:`Checkpointer` puts a snapshot in shared memory (one copy, on
the training thread); the node's keeper (:mod:`phalanx.checkpoint.keeper`, run
by the state-replication service) replicates it to peer nodes over TCP and
drains it to local disk, a shared path and object storage, recording every
copy in the ``phalanx_ckpt`` KV bucket (:mod:`phalanx.checkpoint.catalog`).
``list``/``latest``/``load`` read from the fastest tier holding a good copy;
:mod:`phalanx.checkpoint.dcp` routes ``torch.distributed.checkpoint`` through
the same tiers.
"""

from typing import TYPE_CHECKING, Any

from phalanx.checkpoint.manifest import Manifest, ManifestError
from phalanx.checkpoint.slots import node_name, shm_root
from phalanx.checkpoint.tiers import Tier
from phalanx.settings import RetentionPolicy

if TYPE_CHECKING:
    from phalanx.checkpoint.client import Checkpointer, CheckpointInfo, Loaded, NoCheckpoint

_CLIENT = ("Checkpointer", "CheckpointInfo", "Loaded", "NoCheckpoint")


def __getattr__(name: str) -> Any:
    """The rank-side API imports torch; the keeper (this package's other half) does not."""
    if name in _CLIENT:
        import phalanx.checkpoint.client as client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointInfo",
    "Checkpointer",
    "Loaded",
    "Manifest",
    "ManifestError",
    "NoCheckpoint",
    "RetentionPolicy",
    "Tier",
    "node_name",
    "shm_root",
]

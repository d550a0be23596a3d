"""The runtime a training rank embeds: the communicator, recovery, state transfer, data.

What a training script needs is importable from here (loaded on first use, so
that services importing a helper of this package do not import torch)::

    from phalanx.runtime import ElasticSampler, init
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.runtime.job import Job, init
    from phalanx.runtime.sampler import ElasticSampler
    from phalanx.runtime.trainer import Trainer

_LAZY = {
    "init": "phalanx.runtime.job",
    "Job": "phalanx.runtime.job",
    "ElasticSampler": "phalanx.runtime.sampler",
    "Trainer": "phalanx.runtime.trainer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'phalanx.runtime' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["ElasticSampler", "Job", "Trainer", "init"]

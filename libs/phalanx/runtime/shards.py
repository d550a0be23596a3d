"""Sharded (DTensor) state on the wire: only this rank's shards move.

An FSDP2 model's ``state_dict`` and its optimizer's hold DTensors: each a local
shard plus where it sits on the mesh. A joiner at a mesh position takes the
shards of a member at the same position (:meth:`Mesh.position`), so the shards
are all that travels: :func:`to_local` swaps every DTensor of a state for its
local tensor before packing, and :func:`from_local` puts received local tensors
back into DTensors laid out like the receiver's own (its ``template``), after
checking that each has the shape, dtype and place of the shard it replaces.

The optimizer's template is built from its parameters (:func:`optimizer_template`):
a joiner's optimizer has no state before its first step, but each state tensor
shaped like its parameter's shard is sharded like that parameter (Adam's moments),
and any other (``step``) is a plain tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["ShardMismatch", "from_local", "optimizer_template", "to_local"]


class ShardMismatch(ValueError):
    """A received shard does not fit the receiver's own layout."""


def to_local(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by its local shard (no copy)."""
    if isinstance(obj, DTensor):
        return obj._local_tensor.detach()
    if isinstance(obj, dict):
        out = {k: to_local(v) for k, v in obj.items()}
        if type(obj) is dict:
            return out
        kept = type(obj)(out)  # an OrderedDict keeps its _metadata (module versions)
        if hasattr(obj, "_metadata"):
            kept._metadata = obj._metadata  # type: ignore[attr-defined]
        return kept
    if isinstance(obj, list):
        return [to_local(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_local(v) for v in obj)
    return obj


def _wrap(local: Any, like: DTensor, where: str) -> DTensor:
    mine = like._local_tensor
    if not isinstance(local, torch.Tensor) or isinstance(local, DTensor):
        raise ShardMismatch(f"{where}: expected a tensor shard, got {type(local).__name__}")
    if local.shape != mine.shape or local.dtype != mine.dtype:
        raise ShardMismatch(
            f"{where}: the peer's shard is {tuple(local.shape)} {local.dtype},"
            f" this rank's is {tuple(mine.shape)} {mine.dtype}"
        )
    return DTensor.from_local(
        local.to(mine.device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def from_local(obj: Any, template: Any, where: str = "state") -> Any:
    """``obj`` (from :func:`to_local` at a peer) with a DTensor wherever ``template``
    has one; :class:`ShardMismatch` when a shard does not fit."""
    if isinstance(template, DTensor):
        return _wrap(obj, template, where)
    if isinstance(template, dict) and isinstance(obj, dict):
        return {k: from_local(v, template[k], f"{where}.{k}") if k in template else v for k, v in obj.items()}
    if isinstance(template, (list, tuple)) and isinstance(obj, (list, tuple)) and len(obj) == len(template):
        items = [from_local(v, t, f"{where}.{i}") for i, (v, t) in enumerate(zip(obj, template, strict=True))]
        return type(obj)(items)
    return obj


def optimizer_template(opt: torch.optim.Optimizer, state: Any) -> Any:
    """A template for ``state`` (a peer's ``opt.state_dict()`` through :func:`to_local`):
    each tensor in a parameter's state shaped like that parameter's shard is laid out
    like the parameter."""
    params = [p for group in opt.param_groups for p in group["params"]]
    per_param: dict[Any, Any] = {}
    got = state.get("state", {}) if isinstance(state, dict) else {}
    if not isinstance(got, dict):
        return {}
    for index, entries in got.items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(entries, dict):
            continue
        param = params[index]
        if not isinstance(param, DTensor):
            continue
        shard = param._local_tensor
        per_param[index] = {
            key: param
            for key, value in entries.items()
            if isinstance(value, torch.Tensor) and value.shape == shard.shape
        }
    return {"state": per_param}

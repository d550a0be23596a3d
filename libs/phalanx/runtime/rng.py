"""The torch RNG states of a process: what moves with a rank's state and what a
checkpoint keeps per rank, so that a redone step draws what it drew the first time."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """The torch RNG states of this process: CPU, and every CUDA device once CUDA is up."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu().clone())  # a view into a receive buffer segfaults
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.cpu().clone() for t in state["cuda"]])

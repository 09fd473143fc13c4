"""Resumable training state, written atomically, and the check that a rerun is the same run.

``<out>/state/last.pt`` holds everything a step depends on: the encoder's and the objective's
weights, the optimizer and scheduler, the plan's position (stream, look-ahead buffer), the RNG
states, the resolved arguments and the run's fixed facts (total steps, dataset fingerprint,
encoder config). It is written to a temporary name and renamed, so a kill at any moment leaves
either the previous state or the new one. Every step's randomness is derived from the seed and
the step, so a resumed run repeats the uninterrupted one bit for bit (at a fixed thread count).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moonvit.files import atomic_path
from moonvit.runs import describe_differences, differences

__all__ = [
    "STATE_FORMAT",
    "RunMismatch",
    "check_same_run",
    "load_state",
    "rng_states",
    "save_state",
    "set_rng_states",
    "state_path",
]

STATE_FORMAT = 2
"""2: the optimizer's state keyed by parameter name (any world size resumes it); the calibration kept."""


class RunMismatch(ValueError):
    """The output folder holds another run than the command describes."""


def state_path(out: Path) -> Path:
    return out / "state" / "last.pt"


def save_state(path: Path, state: dict[str, Any]) -> None:
    """``torch.save`` to a temporary name beside ``path``, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as temporary:
        torch.save({"format": STATE_FORMAT, **state}, temporary)


def load_state(path: Path) -> dict[str, Any] | None:
    """The saved state, or None when there is none yet."""
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != STATE_FORMAT:
        raise RunMismatch(f"{path} was written by another version of the trainer (format {state.get('format')})")
    return state


def rng_states() -> dict[str, Any]:
    """torch's, numpy's and Python's global generator states."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])


def check_same_run(saved: dict[str, Any], now: dict[str, Any], where: Path) -> None:
    """Refuse to resume when an argument or fact that shapes the run differs, naming it.

    Args:
        saved, now: {name: value} of the run-defining arguments and facts.
    """
    changes = differences(saved, now, absent=None)  # a setting one side lacks counts as None
    if changes:
        first = describe_differences(changes[:1], "{key} = {before!r}, but this command gives {after!r}")
        raise RunMismatch(
            f"{where} holds a run started with {first}; run the original command to resume it, or choose another --out"
        )

"""Seeded stratified splits."""

from __future__ import annotations

import numpy as np


def stratified_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split indices so that about ``fraction`` of every class is held out.

    Each class's indices are shuffled with ``numpy.random.default_rng(seed)`` and its first
    ``round(fraction * count)`` (at least 1 when the class has 2 or more members) are held out.

    Args:
        labels: (N,) integer class labels.
        fraction: share of each class to hold out, in (0, 1).
        seed: seed of the shuffle.

    Returns:
        (kept, held): sorted int64 index arrays, disjoint, covering ``range(N)``.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must lie in (0, 1), got {fraction}")
    rng = np.random.default_rng(seed)
    held = []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        count = round(fraction * len(members))
        held.append(members[: max(count, 1) if len(members) > 1 else 0])
    held_index = np.sort(np.concatenate(held)).astype(np.int64)
    kept_index = np.setdiff1d(np.arange(len(labels)), held_index).astype(np.int64)
    return kept_index, held_index

"""What a training objective is to the engine.

An objective is a module holding its own trainable parameters beyond the encoder (a classifier
head, an MAE decoder) that turns a pack into a loss. The engine does the rest (data, packing,
optimiser, DDP, resume, logging) the same way for every objective.

Losses are sums over the pack's *units* (images for a classifier; masked patches for MAE), and
:meth:`Objective.weight` counts the units of planned images from the plan alone. The engine
divides each pack's sum by the units of the whole step, over every rank, which it knows without
communicating, so the loss normalisation is exact whatever the ranks' token counts.
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import torch
import torch.nn as nn

from moonvit import MoonViT

from ..batch import Batch
from ..plan import PlannedImage

__all__ = ["Objective", "ObjectiveOutput"]


@dataclass
class ObjectiveOutput:
    """An objective's result on one pack.

    Attributes:
        loss_sum: scalar, the loss summed over the pack's units (differentiable).
        sums: other per-pack sums to report (detached), such as correct predictions; the engine
            adds them over packs and ranks and divides by the step's units.
        outputs: per-image results for evaluation (logits for a classifier), or None.
    """

    loss_sum: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: torch.Tensor | None = None


class Objective(nn.Module, ABC):
    """A training objective (see the module docstring).

    Subclasses set ``name``, may add flags in :meth:`add_arguments`, and build themselves in
    :meth:`from_args`.
    """

    name: ClassVar[str]
    sum_names: ClassVar[tuple[str, ...]] = ()
    """The keys of :attr:`ObjectiveOutput.sums`, the same on every rank and pack."""
    needs_full_pixels: ClassVar[bool] = False
    """Whether its batches must hold the dropped patches too (:attr:`Batch.full_pixels`)."""
    draws_pictures: ClassVar[bool] = False
    """Whether :meth:`visualize` draws (the engine makes a ``pictures/`` folder only then)."""

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Flags of this objective (added to ``python -m train``'s parser)."""

    @classmethod
    def check_args(cls, args: argparse.Namespace, error: Callable[[str], NoReturn]) -> None:
        """Check (and complete) the parsed command line when this objective is chosen; ``error``
        ends the program with a usage message."""

    @classmethod
    @abstractmethod
    def from_args(cls, encoder: MoonViT, classes: Sequence[str], args: argparse.Namespace) -> Objective:
        """Build for ``encoder`` and a dataset of ``classes``."""

    @abstractmethod
    def weight(self, items: Sequence[PlannedImage]) -> int:
        """The units the loss of these planned images is a sum over."""

    @abstractmethod
    def forward(self, encoder: nn.Module, batch: Batch) -> ObjectiveOutput:
        """Loss and sums of one training pack (``encoder`` in train mode)."""

    @abstractmethod
    def evaluate(self, encoder: nn.Module, batch: Batch) -> ObjectiveOutput:
        """Loss, sums and per-image outputs of one evaluation pack (no augmentation, every patch)."""

    @abstractmethod
    def report(self, outputs: torch.Tensor, labels: torch.Tensor, classes: Sequence[str]) -> dict[str, Any]:
        """Metrics of a whole evaluated split from its per-image outputs, for results.json."""

    def visualize(self, encoder: nn.Module, batch: Batch, processor: Any, path: Path) -> bool:
        """Draw what it does on a few held-out images (a reconstruction, say) into the PNG ``path``;
        returns whether it drew anything. Called at validations and at the end."""
        return False

    def save(self, out: Path, state: dict[str, torch.Tensor]) -> list[str]:
        """Write what a user keeps besides the encoder (a head) into ``out``; returns the file names.

        ``state`` is this module's full state dict (gathered, when the weights are sharded).
        """
        return []

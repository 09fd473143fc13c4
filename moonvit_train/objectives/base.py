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
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import torch
import torch.nn as nn

from ..batch import Batch
from ..classic import Encoder
from ..plan import PlannedTrainImage

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["NoOptions", "Objective", "ObjectiveOutput"]


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


@dataclass(frozen=True)
class NoOptions:
    """The options of an objective that has none."""


class Objective(nn.Module, ABC):
    """A training objective (see the module docstring).

    Subclasses set ``name``, may add flags in :meth:`add_arguments` (read back into their
    :attr:`Options` dataclass), check and complete the run's config in :meth:`check_config`, and
    build themselves in :meth:`from_config`.

    The engine asks an objective for: its defaults of two engine flags (AdamW's betas, stochastic
    depth), whether it needs labels (:attr:`needs_labels`: a self-supervised objective trains on a
    folder of unlabelled images), its losses and sums, the metrics it reports from them
    (:meth:`metrics`), a hook after each optimizer step (:meth:`after_step`: an EMA teacher
    for self-distillation updates there), and a calibration pass before step 0
    (:meth:`calibrate` on :attr:`calibration_images` training images: a distillation teacher's
    feature statistics).
    """

    name: ClassVar[str]
    sum_names: ClassVar[tuple[str, ...]] = ()
    """The keys of :attr:`ObjectiveOutput.sums`, the same on every rank and pack."""
    needs_full_pixels: ClassVar[bool] = False
    """Whether its batches must hold the dropped patches too (:attr:`Batch.full_pixels`)."""
    draws_pictures: ClassVar[bool] = False
    """Whether :meth:`visualize` draws (the engine makes a ``pictures/`` folder only then)."""
    needs_labels: ClassVar[bool] = True
    """Whether it learns from labels (else it trains on ``images:DIR`` too, and labels are ignored)."""
    default_betas: ClassVar[tuple[float, float]] = (0.9, 0.999)
    """AdamW's betas unless ``--betas`` says otherwise."""
    default_drop_path: ClassVar[float] = 0.05
    """Stochastic depth at the last block unless ``--drop-path`` says otherwise."""
    calibration_images: int = 0
    """Training images :meth:`calibrate` sees before step 0 (0: no calibration pass)."""
    grid_unit: int = 1
    """Every planned grid's sides are multiples of it (besides the encoder's merge kernel): a teacher's merge."""
    Options: ClassVar[type] = NoOptions
    """The dataclass of its own options, one field per flag it adds (same names)."""

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Flags of this objective (added to ``python -m moonvit_train``'s parser)."""

    @classmethod
    def options_from(cls, args: argparse.Namespace) -> Any:
        """Its :attr:`Options` from the parsed command line."""
        return cls.Options(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls.Options)})

    @classmethod
    def check_config(cls, config: TrainConfig, error: Callable[[str], NoReturn]) -> TrainConfig:
        """Check (and complete) the run's config when this objective is chosen; ``error`` ends the
        program with a usage message."""
        return config

    @classmethod
    @abstractmethod
    def from_config(cls, encoder: Encoder, classes: Sequence[str], config: TrainConfig) -> Objective:
        """Build for ``encoder`` and a dataset of ``classes`` (empty for unlabelled data)."""

    def metrics(self, means: dict[str, float]) -> dict[str, float]:
        """What to report from the step's or an evaluation's mean sums (``loss`` and :attr:`sum_names`),
        e.g. ``{"top1": ...}``; the loss is reported by the engine."""
        return {}

    def calibrate(self, batches: Iterable[Batch]) -> dict[str, Any]:
        """Measure what the objective needs from the data before step 0, from the first
        :attr:`calibration_images` training images (every patch, no augmentation, the same on every
        rank); what it sets must be in its state dict (a resumed run restores it, not calibrates).
        Returns a summary for the log. Nothing by default."""
        return {}

    def after_step(self) -> None:
        """Called after every optimizer step (an EMA teacher updates here); nothing by default."""

    @abstractmethod
    def weight(self, items: Sequence[PlannedTrainImage]) -> int:
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

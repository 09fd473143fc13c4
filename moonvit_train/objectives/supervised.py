"""Supervised classification: cross-entropy with label smoothing, on labels mixed by Mixup / CutMix where
those are on, of

- a MoonViT's mean-pooled patch features -> LayerNorm -> Linear (the objective's head);
- a classic ViT / DeiT's own head (``out.logits``; DeiT with teacher: the mean of its two heads), refitted to
  the dataset's classes where its count differs (:func:`moonvit_train.classic.fit_heads`);
- a classic ViT without a head: its ``out.pooled`` (the CLS row, the patch mean of a GAP tower, or a SigLIP
  tower's MAP head output) -> LayerNorm -> Linear (the objective's head)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from moonvit import PackedGrid, pool_features
from moonvit.cli import drop_rate
from moonvit.files import save_safetensors_atomic, write_text_atomic
from moonvit.model.encoder import MoonViTOutput
from moonvit_eval.metrics import classification_metrics

from ..batch import Batch
from ..classic import ClassicViT, Encoder, fit_heads, freeze_unread, is_classic
from ..plan import PlannedTrainImage
from .base import Objective, ObjectiveOutput

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = [
    "HEAD_FILE",
    "MEAN_INPUT",
    "POOLED_INPUT",
    "SupervisedObjective",
    "classification_report",
    "soft_targets",
]

HEAD_FILE = "head.safetensors"
MEAN_INPUT = "mean of each image's patch tokens (last_hidden_state), pool_features(out, grid)"
POOLED_INPUT = (
    "out.pooled: the CLS row after the final norm (a GAP tower: the mean of its patch rows; a MAP tower: its "
    "attention-pooling head's output)"
)
"""What the objective's head reads, as ``head.json`` says it (a MoonViT's, a classic ViT's)."""


def soft_targets(batch: Batch, classes: int, smoothing: float) -> torch.Tensor:
    """(N, C) float32 soft targets: smoothed one-hots of each image and its Mixup / CutMix partner, weighted
    ``lam : 1 - lam``."""
    smooth = F.one_hot(batch.labels, classes).float() * (1 - smoothing) + smoothing / classes
    lam = batch.lam.unsqueeze(1)
    return lam * smooth + (1 - lam) * smooth[batch.partner]


def classification_report(outputs: torch.Tensor, labels: torch.Tensor, classes: Sequence[str]) -> dict[str, Any]:
    """results.json's metrics of a classifier's (N, C) logits on a split: top-1, per-class recall, loss."""
    metrics = classification_metrics(outputs, labels)
    metrics["per_class_recall"] = dict(zip(classes, metrics["per_class_recall"]))
    metrics["loss"] = float(F.cross_entropy(outputs, labels))
    return metrics


class SupervisedObjective(Objective):
    """A linear classifier on each image's pooled feature (see the module docstring).

    The loss of an image is the cross-entropy against its target: its own one-hot label and its
    Mixup / CutMix partner's, weighted ``lam`` and ``1 - lam``, each smoothed by ``smoothing``.

    Args:
        hidden_size: the tower's width (the input of the objective's head).
        tower_head: use the tower's own head (``out.logits``) instead: the objective then has no parameters.
        pooled: the head reads ``out.pooled`` (a classic ViT) rather than the patch mean (a MoonViT).
    """

    name = "supervised"
    sum_names = ("correct",)

    def __init__(
        self,
        hidden_size: int,
        classes: Sequence[str],
        smoothing: float = 0.1,
        tower_head: bool = False,
        pooled: bool = False,
    ) -> None:
        super().__init__()
        self.classes = tuple(classes)
        self.smoothing = smoothing
        self.tower_head, self.pooled = tower_head, pooled
        self.norm: nn.Module | None = None
        self.head: nn.Linear | None = None
        if not tower_head:
            self.norm = nn.LayerNorm(hidden_size)
            self.head = nn.Linear(hidden_size, len(classes))
            nn.init.trunc_normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)

    @dataclass(frozen=True)
    class Options:
        smoothing: float = 0.1

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--smoothing",
            type=drop_rate,
            default=0.1,
            help="label smoothing of the cross-entropy (supervised; deit: of the class head's) (default: 0.1)",
        )

    @classmethod
    def from_config(cls, encoder: Encoder, classes: Sequence[str], config: TrainConfig) -> SupervisedObjective:
        """A classic ViT with a head trains its own (refitted to ``classes`` where its count differs)."""
        options: SupervisedObjective.Options = config.options
        tower_head = isinstance(encoder, ClassicViT) and encoder.config.num_classes > 0
        if tower_head:
            assert isinstance(encoder, ClassicViT)
            fit_heads(encoder, len(classes), encoder.config.distilled_head)
        if isinstance(encoder, ClassicViT):  # DeiT's two heads read the prefix rows, not pooled
            freeze_unread(encoder, pooled=not (tower_head and encoder.config.distilled_head), heads=True)
        return cls(encoder.config.hidden_size, classes, options.smoothing, tower_head, is_classic(encoder))

    def metrics(self, means: dict[str, float]) -> dict[str, float]:
        return {"top1": means["correct"]}

    def weight(self, items: Sequence[PlannedTrainImage]) -> int:
        return len(items)

    def logits(self, encoder: nn.Module, batch: Batch) -> torch.Tensor:
        """(N, C) float32 logits of the pack's images."""
        return self.classify(encoder(batch.pixel_values, grid=batch.grid), batch.grid)

    def classify(self, out: MoonViTOutput, grid: PackedGrid) -> torch.Tensor:
        """(N, C) float32 logits from the tower's output on a pack of ``grid``: the tower's head's, or this head's
        on the pooled feature."""
        if self.tower_head:
            assert out.logits is not None
            return out.logits.float()
        assert self.norm is not None and self.head is not None
        features = out.pooled if self.pooled else pool_features(out.last_hidden_state, grid)  # (N, D)
        assert features is not None
        return self.head(self.norm(features)).float()

    def targets(self, batch: Batch) -> torch.Tensor:
        """(N, C) soft targets: smoothed one-hots of each image and its partner, weighted lam : 1 - lam."""
        return soft_targets(batch, len(self.classes), self.smoothing)

    def forward(self, encoder: nn.Module, batch: Batch) -> ObjectiveOutput:
        logits = self.logits(encoder, batch)
        loss = -(self.targets(batch) * logits.log_softmax(dim=1)).sum()
        correct = (logits.detach().argmax(dim=1) == batch.labels).sum().float()
        return ObjectiveOutput(loss, {"correct": correct})

    @torch.no_grad()
    def evaluate(self, encoder: nn.Module, batch: Batch) -> ObjectiveOutput:
        logits = self.logits(encoder, batch)
        loss = F.cross_entropy(logits, batch.labels, reduction="sum")
        correct = (logits.argmax(dim=1) == batch.labels).sum().float()
        return ObjectiveOutput(loss, {"correct": correct}, logits)

    def report(self, outputs: torch.Tensor, labels: torch.Tensor, classes: Sequence[str]) -> dict[str, Any]:
        return classification_report(outputs, labels, classes)

    def save(self, out: Path, state: dict[str, torch.Tensor]) -> list[str]:
        """``head.safetensors`` (norm.weight/bias, head.weight/bias) and ``head.json`` (classes, input); nothing
        where the tower's own head was trained (the checkpoint holds it)."""
        if self.tower_head:
            return []
        save_safetensors_atomic(state, out / HEAD_FILE, {"classes": json.dumps(self.classes)})
        about = {
            "input": POOLED_INPUT if self.pooled else MEAN_INPUT,
            "layers": "LayerNorm(hidden_size) -> Linear(hidden_size, num_classes)",
            "classes": list(self.classes),
        }
        write_text_atomic(out / "head.json", json.dumps(about, indent=2) + "\n")
        return [HEAD_FILE, "head.json"]

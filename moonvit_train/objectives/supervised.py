"""Supervised classification: mean-pooled patch features -> LayerNorm -> Linear, cross-entropy with
label smoothing, on labels mixed by Mixup / CutMix where those are on."""

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

from moonvit import MoonViT, pool_features
from moonvit.cli import drop_rate
from moonvit.files import save_safetensors_atomic, write_text_atomic
from moonvit_eval.metrics import classification_metrics

from ..batch import Batch
from ..plan import PlannedTrainImage
from .base import Objective, ObjectiveOutput

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["HEAD_FILE", "SupervisedObjective"]

HEAD_FILE = "head.safetensors"


class SupervisedObjective(Objective):
    """A linear classifier on each image's mean patch token (MoonViT has no CLS token).

    The loss of an image is the cross-entropy against its target: its own one-hot label and its
    Mixup / CutMix partner's, weighted ``lam`` and ``1 - lam``, each smoothed by ``smoothing``.
    """

    name = "supervised"
    sum_names = ("correct",)

    def __init__(self, hidden_size: int, classes: Sequence[str], smoothing: float = 0.1) -> None:
        super().__init__()
        self.classes = tuple(classes)
        self.smoothing = smoothing
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
            "--smoothing", type=drop_rate, default=0.1, help="label smoothing of the cross-entropy (default: 0.1)"
        )

    @classmethod
    def from_config(cls, encoder: MoonViT, classes: Sequence[str], config: TrainConfig) -> SupervisedObjective:
        options: SupervisedObjective.Options = config.options
        return cls(encoder.config.hidden_size, classes, options.smoothing)

    def metrics(self, means: dict[str, float]) -> dict[str, float]:
        return {"top1": means["correct"]}

    def weight(self, items: Sequence[PlannedTrainImage]) -> int:
        return len(items)

    def logits(self, encoder: nn.Module, batch: Batch) -> torch.Tensor:
        """(N, C) float32 logits of the pack's images."""
        out = encoder(batch.pixel_values, grid=batch.grid)
        features = pool_features(out.last_hidden_state, batch.grid)  # (N, D) float32
        return self.head(self.norm(features)).float()

    def targets(self, batch: Batch) -> torch.Tensor:
        """(N, C) soft targets: smoothed one-hots of each image and its partner, weighted lam : 1 - lam."""
        classes = len(self.classes)
        smooth = F.one_hot(batch.labels, classes).float() * (1 - self.smoothing) + self.smoothing / classes
        lam = batch.lam.unsqueeze(1)
        return lam * smooth + (1 - lam) * smooth[batch.partner]

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
        metrics = classification_metrics(outputs, labels)
        metrics["per_class_recall"] = dict(zip(classes, metrics["per_class_recall"]))
        metrics["loss"] = float(F.cross_entropy(outputs, labels))
        return metrics

    def save(self, out: Path, state: dict[str, torch.Tensor]) -> list[str]:
        """``head.safetensors`` (norm.weight/bias, head.weight/bias) and ``head.json`` (classes, input)."""
        save_safetensors_atomic(state, out / HEAD_FILE, {"classes": json.dumps(self.classes)})
        about = {
            "input": "mean of each image's patch tokens (last_hidden_state), pool_features(out, grid)",
            "layers": "LayerNorm(hidden_size) -> Linear(hidden_size, num_classes)",
            "classes": list(self.classes),
        }
        write_text_atomic(out / "head.json", json.dumps(about, indent=2) + "\n")
        return [HEAD_FILE, "head.json"]

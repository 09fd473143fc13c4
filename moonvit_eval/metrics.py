"""Classification metrics from logits: top-k accuracy, per-class recall, the confusion matrix."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["classification_metrics", "confusion_matrix"]


def confusion_matrix(predictions: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(C, C) int64 counts: row = true class, column = predicted class."""
    flat = labels.long() * num_classes + predictions.long()
    return torch.bincount(flat, minlength=num_classes * num_classes).view(num_classes, num_classes)


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """Metrics of (N, C) logits against (N,) labels.

    Returns:
        ``top1``; ``top5`` when C >= 5; ``mean_per_class_recall`` over the classes present;
        ``per_class_recall`` (C,) as a list (None for a class absent from ``labels``);
        ``confusion`` (C, C) as nested lists.
    """
    num_classes = logits.shape[1]
    labels = labels.to(logits.device)
    confusion = confusion_matrix(logits.argmax(dim=1), labels, num_classes)
    support = confusion.sum(dim=1)
    recall = confusion.diagonal().double() / support.clamp(min=1)
    metrics: dict[str, Any] = {"top1": float((logits.argmax(dim=1) == labels).double().mean())}
    if num_classes >= 5:
        top5 = logits.topk(5, dim=1).indices
        metrics["top5"] = float((top5 == labels.unsqueeze(1)).any(dim=1).double().mean())
    metrics["mean_per_class_recall"] = float(recall[support > 0].mean())
    metrics["per_class_recall"] = [float(r) if n > 0 else None for r, n in zip(recall, support)]
    metrics["confusion"] = confusion.tolist()
    return metrics

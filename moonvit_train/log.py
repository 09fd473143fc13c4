"""What a user watches: the per-step JSONL log and the curves PNG (the loss, and the objective's metric).

Each line of ``metrics.jsonl`` is one record: ``{"kind": "train", "step": ...}`` after every step
(loss, accuracy on the step's images, lr, gradient norm, images, patches, utilisation, times,
throughput, MFU) and ``{"kind": "val", "step": ...}`` after each validation. On resume the lines
past the restored step are dropped, so the log reads as one uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moonvit.names import display_name

__all__ = ["MetricsLog", "plot_curves"]


class MetricsLog:
    """Appends records to a JSONL file (main rank only); opening drops the records past ``resume_step``."""

    def __init__(self, path: Path, resume_step: int, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled
        if not enabled:
            return
        kept = [record for record in read_records(path) if record["step"] <= resume_step]
        path.write_text("".join(json.dumps(record) + "\n" for record in kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a") as file:
                file.write(json.dumps(record) + "\n")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The log's records (a half-written last line, from a kill, is skipped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _smooth(values: list[float], weight: float = 0.9) -> list[float]:
    out, running = [], None
    for value in values:
        running = value if running is None else weight * running + (1 - weight) * value
        out.append(running)
    return out


METRIC_LABELS = {"top1": "top-1 accuracy", "cosine": "cosine to the teacher"}
"""How the curves name an objective's metric (others by their key)."""


def plot_curves(log: Path, png: Path, title: str, metric: str | None = None) -> list[str]:
    """Loss against step (left) and, where the objective reports one, its ``metric`` (right: the
    supervised ``top1``, distillation's ``cosine``): training (smoothed) and validation. Without a
    metric (MAE) the figure is the loss alone. Returns the panels' titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(log)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    names = ["loss"] if metric is None else ["loss", metric]
    figure, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for name, axis in zip(names, axes[0]):
        _plot_metric(axis, name, train, val)
    figure.suptitle(display_name(title))  # a dataset path may hold a file name that is not UTF-8
    figure.tight_layout()
    figure.savefig(png, dpi=100)
    plt.close(figure)
    return [METRIC_LABELS.get(name, name) for name in names]


def _plot_metric(axis: Any, name: str, train: list[dict[str, Any]], val: list[dict[str, Any]]) -> None:
    """One panel: ``name`` of the training steps (raw, for the loss, and smoothed) and of the validations."""
    label = METRIC_LABELS.get(name, name)
    train = [r for r in train if name in r]
    if train:
        steps, values = [r["step"] for r in train], [r[name] for r in train]
        if name == "loss":
            axis.plot(steps, values, color="tab:blue", alpha=0.25, linewidth=0.8)
        axis.plot(steps, _smooth(values), color="tab:blue", label="train batches (smoothed)")
    val = [r for r in val if name in r]
    if val:
        axis.plot([r["step"] for r in val], [r[name] for r in val], "o-", color="tab:orange", label="validation")
    axis.set(xlabel="step", ylabel=label, title=label)
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend()

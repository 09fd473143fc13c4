"""What a user watches: the per-step JSONL log and the loss / accuracy curves PNG.

Each line of ``metrics.jsonl`` is one record: ``{"kind": "train", "step": ...}`` after every step
(loss, accuracy on the step's images, lr, gradient norm, images, patches, utilisation, times,
throughput, MFU) and ``{"kind": "val", "step": ...}`` after each validation. On resume the lines
past the restored step are dropped, so the log reads as one uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def plot_curves(log: Path, png: Path, title: str) -> None:
    """Loss (left) and accuracy (right) against step: training (raw and smoothed) and validation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(log)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        steps = [r["step"] for r in train]
        loss_axis.plot(steps, [r["loss"] for r in train], color="tab:blue", alpha=0.25, linewidth=0.8)
        loss_axis.plot(steps, _smooth([r["loss"] for r in train]), color="tab:blue", label="train (smoothed)")
        if "accuracy" in train[0]:
            accuracy_axis.plot(
                steps, _smooth([r["accuracy"] for r in train]), color="tab:blue", label="train batches (smoothed)"
            )
    if val:
        steps = [r["step"] for r in val]
        loss_axis.plot(steps, [r["loss"] for r in val], "o-", color="tab:orange", label="validation")
        if "top1" in val[0]:
            accuracy_axis.plot(steps, [r["top1"] for r in val], "o-", color="tab:orange", label="validation top-1")
    loss_axis.set(xlabel="step", ylabel="loss", title="loss")
    accuracy_axis.set(xlabel="step", ylabel="accuracy", title="accuracy")
    for axis in (loss_axis, accuracy_axis):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(png, dpi=100)
    plt.close(figure)

"""Outputs of a probe run: results.json, a confusion-matrix PNG (Pillow only) and a markdown table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

__all__ = ["markdown_table", "save_confusion_png", "write_json"]

CELL = 36
TABLE_COLUMNS = ("features", "solver", "dim", "chosen", "val top-1", "test top-1", "top-5", "mean recall", "probe s")


def write_json(results: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(results, indent=2) + "\n")


def save_confusion_png(confusion: Sequence[Sequence[int]], classes: Sequence[str], path: Path, title: str) -> None:
    """Draw a (C, C) confusion matrix (rows true, columns predicted) as a PNG.

    Cells are shaded by row-normalised count (white 0 to dark blue 1) and show the count; rows are
    labelled ``index name``, columns by index. The picture is at least as wide as the title, so
    the whole title shows at any class count.
    """
    font = ImageFont.load_default()
    count = len(classes)
    row_labels = [f"{i} {name}"[:18] for i, name in enumerate(classes)]
    left = 8 + max(int(font.getlength(label)) for label in row_labels) + 8
    top = 44
    width = max(left + count * CELL + 8, 8 + int(font.getlength(title)) + 1 + 8)
    image = Image.new("RGB", (width, top + count * CELL + 24), "white")
    draw = ImageDraw.Draw(image)
    draw.text((8, 6), title, fill="black", font=font)
    draw.text((left, 24), "predicted ->", fill="black", font=font)
    for row, counts in enumerate(confusion):
        total = max(sum(counts), 1)
        y = top + row * CELL
        draw.text((8, y + CELL // 2 - 5), row_labels[row], fill="black", font=font)
        for column, value in enumerate(counts):
            x = left + column * CELL
            share = value / total
            shade = (int(255 - 220 * share), int(255 - 180 * share), int(255 - 90 * share))
            draw.rectangle((x, y, x + CELL - 1, y + CELL - 1), fill=shade, outline=(200, 200, 200))
            text = str(value)
            draw.text(
                (x + (CELL - font.getlength(text)) / 2, y + CELL // 2 - 5),
                text,
                fill="white" if share > 0.5 else "black",
                font=font,
            )
    for column in range(count):
        text = str(column)
        draw.text(
            (left + column * CELL + (CELL - font.getlength(text)) / 2, top + count * CELL + 6),
            text,
            fill="black",
            font=font,
        )
    image.save(path)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per probe run (a ``runs`` entry of results.json), with a header."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for run in rows:
        test = run["test"]
        chosen = ", ".join(f"{k}={v:g}" for k, v in run["chosen"].items())
        best_val = max(setting["val_top1"] for setting in run["validation_grid"])
        top5 = f"{test['top5']:.4f}" if "top5" in test else "-"
        cells = (
            run["features"],
            run["solver"],
            str(run["feature_dim"]),
            chosen,
            f"{best_val:.4f}",
            f"{test['top1']:.4f}",
            top5,
            f"{test['mean_per_class_recall']:.4f}",
            f"{run['timings']['probe_s']:.1f}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

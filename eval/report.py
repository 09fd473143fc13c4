"""Outputs of a probe run: results.json, a confusion-matrix PNG (Pillow only), a markdown table and
a row per feature view appended to a CSV file that collects runs."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

__all__ = [
    "ResultsCsvError",
    "append_csv_rows",
    "check_csv_header",
    "csv_columns",
    "markdown_table",
    "save_confusion_png",
    "speed_line",
    "write_json",
]

CELL = 36
TABLE_COLUMNS = ("features", "solver", "dim", "chosen", "val top-1", "test top-1", "top-5", "mean recall", "probe s")
"""The linear probe's columns; the logreg, kNN and images/s columns follow when the runs have them."""
CSV_LEADING = ("timestamp", "encoder", "dataset", "features", "short_side", "dtype", "device", "threads")


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
    """One line per probe run (a ``runs`` entry of results.json), with a header.

    The linear probe's columns come first; then logreg top-1, kNN top-1 per k and the encoder's
    images/s when any run has them ("-" in a run without, e.g. images/s of the pixels baseline).
    """
    logreg, ks, speed = _extra_columns(rows)
    columns = [
        *TABLE_COLUMNS,
        *(["logreg top-1"] if logreg else []),
        *(f"kNN k={k} top-1" for k in ks),
        *(["img/s"] if speed else []),
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for run in rows:
        test = run["test"]
        chosen = ", ".join(f"{k}={v:g}" for k, v in run["chosen"].items())
        best_val = max(setting["val_top1"] for setting in run["validation_grid"])
        top5 = f"{test['top5']:.4f}" if "top5" in test else "-"
        cells = [
            run["features"],
            run["solver"],
            str(run["feature_dim"]),
            chosen,
            f"{best_val:.4f}",
            f"{test['top1']:.4f}",
            top5,
            f"{test['mean_per_class_recall']:.4f}",
            f"{run['timings']['probe_s']:.1f}",
        ]
        if logreg:
            cells.append(f"{run['logreg']['test_top1']:.4f}" if run.get("logreg") else "-")
        knn = run.get("knn") or {"test_top1": {}}
        cells += [f"{knn['test_top1'][k]:.4f}" if k in knn["test_top1"] else "-" for k in ks]
        if speed:
            cells.append(f"{run['images_per_s']:.1f}" if run.get("images_per_s") is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _extra_columns(rows: Sequence[dict[str, Any]]) -> tuple[bool, list[str], bool]:
    """Whether any run has logreg figures, the kNN ks of the runs, whether any has images/s."""
    ks = next((list(run["knn"]["test_top1"]) for run in rows if run.get("knn")), [])
    return (
        any(run.get("logreg") for run in rows),
        ks,
        any(run.get("images_per_s") is not None for run in rows),
    )


def speed_line(speed: dict[str, Any]) -> str:
    """The images/s figure in words: how and on what it was measured."""
    threads = f"{speed['threads']} thread{'s' if speed['threads'] != 1 else ''}"
    side = "native size" if speed["short_side"] == 0 else f"short side {speed['short_side']} px"
    return (
        f"images/s: {speed['images_per_s']:.1f} (encoder forward only, {speed['dtype']}, {speed['device']}, "
        f"{threads}, {side}; {speed['images_timed']} test images, {speed['measured_on']})"
    )


# ---- the CSV that collects runs -------------------------------------------------------------------


class ResultsCsvError(ValueError):
    """An existing results CSV whose header is not the one this run writes."""


def csv_columns(knn_ks: Sequence[int]) -> list[str]:
    """The CSV's header: who and how, then the figures (a kNN column per k of ``--knn-k``)."""
    return [
        *CSV_LEADING,
        "linear_top1",
        "logreg_top1",
        *(f"knn{k}_top1" for k in knn_ks),
        "images_per_s",
    ]


def check_csv_header(path: Path, columns: Sequence[str]) -> bool:
    """Whether ``path`` already holds runs with this header (False: missing or empty, the header is to be written).

    Raises:
        ResultsCsvError: the file's header differs (other ``--knn-k``, an older layout, another file).
    """
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with path.open(newline="") as file:
        header = next(csv.reader(file), [])
    if header == list(columns):
        return True
    missing = [c for c in columns if c not in header]
    extra = [c for c in header if c not in columns]
    details = []
    if missing:
        details.append(f"it lacks {', '.join(missing)}")
    if extra:
        details.append(f"it has {', '.join(extra)}, which this run does not write")
    difference = "; ".join(details) or "its columns are in another order"
    raise ResultsCsvError(
        f"--results-csv {path}: its header is not this run's ({difference}); "
        "pass another --results-csv or move the file away"
    )


def append_csv_rows(path: Path, columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    """Append ``rows`` (dicts over ``columns``; None is an empty cell) to the CSV at ``path``, with the
    header first when the file is new. The header is checked again, just before writing.

    Raises:
        ResultsCsvError: see :func:`check_csv_header`.
    """
    exists = check_csv_header(path, columns)
    path.parent.mkdir(parents=True, exist_ok=True)
    if exists:
        with path.open("rb") as file:
            file.seek(-1, 2)
            ends_line = file.read(1) in (b"\n", b"\r")
    with path.open("a", newline="") as file:
        if exists and not ends_line:  # a file edited by hand may lack its last newline
            file.write("\n")
        writer = csv.DictWriter(file, fieldnames=list(columns), extrasaction="raise", lineterminator="\n")
        if not exists:
            writer.writeheader()
        writer.writerows(rows)

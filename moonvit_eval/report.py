"""Outputs of a probe run: results.json (:func:`probe_results`), a confusion-matrix PNG (Pillow
only), a markdown table and a row per feature view appended to a CSV file that collects runs."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import PIL
import torch
from PIL import Image, ImageDraw, ImageFont

import moonvit
from moonvit.cli import dtype_name
from moonvit.names import display_name

from .datasets import DEFAULT_FASHION_MNIST_DIR
from .logreg import sklearn_version

if TYPE_CHECKING:
    from .datasets import Dataset
    from .encoder import FrozenEncoder
    from .probe_run import ProbeRun

__all__ = [
    "ResultsCsvError",
    "append_csv_rows",
    "check_csv_header",
    "csv_columns",
    "csv_rows",
    "markdown_table",
    "probe_results",
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
    A run whose figures came from the cache has ``cached`` for its probe seconds.
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
            "cached" if run.get("cache_hit", {}).get("results") else f"{run['timings']['probe_s']:.1f}",
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


def probe_results(
    run: ProbeRun,
    dataset: Dataset,
    encoder: FrozenEncoder | None,
    runs: list[dict[str, Any]],
    data_warnings: Sequence[str],
    started: float,
) -> dict[str, Any]:
    """results.json of ``run``: its first view's figures on top, then every view's ``runs`` entry
    (:func:`moonvit_eval.probe_view.probe_view`), the dataset, encoder, preprocessing and settings, and
    ``interrupted_views``, the views of ``run`` that did not finish (``started``: the run's
    ``time.perf_counter()`` before the encoder was loaded)."""
    main_run = runs[0]
    speed = None
    if main_run["speed"] is not None:
        assert encoder is not None
        speed = {
            **main_run["speed"],
            "dtype": dtype_name(str(encoder.model.dtype).removeprefix("torch.")),
            "device": run.device,
            "threads": torch.get_num_threads(),
            "short_side": run.resize.short_side,
        }
    results = {
        "features": main_run["features"],
        "top1": main_run["test"]["top1"],
        **({"top5": main_run["test"]["top5"]} if "top5" in main_run["test"] else {}),
        "mean_per_class_recall": main_run["test"]["mean_per_class_recall"],
        "per_class_recall": main_run["test"]["per_class_recall"],
        "chosen": main_run["chosen"],
        "feature_dim": main_run["feature_dim"],
        "logreg_top1": None if main_run["logreg"] is None else main_run["logreg"]["test_top1"],
        "knn_top1": None if main_run["knn"] is None else main_run["knn"]["test_top1"],
        "images_per_s": main_run["images_per_s"],
        "speed": speed,
        "runs": runs,
        "dataset": {
            "spec": display_name(run.dataset),  # text of the CSV too: a folder name that is not UTF-8 escaped
            "classes": list(dataset.classes),
            "train_size": len(dataset.train),
            "test_size": len(dataset.test),
            "split_rule": dataset.split_rule,
            "data_dir": str(run.data_dir or DEFAULT_FASHION_MNIST_DIR) if run.dataset == "fashion-mnist" else None,
        },
        "encoder": None
        if encoder is None
        else {
            "source": encoder.source,
            "checkpoint_hash": encoder.hash,
            "dtype": str(encoder.model.dtype),
            "device": run.device,
            "num_parameters": encoder.num_parameters,
        },
        "preprocessing": {
            "resize": {
                "policy": "short side to N px, Pillow bicubic, aspect kept (0 = native)",
                "short_side": run.resize.short_side,
            },
            "processor": None if encoder is None else encoder.processor.to_dict(),
            "max_patches_per_pack": run.max_patches_per_pack,
            "standardize": "train mean / std per dimension",
            "l2_normalize": run.probe.l2_normalize,
        },
        "probe": dataclasses.asdict(run.probe),
        "knn": None
        if run.knn is None
        else {**dataclasses.asdict(run.knn), "metric": "cosine of L2-normalised features"},
        "logreg": None
        if run.logreg is None
        else {**dataclasses.asdict(run.logreg), "solver": "scikit-learn LogisticRegression, lbfgs, multinomial"},
        "data_warnings": data_warnings,
        "seed": run.seed,
        "device": run.device,
        "threads": torch.get_num_threads(),
        "command": run.command,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "pillow": PIL.__version__,
            "moonvit": moonvit.__version__,
            **({} if run.logreg is None else {"scikit-learn": sklearn_version()}),
        },
        "timings": {"total_s": time.perf_counter() - started},
    }
    results["results_csv"] = str(run.results_csv)
    results["interrupted_views"] = run.views[len(runs) :]
    return results


def csv_rows(results: dict[str, Any], columns: list[str], knn_ks: tuple[int, ...]) -> list[dict[str, Any]]:
    """A row of the results CSV per feature view of ``results`` (None: an empty cell; the pixels
    baseline has no short side, dtype or images/s)."""
    timestamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    encoder = results["encoder"]
    rows = []
    for run in results["runs"]:
        on_encoder = run["features"] != "pixels" and encoder is not None
        knn = run["knn"] or {"test_top1": {}}
        row = {
            "timestamp": timestamp,
            "encoder": encoder["source"] if encoder is not None else "none",
            "dataset": results["dataset"]["spec"],
            "features": run["features"],
            "short_side": results["preprocessing"]["resize"]["short_side"] if on_encoder else None,
            "dtype": dtype_name(encoder["dtype"].removeprefix("torch.")) if on_encoder else None,
            "device": results["device"],
            "threads": results["threads"],
            "linear_top1": _cell(run["test"]["top1"]),
            "logreg_top1": _cell(run["logreg"]["test_top1"]) if run["logreg"] else None,
            **{f"knn{k}_top1": _cell(knn["test_top1"].get(str(k))) for k in knn_ks},
            "images_per_s": None if run["images_per_s"] is None else f"{run['images_per_s']:.1f}",
        }
        rows.append({column: row[column] for column in columns})
    return rows


def _cell(value: float | None) -> str | None:
    return None if value is None else f"{value:.4f}"

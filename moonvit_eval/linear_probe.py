"""Linear-probe a frozen vision encoder (MoonViT or a ViT tower) on an image-classification dataset.

    python -m moonvit_eval.linear_probe --preset tiny --random-init --dataset fashion-mnist --out outputs/probe/tiny
    python -m moonvit_eval.linear_probe --checkpoint VIT_FOLDER --features cls --dataset digits
    python -m moonvit_eval.linear_probe --checkpoint DINOV2_FOLDER --features both --last-blocks 4 --dataset digits

A ViT tower's folder (ViT, DeiT, SigLIP, DINOv2) is probed at native resolution too, on the features
the ViT paper discusses: ``--features cls`` (the CLS row after the final norm), ``mean`` (the mean of
its patch rows) or ``both`` (the two concatenated), and ``pooled``, the tower's own pooled output
(SigLIP's MAP head, the CLS row after the norm for ViT and DINOv2). ``--last-blocks N`` takes the CLS
rows of the last N blocks, each after the final norm: ``--features both --last-blocks 4`` is DINOv2's
linear-evaluation features (four CLS rows and the mean of the last block's patch rows). See
:mod:`moonvit_eval.features` for every view.

Protocol: the frozen encoder's features are extracted once per split (eval mode, no augmentation,
packs of whole images under a patch budget) and cached on disk; they are standardised with
training statistics; a linear probe is selected on a seeded stratified 10% of train, refitted on
all of train and scored once on test (see :mod:`moonvit_eval.probe`). The same probe on raw pixels is the
baseline row unless ``--no-baseline``; its figures are cached too, keyed by everything they depend
on (:func:`baseline_key`), so a rerun on the same data with the same settings reuses them and says
so (``cache_hit``'s ``results``, ``cached`` in the table's seconds, a line on stderr).

On the same features, as DINOv3 and RADIO report them: the weighted kNN classifier (DINO's: cosine,
k of ``--knn-k``, T = 0.07, :mod:`moonvit_eval.knn`) and scikit-learn's logistic regression (C chosen on
the same 10%, :mod:`moonvit_eval.logreg`), each on test and on the validation cut; and the encoder's
images/s at the probe's resolution and dtype (forward only, timed while the test split is
extracted, or on its first 512 images when its features come from the cache).

Writes ``results.json``, ``confusion_<features>.png`` and ``table.md`` to ``--out``, prints the
table, and appends a row per feature view to ``--results-csv``. Every stage after the features
(the probe's search and refit, kNN, logistic regression) shows a tqdm bar, then a line with its
seconds. Ctrl-C after the first view finished still writes ``results.json`` and ``table.md`` with
the views that finished (``interrupted_views`` names the others; the CSV gains whole runs only) and
exits with status 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

import moonvit
from moonvit.cli import (
    ENCODER_OPTIONS,
    ArgumentParser,
    add_checkpoint_argument,
    add_shared_arguments,
    apply_threads,
    existing_folder,
    exit_on,
    fraction,
    non_negative_float,
    non_negative_int,
    one_line_warnings,
    output_dir,
    output_file,
    positive_float,
    positive_int,
)
from moonvit.model.attention import resolve_attn_implementation
from moonvit.runs import compute_facts

from .datasets import DEFAULT_FASHION_MNIST_DIR, Dataset, DatasetError, load_dataset
from .encoder import FrozenEncoder, load_frozen_encoder
from .features import FEATURE_VIEWS, PIXEL_SIDE, FeatureCache, ResizePolicy, available_views, missing_view_reason
from .knn import DEFAULT_KS, DEFAULT_TEMPERATURE, KnnConfig
from .logreg import DEFAULT_CS, DEFAULT_SEARCH_ROWS, LogRegConfig, sklearn_version
from .probe import ProbeConfig, ProbeDataWarning, check_probe_labels
from .probe_run import PROGRAM, ProbeArgumentError, ProbeRun
from .probe_view import SPEED_SAMPLE, WARMUP_IMAGES, probe_view
from .report import (
    ResultsCsvError,
    append_csv_rows,
    check_csv_header,
    csv_columns,
    csv_rows,
    markdown_table,
    probe_results,
    save_confusion_png,
    speed_line,
    write_json,
)

__all__ = [
    "SPEED_SAMPLE",
    "WARMUP_IMAGES",
    "KnnConfig",
    "LogRegConfig",
    "ProbeArgumentError",
    "ProbeConfig",
    "ProbeRun",
    "baseline_key",
    "build_parser",
    "csv_rows",
    "main",
    "probe_view",
    "run",
    "view_results",
]


def build_parser() -> argparse.ArgumentParser:
    defaults = ProbeConfig()
    parser = ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    encoder = parser.add_argument_group("encoder (frozen; any registered tower)")
    source = encoder.add_mutually_exclusive_group()
    add_checkpoint_argument(source)
    source.add_argument("--preset", choices=sorted(moonvit.PRESETS), help="a preset size (needs --random-init)")
    encoder.add_argument("--random-init", action="store_true", help="probe the preset with random weights (seeded)")
    add_shared_arguments(
        encoder,
        "dtype",
        *ENCODER_OPTIONS,
        "workers",
        "seed",
        dtype={"default": None, "help": "encoder dtype (default: the checkpoint's, fp32 for presets)"},
        workers={"what": "packs of images"},
        seed={"help": "seed of random init, splits and shuffles"},
    )
    data = parser.add_argument_group("data and preprocessing")
    data.add_argument("--dataset", required=True, help="fashion-mnist, digits or imagefolder:DIR")
    data.add_argument(
        "--data-dir", type=existing_folder, help=f"Fashion-MNIST IDX folder (default {DEFAULT_FASHION_MNIST_DIR})"
    )
    data.add_argument(
        "--short-side",
        type=non_negative_int,
        default=ResizePolicy().short_side,
        help="resize images (bicubic, aspect kept) to this short side before the processor; 0 = native "
        f"(default: {ResizePolicy().short_side})",
    )
    add_shared_arguments(data, "max_patches_per_pack", "side_limit_mode", "image_rule")
    features = parser.add_argument_group("features")
    features.add_argument(
        "--features",
        choices=FEATURE_VIEWS,
        default="mean",
        help="feature view (default: mean, the patch rows' mean; last4 needs an encoder of at least 4 blocks; cls, "
        "the CLS row after the final norm, and both, cls and mean concatenated, a tower with a CLS token (ViT, "
        "DeiT, DINOv2); pooled, the tower's pooled output (the CLS row, SigLIP's MAP head; not MoonViT's))",
    )
    features.add_argument(
        "--last-blocks",
        type=positive_int,
        default=1,
        metavar="N",
        help="with --features cls or both: the CLS rows of the last N blocks, each after the final norm, "
        "concatenated (both: then the mean of the last block's patch rows, DINOv2's linear-evaluation features "
        "at N = 4); the view is named cls-lastN / both-lastN (default: 1, the final CLS row)",
    )
    features.add_argument("--cache-dir", type=output_dir, help="feature cache (default: <out>/../feature-cache)")
    probe = parser.add_argument_group("linear probe")
    probe.add_argument(
        "--solver",
        choices=("adamw", "lbfgs"),
        default=defaults.solver,
        help=f"probe solver (default: {defaults.solver})",
    )
    probe.add_argument(
        "--lrs", type=positive_float, nargs="+", default=defaults.learning_rates, help="AdamW learning rates"
    )
    probe.add_argument(
        "--weight-decays", type=non_negative_float, nargs="+", default=defaults.weight_decays, help="AdamW decays"
    )
    probe.add_argument(
        "--epochs", type=positive_int, default=defaults.epochs, help=f"AdamW epochs (default: {defaults.epochs})"
    )
    probe.add_argument(
        "--min-steps",
        type=non_negative_int,
        default=defaults.min_steps,
        help=f"AdamW minimum steps (default: {defaults.min_steps})",
    )
    probe.add_argument(
        "--batch-size",
        type=positive_int,
        default=defaults.batch_size,
        help=f"AdamW batch size (default: {defaults.batch_size})",
    )
    probe.add_argument(
        "--Cs",
        type=positive_float,
        nargs="+",
        default=defaults.inverse_regularization,
        help="L-BFGS inverse L2 strengths C",
    )
    probe.add_argument(
        "--val-fraction",
        type=fraction,
        default=defaults.val_fraction,
        help=f"selection share of train (default: {defaults.val_fraction})",
    )
    probe.add_argument("--l2-normalize", action="store_true", help="L2-normalise features before standardising")
    probe.add_argument("--no-baseline", action="store_true", help="skip the raw-pixels baseline row")
    knn = parser.add_argument_group("kNN classifier (DINO's weighted vote over cosine neighbours)")
    knn.add_argument(
        "--knn-k",
        type=positive_int,
        nargs="+",
        default=list(DEFAULT_KS),
        metavar="K",
        help=f"neighbour counts, one figure each (default: {' '.join(map(str, DEFAULT_KS))})",
    )
    knn.add_argument(
        "--knn-temperature",
        type=positive_float,
        default=DEFAULT_TEMPERATURE,
        metavar="T",
        help=f"T of the vote weights exp(sim / T) (default: {DEFAULT_TEMPERATURE})",
    )
    knn.add_argument("--no-knn", action="store_true", help="skip the kNN classifier (its CSV cells stay empty)")
    logreg = parser.add_argument_group("logistic regression (scikit-learn, lbfgs, multinomial)")
    logreg.add_argument(
        "--logreg-Cs",
        type=positive_float,
        nargs="+",
        default=list(DEFAULT_CS),
        metavar="C",
        help=f"inverse L2 strengths to choose from (default: {' '.join(f'{c:g}' for c in DEFAULT_CS)})",
    )
    logreg.add_argument(
        "--logreg-max-iter",
        type=positive_int,
        default=LogRegConfig().max_iter,
        metavar="N",
        help=f"lbfgs iterations per fit (default: {LogRegConfig().max_iter})",
    )
    logreg.add_argument(
        "--logreg-search-rows",
        type=non_negative_int,
        default=DEFAULT_SEARCH_ROWS,
        metavar="N",
        help="at most this many training rows (stratified sample) in the C search, 0 = all; the refit uses all "
        f"with the chosen C (default: {DEFAULT_SEARCH_ROWS})",
    )
    logreg.add_argument(
        "--no-logreg", action="store_true", help="skip the logistic regression (its CSV cell stays empty)"
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--out",
        type=output_dir,
        default=Path("outputs/linear_probe"),
        help="output folder (default: outputs/linear_probe)",
    )
    output.add_argument(
        "--results-csv",
        type=output_file,
        metavar="PATH",
        help="CSV to append a row per feature view to, header first when new; an existing file with "
        "another header is refused (default: <out>/../probe_results.csv, outputs/probe_results.csv "
        "for the default --out)",
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    with one_line_warnings(), exit_on(parser, ResultsCsvError):
        try:
            return run(ProbeRun.from_args(args, argv))
        except ProbeArgumentError as error:
            parser.error(str(error))


def run(probe: ProbeRun) -> dict[str, Any]:
    """The probe ``probe`` asks for; data and encoder are checked before any feature is extracted.

    Raises:
        ProbeArgumentError: a dataset, checkpoint or feature view the probe cannot use (the command
            reports it as a usage error, before any work).
    """
    apply_threads(probe.threads)
    torch.manual_seed(probe.seed)
    try:
        dataset = load_dataset(probe.dataset, probe.data_dir, seed=probe.seed)
        data_warnings = [
            *dataset.notes,
            *check_probe_labels(
                dataset.train.labels, dataset.test.labels, dataset.classes, probe.probe.val_fraction, probe.seed
            ),
        ]
    except (DatasetError, ValueError) as error:
        raise ProbeArgumentError(f"cannot probe --dataset {probe.dataset}: {error}") from error
    columns = csv_columns(probe.knn_columns)
    check_csv_header(probe.results_csv, columns)  # refused before any work, not after it
    for message in data_warnings:
        warnings.warn(message, ProbeDataWarning, stacklevel=1)
    start = time.perf_counter()
    encoder = None
    if probe.features != "pixels":
        try:
            encoder = load_frozen_encoder(
                checkpoint=probe.checkpoint,
                preset=probe.preset,
                random_init=probe.random_init,
                seed=probe.seed,
                dtype=probe.dtype,
                device=probe.device,
                side_limit_mode=probe.side_limit_mode,
                image_rule=probe.image_rule,
                attn=probe.attn,
            )
        except moonvit.CheckpointError as error:
            raise ProbeArgumentError(f"cannot load --checkpoint {probe.checkpoint}: {error}") from error
        # a backend that cannot run on this device in this dtype: one line (exit_on), before any feature
        resolve_attn_implementation(probe.attn, encoder.model.device, encoder.model.dtype)
        if probe.view not in available_views(encoder.model, probe.last_blocks):
            raise ProbeArgumentError(missing_view_reason(encoder.model, probe.view))
    out = probe.out
    out.mkdir(parents=True, exist_ok=True)
    cache = FeatureCache(probe.cache_dir)
    views = probe.views
    runs: list[dict[str, Any]] = []
    for view in views:
        try:
            runs.append(view_results(view, probe, dataset, encoder, cache))
        except KeyboardInterrupt:
            # Ctrl-C: the views that finished are written below; with none, there is nothing to keep
            if not runs:
                print(f"interrupted during the {view} view; nothing was written to {out}", file=sys.stderr)
                raise SystemExit(130) from None
            break
    results = probe_results(probe, dataset, encoder, runs, data_warnings, start)
    unfinished = results["interrupted_views"]
    write_json(results, out / "results.json")
    speed = results["speed"]
    table = markdown_table(runs) + ("" if speed is None else "\n\n" + speed_line(speed))
    (out / "table.md").write_text(table + "\n")
    print(table)
    if unfinished:
        # the CSV only gains the rows of whole runs
        print(
            f"interrupted during the {unfinished[0]} view: {out / 'results.json'} holds the views that finished "
            f"({', '.join(run['features'] for run in runs)}); nothing was appended to {probe.results_csv}",
            file=sys.stderr,
        )
        raise SystemExit(130)
    append_csv_rows(probe.results_csv, columns, csv_rows(results, columns, probe.knn_columns))
    print(f"{len(runs)} row{'s' if len(runs) != 1 else ''} appended to {probe.results_csv}")
    return results


RESULTS_FORMAT = 1
"""The layout of the baseline's cached figures; a change to it misses every older record."""


def baseline_key(probe: ProbeRun, dataset: Dataset) -> dict[str, Any]:
    """What the raw-pixels view's figures depend on: the data (both splits' images and labels, the
    classes, the side files are resized to), the three classifiers' settings (grids, seeds, epochs,
    the selection share, standardisation), and what the fits compute with (threads, torch, the
    device, the CPU's kernel level; NumPy, scikit-learn, this package)."""
    return {
        "results": "pixels",
        "results_format": RESULTS_FORMAT,
        "dataset": dataset.name,
        "classes": list(dataset.classes),
        "train": dataset.train.fingerprint(),
        "test": dataset.test.fingerprint(),
        "pixel_side": PIXEL_SIDE,
        "probe": dataclasses.asdict(probe.probe),
        "knn": None if probe.knn is None else dataclasses.asdict(probe.knn),
        "logreg": None if probe.logreg is None else dataclasses.asdict(probe.logreg),
        "compute": compute_facts(torch.device(probe.device)),
        "versions": {
            "numpy": np.__version__,
            "scikit-learn": None if probe.logreg is None else sklearn_version(),
            "moonvit": moonvit.__version__,
        },
    }


def view_results(
    view: str, probe: ProbeRun, dataset: Dataset, encoder: FrozenEncoder | None, cache: FeatureCache
) -> dict[str, Any]:
    """The ``runs`` entry of ``view`` (:func:`~eval.probe_view.probe_view`). The raw-pixels view's
    comes from ``cache`` when a run with the same :func:`baseline_key` stored it (its confusion
    PNG drawn again, its warnings given again); otherwise it is fitted and stored, with the
    warnings its fit gave. Its ``cache_hit`` says which (``results``)."""
    if view != "pixels":
        return probe_view(view, probe, dataset, encoder, cache)
    key = baseline_key(probe, dataset)
    stored = cache.load_record(key)
    if stored is not None:
        return _reused_baseline(stored, probe, dataset)
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            entry = probe_view(view, probe, dataset, encoder, cache)
    finally:
        for warning in caught:  # shown as they would have been, and kept for a rerun
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    entry = {**entry, "cache_hit": {**entry["cache_hit"], "results": False}}
    cache.save_record(key, {"entry": entry, "warnings": [str(warning.message) for warning in caught]})
    return entry


def _reused_baseline(stored: dict[str, Any], probe: ProbeRun, dataset: Dataset) -> dict[str, Any]:
    """The stored raw-pixels entry for this run: its confusion PNG in ``--out``, its warnings and a
    line on stderr saying where its figures come from."""
    entry = {**stored["entry"], "cache_hit": {"results": True}}
    title = f"{dataset.name} / pixels / test top-1 {entry['test']['top1']:.4f}"  # probe_view's title
    save_confusion_png(entry["confusion"], dataset.classes, probe.out / entry["confusion_png"], title)
    fitted = ", ".join(
        stage for stage, figures in (("kNN", entry["knn"]), ("logistic regression", entry["logreg"])) if figures
    )
    print(
        f"{dataset.name} pixels: linear probe{', ' + fitted if fitted else ''} reused from the cache "
        "(the same data and settings)",
        file=sys.stderr,
        flush=True,
    )
    for message in stored["warnings"]:
        warnings.warn(message, stacklevel=1)
    return entry


if __name__ == "__main__":
    main()

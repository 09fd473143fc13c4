"""Linear-probe a frozen MoonViT encoder on an image-classification dataset.

    python -m eval.linear_probe --preset tiny --random-init --dataset fashion-mnist --out outputs/probe/tiny

Protocol: the frozen encoder's features are extracted once per split (eval mode, no augmentation,
packs of whole images under a patch budget) and cached on disk; they are standardised with
training statistics; a linear probe is selected on a seeded stratified 10% of train, refitted on
all of train and scored once on test (see :mod:`eval.probe`). The same probe on raw pixels is the
baseline row unless ``--no-baseline``.

On the same features, as DINOv3 and RADIO report them: the weighted kNN classifier (DINO's: cosine,
k of ``--knn-k``, T = 0.07, :mod:`eval.knn`) and scikit-learn's logistic regression (C chosen on
the same 10%, :mod:`eval.logreg`), each on test and on the validation cut; and the encoder's
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
import datetime
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import torch

import moonvit
from moonvit.cli import (
    add_budget_argument,
    add_checkpoint_argument,
    add_device_argument,
    add_dtype_argument,
    add_seed_argument,
    add_side_limit_argument,
    add_threads_argument,
    add_workers_argument,
    apply_threads,
    dtype_name,
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
    torch_dtype,
)
from moonvit.names import display_name

from .datasets import DEFAULT_FASHION_MNIST_DIR, Dataset, DatasetError, load_dataset
from .encoder import FrozenEncoder, load_frozen_encoder
from .features import (
    FEATURE_VIEWS,
    FeatureCache,
    ForwardTiming,
    ResizePolicy,
    available_views,
    extract_features,
    split_features,
)
from .knn import DEFAULT_KS, DEFAULT_TEMPERATURE, KnnConfig, run_knn
from .logreg import DEFAULT_CS, DEFAULT_SEARCH_ROWS, LogRegConfig, run_logreg, sklearn_version
from .metrics import classification_metrics
from .probe import ProbeConfig, ProbeDataWarning, check_probe_labels, run_probe
from .report import (
    ResultsCsvError,
    append_csv_rows,
    check_csv_header,
    csv_columns,
    markdown_table,
    save_confusion_png,
    speed_line,
    write_json,
)

SPEED_SAMPLE = 512
"""Test images the encoder's images/s is measured on when the test features come from the cache."""
WARMUP_IMAGES = 32
"""Test images of the untimed forward before images/s is measured (allocations, kernel choice)."""


def build_parser() -> argparse.ArgumentParser:
    defaults = ProbeConfig()
    parser = argparse.ArgumentParser(prog="python -m eval.linear_probe", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    add_checkpoint_argument(source)
    source.add_argument("--preset", choices=sorted(moonvit.PRESETS), help="a preset size (needs --random-init)")
    parser.add_argument("--random-init", action="store_true", help="probe the preset with random weights (seeded)")
    parser.add_argument("--dataset", required=True, help="fashion-mnist, digits or imagefolder:DIR")
    parser.add_argument(
        "--data-dir", type=existing_folder, help=f"Fashion-MNIST IDX folder (default {DEFAULT_FASHION_MNIST_DIR})"
    )
    parser.add_argument(
        "--features",
        choices=FEATURE_VIEWS,
        default="mean",
        help="feature view (default: mean; last4 needs an encoder of at least 4 blocks)",
    )
    parser.add_argument(
        "--out",
        type=output_dir,
        default=Path("outputs/linear_probe"),
        help="output folder (default: outputs/linear_probe)",
    )
    parser.add_argument("--cache-dir", type=output_dir, help="feature cache (default: <out>/../feature-cache)")
    add_device_argument(parser)
    add_dtype_argument(parser, None, "encoder dtype (default: the checkpoint's, fp32 for presets)")
    add_threads_argument(parser)
    add_workers_argument(parser, "packs of images")
    add_seed_argument(parser, "seed of random init, splits and shuffles")
    parser.add_argument(
        "--short-side",
        type=non_negative_int,
        default=ResizePolicy().short_side,
        help="resize images (bicubic, aspect kept) to this short side before the processor; 0 = native "
        f"(default: {ResizePolicy().short_side})",
    )
    add_budget_argument(parser)
    add_side_limit_argument(parser)
    parser.add_argument(
        "--solver",
        choices=("adamw", "lbfgs"),
        default=defaults.solver,
        help=f"probe solver (default: {defaults.solver})",
    )
    parser.add_argument(
        "--lrs", type=positive_float, nargs="+", default=defaults.learning_rates, help="AdamW learning rates"
    )
    parser.add_argument(
        "--weight-decays", type=non_negative_float, nargs="+", default=defaults.weight_decays, help="AdamW decays"
    )
    parser.add_argument(
        "--epochs", type=positive_int, default=defaults.epochs, help=f"AdamW epochs (default: {defaults.epochs})"
    )
    parser.add_argument(
        "--min-steps",
        type=non_negative_int,
        default=defaults.min_steps,
        help=f"AdamW minimum steps (default: {defaults.min_steps})",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=defaults.batch_size,
        help=f"AdamW batch size (default: {defaults.batch_size})",
    )
    parser.add_argument(
        "--Cs",
        type=positive_float,
        nargs="+",
        default=defaults.inverse_regularization,
        help="L-BFGS inverse L2 strengths C",
    )
    parser.add_argument(
        "--val-fraction",
        type=fraction,
        default=defaults.val_fraction,
        help=f"selection share of train (default: {defaults.val_fraction})",
    )
    parser.add_argument("--l2-normalize", action="store_true", help="L2-normalise features before standardising")
    parser.add_argument("--no-baseline", action="store_true", help="skip the raw-pixels baseline row")
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
    parser.add_argument(
        "--results-csv",
        type=output_file,
        metavar="PATH",
        help="CSV to append a row per feature view to, header first when new; an existing file with "
        "another header is refused (default: <out>/../probe_results.csv, outputs/probe_results.csv "
        "for the default --out)",
    )
    return parser


def probe_view(
    view: str,
    dataset: Dataset,
    encoder: FrozenEncoder | None,
    config: ProbeConfig,
    cache: FeatureCache,
    resize: ResizePolicy,
    max_patches_per_pack: int,
    device: str,
    out: Path,
    knn: KnnConfig | None = None,
    logreg: LogRegConfig | None = None,
    workers: int = 0,
) -> dict[str, Any]:
    """Features, probe, metrics and confusion PNG of one view, and on the same features the kNN
    classifier and the logistic regression (when configured) and, for an encoder view, the
    encoder's images/s (``speed``: how it was measured): a ``runs`` entry of results.json.
    ``workers`` threads run the processor ahead of the encoder (the same features as 0).

    Each stage after the features shows a tqdm bar and then a line with its seconds (stderr)."""
    label = f"{dataset.name} {view}"
    start = time.perf_counter()
    features, hits = {}, {}
    timing = ForwardTiming() if view != "pixels" and encoder is not None else None
    for name, split in (("train", dataset.train), ("test", dataset.test)):
        if name == "test" and timing is not None:
            assert encoder is not None
            _warm_up(encoder, dataset, resize, max_patches_per_pack)
        features[name], hits[name] = split_features(
            encoder,
            split,
            view,
            dataset=dataset.name,
            split_name=name,
            resize=resize,
            cache=cache,
            max_patches_per_pack=max_patches_per_pack,
            timing=timing if name == "test" else None,
            workers=workers,
        )
    features_s = time.perf_counter() - start
    speed = None
    if timing is not None:
        assert encoder is not None
        measured_on = "timed while the test split's features were extracted"
        if not timing.seconds:  # the test features came from the cache: time a fixed sample instead
            _time_sample(encoder, dataset, view, resize, max_patches_per_pack, timing)
            measured_on = "timed on the split's first images, as its features came from the cache"
        speed = {**timing.summary(), "measured_on": measured_on}
    start = time.perf_counter()
    train_y = torch.from_numpy(dataset.train.labels).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeDataWarning)  # said once, before any work
        result = run_probe(
            features["train"].to(device),
            train_y,
            features["test"].to(device),
            len(dataset.classes),
            config,
            progress=f"{label}: linear probe",
        )
    probe_s = time.perf_counter() - start
    _stage_done(label, "linear probe", probe_s, f"chosen {result.chosen}")
    metrics = classification_metrics(result.test_logits, torch.from_numpy(dataset.test.labels))
    confusion = metrics.pop("confusion")
    picture = out / f"confusion_{view}.png"
    title = f"{dataset.name} / {view} / test top-1 {metrics['top1']:.4f}"
    save_confusion_png(confusion, dataset.classes, picture, title)
    test_y = torch.from_numpy(dataset.test.labels)
    knn_figures = None
    if knn is not None:
        start = time.perf_counter()
        found = run_knn(
            features["train"].to(device),
            train_y,
            features["test"].to(device),
            test_y,
            len(dataset.classes),
            knn,
            progress=f"{label}: kNN",
        )
        knn_s = time.perf_counter() - start
        knn_figures = {
            "test_top1": {str(k): v for k, v in found.test_top1.items()},
            "val_top1": {str(k): v for k, v in found.val_top1.items()},
            "effective_k": {str(k): v for k, v in found.effective_k.items()},
            "sizes": found.sizes,
            "knn_s": knn_s,
        }
        _stage_done(label, "kNN", knn_s, f"k={', '.join(map(str, knn.ks))}")
    logreg_figures = None
    if logreg is not None:
        start = time.perf_counter()
        fitted = run_logreg(
            features["train"],
            train_y.cpu(),
            features["test"],
            test_y,
            logreg,
            threads=torch.get_num_threads(),
            progress=f"{label}: logistic regression",
        )
        logreg_s = time.perf_counter() - start
        logreg_figures = {
            "chosen": {"C": fitted.chosen_C},
            "validation_grid": fitted.grid,
            "test_top1": fitted.test_top1,
            "refit": fitted.refit,
            "sizes": fitted.sizes,
            "logreg_s": logreg_s,
        }
        _stage_done(
            label,
            "logistic regression",
            logreg_s,
            f"C={fitted.chosen_C:g} chosen on {fitted.sizes['select_train']} rows and refitted as it is on "
            f"{fitted.refit['rows']}: scikit-learn's C weighs the sum of the losses, a penalty per row "
            f"{fitted.refit['rows'] / fitted.sizes['select_train']:.2g}x weaker on the refit's rows",
        )
        if not fitted.refit["converged"]:
            warnings.warn(
                f"logistic regression on {view}: lbfgs stopped at --logreg-max-iter {logreg.max_iter} before "
                f"converging (C={fitted.chosen_C:g}); its top-1 may be a little off",
                stacklevel=1,
            )
    return {
        "features": view,
        "solver": config.solver,
        "feature_dim": features["train"].shape[1],
        "chosen": result.chosen,
        "validation_grid": result.grid,
        "edge_warnings": result.edge_warnings,
        "sizes": result.sizes,
        "test": {**metrics, "per_class_recall": dict(zip(dataset.classes, metrics["per_class_recall"]))},
        "confusion": confusion,
        "confusion_png": picture.name,
        "logreg": logreg_figures,
        "knn": knn_figures,
        "images_per_s": None if speed is None else speed["images_per_s"],
        "speed": speed,
        "cache_hit": hits,
        "timings": {"features_s": features_s, "probe_s": probe_s},
    }


def _stage_done(label: str, stage: str, seconds: float, detail: str) -> None:
    """One line on stderr, beside the tqdm bars, for a finished stage: how long it took."""
    print(f"{label}: {stage} took {seconds:.1f} s ({detail})", file=sys.stderr, flush=True)


def _warm_up(encoder: FrozenEncoder, dataset: Dataset, resize: ResizePolicy, max_patches_per_pack: int) -> None:
    """An untimed forward of a few test images, so allocations and kernel choice stay out of images/s."""
    images = dataset.test.images[:WARMUP_IMAGES]
    extract_features(
        encoder.model,
        encoder.processor,
        images,
        ["mean"],
        resize=resize,
        max_patches_per_pack=max_patches_per_pack,
        total=len(images),
        description=f"{dataset.name} warm-up",
    )


def _time_sample(
    encoder: FrozenEncoder,
    dataset: Dataset,
    view: str,
    resize: ResizePolicy,
    max_patches_per_pack: int,
    timing: ForwardTiming,
) -> None:
    """Time the encoder on the first :data:`SPEED_SAMPLE` test images (their features are thrown away)."""
    images = dataset.test.images[:SPEED_SAMPLE]
    extract_features(
        encoder.model,
        encoder.processor,
        images,
        [view],
        resize=resize,
        max_patches_per_pack=max_patches_per_pack,
        total=len(images),
        description=f"{dataset.name} test images/s",
        timing=timing,
    )


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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.features != "pixels" and args.checkpoint is None and args.preset is None:
        parser.error(f"--features {args.features} needs an encoder: --checkpoint PATH or --preset NAME --random-init")
    if args.preset is not None and not args.random_init:
        parser.error(f"--preset {args.preset} has no trained weights; add --random-init")
    if not args.no_logreg and sklearn_version() is None:
        parser.error("the logistic regression needs scikit-learn (pip install scikit-learn); or pass --no-logreg")
    with one_line_warnings(), exit_on(parser, ResultsCsvError):
        return run(args, argv, parser)


def run(args: argparse.Namespace, argv: list[str] | None, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The probe of the parsed command line; data and encoder are checked before any feature is extracted."""
    apply_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        dataset = load_dataset(args.dataset, args.data_dir, seed=args.seed)
        resize = ResizePolicy(args.short_side)
        data_warnings = [
            *dataset.notes,
            *check_probe_labels(
                dataset.train.labels, dataset.test.labels, dataset.classes, args.val_fraction, args.seed
            ),
        ]
    except (DatasetError, ValueError) as error:
        parser.error(f"cannot probe --dataset {args.dataset}: {error}")
    knn_ks = tuple(sorted(set(args.knn_k)))
    csv_path = args.results_csv if args.results_csv is not None else args.out.resolve().parent / "probe_results.csv"
    columns = csv_columns(knn_ks)
    check_csv_header(csv_path, columns)  # refused before any work, not after it
    for message in data_warnings:
        warnings.warn(message, ProbeDataWarning, stacklevel=1)
    start = time.perf_counter()
    encoder = None
    if args.features != "pixels":
        dtype = torch_dtype(args.dtype) if args.dtype else None
        try:
            encoder = load_frozen_encoder(
                checkpoint=args.checkpoint,
                preset=args.preset,
                random_init=args.random_init,
                seed=args.seed,
                dtype=dtype,
                device=args.device,
                side_limit_mode=args.side_limit_mode,
            )
        except moonvit.CheckpointError as error:
            parser.error(f"cannot load --checkpoint {args.checkpoint}: {error}")
        given = available_views(encoder.model)
        if args.features not in given:
            parser.error(
                f"--features {args.features} needs an encoder of at least 4 blocks; this one has "
                f"{encoder.model.config.num_hidden_layers} (it gives {', '.join(given)})"
            )
    config = ProbeConfig(
        solver=args.solver,
        learning_rates=tuple(args.lrs),
        weight_decays=tuple(args.weight_decays),
        epochs=args.epochs,
        min_steps=args.min_steps,
        batch_size=args.batch_size,
        inverse_regularization=tuple(args.Cs),
        val_fraction=args.val_fraction,
        l2_normalize=args.l2_normalize,
        seed=args.seed,
    )
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    cache = FeatureCache(args.cache_dir if args.cache_dir is not None else out.resolve().parent / "feature-cache")
    knn = None if args.no_knn else KnnConfig(knn_ks, args.knn_temperature, args.val_fraction, args.seed)
    logreg = (
        None
        if args.no_logreg
        else LogRegConfig(
            inverse_regularization=tuple(sorted(set(args.logreg_Cs))),
            max_iter=args.logreg_max_iter,
            max_search_rows=args.logreg_search_rows or None,
            val_fraction=args.val_fraction,
            seed=args.seed,
            l2_normalize=args.l2_normalize,
        )
    )
    views = [args.features] + ([] if args.no_baseline or args.features == "pixels" else ["pixels"])
    runs: list[dict[str, Any]] = []
    for view in views:
        try:
            runs.append(
                probe_view(
                    view,
                    dataset,
                    encoder,
                    config,
                    cache,
                    resize,
                    args.max_patches_per_pack,
                    args.device,
                    out,
                    knn,
                    logreg,
                    args.workers,
                )
            )
        except KeyboardInterrupt:
            # Ctrl-C: the views that finished are written below; with none, there is nothing to keep
            if not runs:
                print(f"interrupted during the {view} view; nothing was written to {out}", file=sys.stderr)
                raise SystemExit(130) from None
            break
    unfinished = views[len(runs) :]
    main_run = runs[0]
    speed = None
    if main_run["speed"] is not None:
        assert encoder is not None
        speed = {
            **main_run["speed"],
            "dtype": dtype_name(str(encoder.model.dtype).removeprefix("torch.")),
            "device": args.device,
            "threads": torch.get_num_threads(),
            "short_side": resize.short_side,
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
            "spec": display_name(args.dataset),  # text of the CSV too: a folder name that is not UTF-8 escaped
            "classes": list(dataset.classes),
            "train_size": len(dataset.train),
            "test_size": len(dataset.test),
            "split_rule": dataset.split_rule,
            "data_dir": str(args.data_dir or DEFAULT_FASHION_MNIST_DIR) if args.dataset == "fashion-mnist" else None,
        },
        "encoder": None
        if encoder is None
        else {
            "source": encoder.source,
            "checkpoint_hash": encoder.hash,
            "dtype": str(encoder.model.dtype),
            "device": args.device,
            "num_parameters": sum(p.numel() for p in encoder.model.parameters()),
        },
        "preprocessing": {
            "resize": {
                "policy": "short side to N px, Pillow bicubic, aspect kept (0 = native)",
                "short_side": resize.short_side,
            },
            "processor": None if encoder is None else encoder.processor.to_dict(),
            "max_patches_per_pack": args.max_patches_per_pack,
            "standardize": "train mean / std per dimension",
            "l2_normalize": args.l2_normalize,
        },
        "probe": dataclasses.asdict(config),
        "knn": None if knn is None else {**dataclasses.asdict(knn), "metric": "cosine of L2-normalised features"},
        "logreg": None
        if logreg is None
        else {**dataclasses.asdict(logreg), "solver": "scikit-learn LogisticRegression, lbfgs, multinomial"},
        "data_warnings": data_warnings,
        "seed": args.seed,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "command": " ".join(["python -m eval.linear_probe", *(argv if argv is not None else sys.argv[1:])]),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "pillow": PIL.__version__,
            "moonvit": moonvit.__version__,
            **({} if logreg is None else {"scikit-learn": sklearn_version()}),
        },
        "timings": {"total_s": time.perf_counter() - start},
    }
    results["results_csv"] = str(csv_path)
    results["interrupted_views"] = unfinished
    write_json(results, out / "results.json")
    table = markdown_table(runs) + ("" if speed is None else "\n\n" + speed_line(speed))
    (out / "table.md").write_text(table + "\n")
    print(table)
    if unfinished:
        # the CSV only gains the rows of whole runs
        print(
            f"interrupted during the {unfinished[0]} view: {out / 'results.json'} holds the views that finished "
            f"({', '.join(run['features'] for run in runs)}); nothing was appended to {csv_path}",
            file=sys.stderr,
        )
        raise SystemExit(130)
    append_csv_rows(csv_path, columns, csv_rows(results, columns, knn_ks))
    print(f"{len(runs)} row{'s' if len(runs) != 1 else ''} appended to {csv_path}")
    return results


if __name__ == "__main__":
    main()

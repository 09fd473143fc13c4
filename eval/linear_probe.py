"""Linear-probe a frozen MoonViT encoder on an image-classification dataset.

    python -m eval.linear_probe --preset tiny --random-init --dataset fashion-mnist --out outputs/probe/tiny

Protocol: the frozen encoder's features are extracted once per split (eval mode, no augmentation,
packs of whole images under a patch budget) and cached on disk; they are standardised with
training statistics; a linear probe is selected on a seeded stratified 10% of train, refitted on
all of train and scored once on test (see :mod:`eval.probe`). The same probe on raw pixels is the
baseline row unless ``--no-baseline``. Writes ``results.json``, ``confusion_<features>.png`` and
``table.md`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    apply_threads,
    existing_folder,
    exit_on,
    fraction,
    non_negative_float,
    non_negative_int,
    one_line_warnings,
    output_dir,
    positive_float,
    positive_int,
    torch_dtype,
)

from .datasets import DEFAULT_FASHION_MNIST_DIR, Dataset, DatasetError, load_dataset
from .encoder import FrozenEncoder, load_frozen_encoder
from .features import FEATURE_VIEWS, FeatureCache, ResizePolicy, available_views, split_features
from .metrics import classification_metrics
from .probe import ProbeConfig, ProbeDataWarning, check_probe_labels, run_probe
from .report import markdown_table, save_confusion_png, write_json


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
) -> dict[str, Any]:
    """Features, probe, metrics and confusion PNG of one view: a ``runs`` entry of results.json."""
    start = time.perf_counter()
    features, hits = {}, {}
    for name, split in (("train", dataset.train), ("test", dataset.test)):
        features[name], hits[name] = split_features(
            encoder,
            split,
            view,
            dataset=dataset.name,
            split_name=name,
            resize=resize,
            cache=cache,
            max_patches_per_pack=max_patches_per_pack,
        )
    features_s = time.perf_counter() - start
    start = time.perf_counter()
    train_y = torch.from_numpy(dataset.train.labels).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeDataWarning)  # said once, before any work
        result = run_probe(
            features["train"].to(device), train_y, features["test"].to(device), len(dataset.classes), config
        )
    probe_s = time.perf_counter() - start
    metrics = classification_metrics(result.test_logits, torch.from_numpy(dataset.test.labels))
    confusion = metrics.pop("confusion")
    picture = out / f"confusion_{view}.png"
    title = f"{dataset.name} / {view} / test top-1 {metrics['top1']:.4f}"
    save_confusion_png(confusion, dataset.classes, picture, title)
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
        "cache_hit": hits,
        "timings": {"features_s": features_s, "probe_s": probe_s},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.features != "pixels" and args.checkpoint is None and args.preset is None:
        parser.error(f"--features {args.features} needs an encoder: --checkpoint PATH or --preset NAME --random-init")
    if args.preset is not None and not args.random_init:
        parser.error(f"--preset {args.preset} has no trained weights; add --random-init")
    with one_line_warnings(), exit_on(parser):
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
    views = [args.features] + ([] if args.no_baseline or args.features == "pixels" else ["pixels"])
    runs = [
        probe_view(view, dataset, encoder, config, cache, resize, args.max_patches_per_pack, args.device, out)
        for view in views
    ]
    main_run = runs[0]
    results = {
        "features": main_run["features"],
        "top1": main_run["test"]["top1"],
        **({"top5": main_run["test"]["top5"]} if "top5" in main_run["test"] else {}),
        "mean_per_class_recall": main_run["test"]["mean_per_class_recall"],
        "per_class_recall": main_run["test"]["per_class_recall"],
        "chosen": main_run["chosen"],
        "feature_dim": main_run["feature_dim"],
        "runs": runs,
        "dataset": {
            "spec": args.dataset,
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
        "data_warnings": data_warnings,
        "seed": args.seed,
        "threads": torch.get_num_threads(),
        "command": " ".join(["python -m eval.linear_probe", *(argv if argv is not None else sys.argv[1:])]),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "pillow": PIL.__version__,
            "moonvit": moonvit.__version__,
        },
        "timings": {"total_s": time.perf_counter() - start},
    }
    write_json(results, out / "results.json")
    table = markdown_table(runs)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return results


if __name__ == "__main__":
    main()

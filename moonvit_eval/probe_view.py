"""One feature view of a probe run: its features (cached), the linear probe, its metrics and
confusion PNG, and on the same features the kNN classifier, the logistic regression and the
encoder's images/s; each stage after the features shows a tqdm bar and then a line with its seconds."""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

import torch

from .datasets import Dataset
from .encoder import FrozenEncoder
from .features import FeatureCache, ForwardTiming, ResizePolicy, extract_features, split_features
from .knn import run_knn
from .logreg import run_logreg
from .metrics import classification_metrics
from .probe import ProbeDataWarning, run_probe
from .probe_run import ProbeRun
from .report import save_confusion_png

__all__ = ["SPEED_SAMPLE", "WARMUP_IMAGES", "probe_view"]

SPEED_SAMPLE = 512
"""Test images the encoder's images/s is measured on when the test features come from the cache."""
WARMUP_IMAGES = 32
"""Test images of the untimed forward before images/s is measured (allocations, kernel choice)."""


def probe_view(
    view: str, run: ProbeRun, dataset: Dataset, encoder: FrozenEncoder | None, cache: FeatureCache
) -> dict[str, Any]:
    """Features, probe, metrics and confusion PNG of one view of ``run``, and on the same features
    the kNN classifier and the logistic regression (when ``run`` has them) and, for an encoder view,
    the encoder's images/s (``speed``: how it was measured): a ``runs`` entry of results.json.
    ``run.workers`` threads run the processor ahead of the encoder (the same features as 0).

    Each stage after the features shows a tqdm bar and then a line with its seconds (stderr)."""
    config, knn, logreg, device, out = run.probe, run.knn, run.logreg, run.device, run.out
    resize, max_patches_per_pack = run.resize, run.max_patches_per_pack
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
            workers=run.workers,
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

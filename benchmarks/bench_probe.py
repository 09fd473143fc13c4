"""Linear-probe speed: the whole probe on cached-size features, and digits end to end.

    python benchmarks/bench_probe.py --threads 2

Figures printed:
    1. The full AdamW probe (all heads on a 90% split, selection, refit on all of train, test
       logits) on (60000, --dim) features of 10 classes: random class-structured Gaussians, the
       shape of a cached Fashion-MNIST view (target: under 30 s on 2 threads for 1k dims).
    2. The same on Fashion-MNIST's raw pixels (784 dims) when its IDX files are installed.
    3. ``python -m moonvit_eval.linear_probe --preset tiny --random-init --dataset digits`` end to end
       (encoder features with an empty cache, the default AdamW grid, the pixels baseline;
       target: under 10 s).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from moonvit.cli import add_threads_argument, apply_threads, positive_int
from moonvit_eval.datasets import DEFAULT_FASHION_MNIST_DIR, load_dataset
from moonvit_eval.features import pixel_features
from moonvit_eval.linear_probe import main as linear_probe
from moonvit_eval.metrics import classification_metrics
from moonvit_eval.probe import ProbeConfig, run_probe


def synthetic_features(train: int, test: int, dim: int, classes: int, seed: int = 0):
    """Gaussian features around random class means: ((train, dim), (train,), (test, dim), (test,))."""
    generator = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, dim, generator=generator) * 0.15
    labels = torch.randint(0, classes, (train + test,), generator=generator)
    features = means[labels] + torch.randn(train + test, dim, generator=generator)
    return features[:train], labels[:train], features[train:], labels[train:]


def best_of(repeats: int, run: Callable[[], Any]) -> tuple[float, list[float], Any]:
    """(fastest seconds, every run's seconds, the last result) of ``repeats`` calls of ``run``."""
    seconds, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        seconds.append(time.perf_counter() - start)
    return min(seconds), seconds, result


def time_probe(name: str, train_x, train_y, test_x, test_y, config: ProbeConfig, repeats: int) -> None:
    fastest, seconds, result = best_of(
        repeats, lambda: run_probe(train_x, train_y, test_x, int(train_y.max()) + 1, config)
    )
    top1 = classification_metrics(result.test_logits, test_y)["top1"]
    print(
        f"{name}: {tuple(train_x.shape)} train, {len(config.grid())} heads, {config.epochs} epochs: best "
        f"{fastest:.1f} s of {_list(seconds)} (test top-1 {top1:.4f}, chosen {result.chosen})"
    )


def _list(seconds: list[float]) -> str:
    return "[" + ", ".join(f"{s:.1f}" for s in seconds) + "]"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_probe.py", description=__doc__.split("\n\n")[0])
    add_threads_argument(parser)
    parser.add_argument("--dim", type=positive_int, default=1024, help="synthetic feature width (default: 1024)")
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="runs per figure; the fastest is reported (shared machines are noisy) (default: 3)",
    )
    parser.add_argument("--skip-digits", action="store_true", help="skip the digits end-to-end figure")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.threads = apply_threads(args.threads)
    warnings.simplefilter("ignore", UserWarning)  # grid-edge notes of the synthetic features
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    config = ProbeConfig()
    time_probe(
        f"random features, dim {args.dim}", *synthetic_features(60000, 10000, args.dim, 10), config, args.repeats
    )
    if DEFAULT_FASHION_MNIST_DIR.is_dir():
        dataset = load_dataset("fashion-mnist")
        time_probe(
            "fashion-mnist raw pixels",
            pixel_features(dataset.train.images),
            torch.from_numpy(dataset.train.labels),
            pixel_features(dataset.test.images),
            torch.from_numpy(dataset.test.labels),
            config,
            args.repeats,
        )
    if not args.skip_digits:
        fastest, seconds, results = best_of(args.repeats, lambda: digits_end_to_end(args.threads))
        rows = ", ".join(f"{run['features']} {run['test']['top1']:.4f}" for run in results["runs"])
        print(
            f"digits end to end (tiny random-init encoder + pixels baseline, empty cache): best {fastest:.1f} s "
            f"of {_list(seconds)} ({rows})"
        )


def digits_end_to_end(threads: int) -> dict[str, Any]:
    """The CLI on digits with a fresh output folder and feature cache; its results."""
    with tempfile.TemporaryDirectory() as folder:
        argv = [
            "--preset",
            "tiny",
            "--random-init",
            "--dataset",
            "digits",
            "--out",
            f"{folder}/out",
            "--threads",
            str(threads),
        ]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return linear_probe(argv)


if __name__ == "__main__":
    main()

"""One probe run, typed: what ``python -m moonvit_eval.linear_probe`` was asked to do.

:class:`ProbeRun` is built once from the parsed command line (:meth:`ProbeRun.from_args`); the
probe, its views and its report read it, never the ``argparse.Namespace``. Its sections are the
settings the three classifiers already record in results.json: :class:`~eval.probe.ProbeConfig`
(the linear probe's head search), :class:`~eval.knn.KnnConfig` and
:class:`~eval.logreg.LogRegConfig` (None when skipped).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moonvit.cli import torch_dtype, typed_run
from moonvit.media.packing import DEFAULT_MAX_PATCHES_PER_PACK

from .features import ResizePolicy, view_name
from .knn import KnnConfig
from .logreg import LogRegConfig, sklearn_version
from .probe import ProbeConfig

__all__ = ["ProbeArgumentError", "ProbeRun"]

PROGRAM = "python -m moonvit_eval.linear_probe"


class ProbeArgumentError(ValueError):
    """A command line the probe refuses (its message names the flag); the command reports it as a usage error."""


@dataclass(frozen=True)
class ProbeRun:
    """A probe run (the command's flags, defaults filled in).

    Attributes:
        dataset: the ``--dataset`` spec (fashion-mnist, digits or imagefolder:DIR).
        data_dir: the Fashion-MNIST IDX folder (None: the default one).
        features: the feature view probed (``pixels``: the raw-pixels probe alone).
        last_blocks: ``cls`` / ``both`` over the CLS rows of the last N blocks (1: the final one);
            the view is then named ``cls-lastN`` / ``both-lastN`` (:func:`~eval.features.view_name`).
        checkpoint, preset, random_init: the encoder (a checkpoint, or a preset with seeded random weights).
        out: the output folder (results.json, table.md, confusion PNGs).
        cache_dir: the feature cache.
        results_csv: the CSV that gains a row per feature view.
        device, dtype: where the encoder runs and in which dtype (None: the checkpoint's).
        attn: the encoder's attention backend (``auto`` or a registered one).
        threads: torch's CPU threads (None: torch's choice); workers: processor threads.
        seed: seed of random init, splits and shuffles.
        resize: the resize before the processor; max_patches_per_pack: the patch budget of one forward.
        side_limit_mode: the processor's ``side_limit_mode`` (None: the checkpoint's).
        image_rule: a classic ViT / DeiT folder's processor rule by name (None: native).
        baseline: probe raw pixels too, as a baseline row.
        probe: the linear probe's settings; knn, logreg: the other classifiers' (None: skipped).
        knn_columns: the ks of the CSV's kNN columns (present, empty, when the kNN is skipped).
        command: the command line, as results.json records it.
    """

    dataset: str
    features: str
    out: Path
    cache_dir: Path
    results_csv: Path
    probe: ProbeConfig
    knn: KnnConfig | None
    logreg: LogRegConfig | None
    knn_columns: tuple[int, ...]
    data_dir: Path | None = None
    checkpoint: str | None = None
    preset: str | None = None
    random_init: bool = False
    device: str = "cpu"
    dtype: torch.dtype | None = None
    attn: str = "auto"
    threads: int | None = None
    workers: int = 0
    seed: int = 0
    resize: ResizePolicy = field(default_factory=ResizePolicy)
    max_patches_per_pack: int = DEFAULT_MAX_PATCHES_PER_PACK
    side_limit_mode: str | None = None
    image_rule: str | None = None
    last_blocks: int = 1
    baseline: bool = True
    command: str = PROGRAM

    @property
    def view(self) -> str:
        """The view probed by its name: ``features``, over the last N blocks where ``last_blocks`` says."""
        return view_name(self.features, self.last_blocks)

    @property
    def views(self) -> list[str]:
        """The views probed, in order: :attr:`view`, then the raw-pixels baseline unless skipped."""
        return [self.view] + ([] if not self.baseline or self.features == "pixels" else ["pixels"])

    @classmethod
    def from_args(cls, args: argparse.Namespace, argv: Sequence[str] | None = None) -> ProbeRun:
        """The run of a parsed command line (``argv``: its words, for ``command``; None: ``sys.argv``).

        Raises:
            ProbeArgumentError: an encoder view with no encoder, ``--last-blocks`` with a view that does
                not read the CLS row, a preset without ``--random-init``, or the logistic regression
                without scikit-learn.
        """
        if args.features != "pixels" and args.checkpoint is None and args.preset is None:
            raise ProbeArgumentError(
                f"--features {args.features} needs an encoder: --checkpoint PATH or --preset NAME --random-init"
            )
        if args.last_blocks != 1 and args.features not in ("cls", "both"):
            raise ProbeArgumentError(
                f"--last-blocks {args.last_blocks} reads the CLS rows of the last blocks: it goes with --features "
                f"cls or both, not {args.features}"
            )
        if args.preset is not None and not args.random_init:
            raise ProbeArgumentError(f"--preset {args.preset} has no trained weights; add --random-init")
        if not args.no_logreg and sklearn_version() is None:
            raise ProbeArgumentError(
                "the logistic regression needs scikit-learn (pip install scikit-learn); or pass --no-logreg"
            )
        knn_ks = tuple(sorted(set(args.knn_k)))
        beside_out = args.out.resolve().parent
        return typed_run(
            cls,
            args,
            cache_dir=args.cache_dir if args.cache_dir is not None else beside_out / "feature-cache",
            results_csv=args.results_csv if args.results_csv is not None else beside_out / "probe_results.csv",
            dtype=torch_dtype(args.dtype) if args.dtype else None,
            resize=ResizePolicy(args.short_side),
            baseline=not args.no_baseline,
            probe=ProbeConfig(
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
            ),
            knn=None if args.no_knn else KnnConfig(knn_ks, args.knn_temperature, args.val_fraction, args.seed),
            logreg=None
            if args.no_logreg
            else LogRegConfig(
                inverse_regularization=tuple(sorted(set(args.logreg_Cs))),
                max_iter=args.logreg_max_iter,
                max_search_rows=args.logreg_search_rows or None,
                val_fraction=args.val_fraction,
                seed=args.seed,
                l2_normalize=args.l2_normalize,
            ),
            knn_columns=knn_ks,
            command=" ".join([PROGRAM, *(argv if argv is not None else sys.argv[1:])]),
        )

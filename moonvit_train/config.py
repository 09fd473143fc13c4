"""The trainer's command line and the typed :class:`TrainConfig` it becomes.

Every flag goes through the package's vocabulary (:mod:`moonvit.cli`), so bad values end at parse
time. ``--smoke`` fills in its settings (and, alone, the required arguments: :data:`SMOKE_DEFAULTS`),
and the objective its defaults (``--betas``, ``--drop-path``: MAE pretrains with (0.9, 0.95) and no
stochastic depth) and its own options.

Flags that change what is trained (data, model, recipe, length, seed) are *run-defining*: rerunning
into an ``--out`` that holds a run started with other values is refused, naming the flag. The
others (threads, device, attention backend, saving and validation cadence, progress bar) may change
between a run and its resumption.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import moonvit
from moonvit.cli import (
    ENCODER_OPTIONS,
    ArgumentParser,
    add_checkpoint_argument,
    add_shared_arguments,
    drop_rate,
    existing_folder,
    fraction,
    non_negative_float,
    non_negative_int,
    output_dir,
    positive_float,
    positive_int,
    probability,
    typed_run,
)
from moonvit.model.attention import AttentionUnavailableError, resolve_attn_implementation
from moonvit.model.lora import LORA_TARGETS
from moonvit_eval.datasets import DEFAULT_FASHION_MNIST_DIR

from .augment import AugmentConfig
from .classic import CLASSIC_PRESETS
from .objectives import OBJECTIVES
from .optim import OptimConfig
from .plan import TokenDrop

__all__ = [
    "NOT_RUN_DEFINING",
    "PRESET_CHOICES",
    "PROG",
    "SMOKE",
    "SMOKE_DEFAULTS",
    "DataSection",
    "ModelSection",
    "RunSection",
    "RuntimeSection",
    "TrainConfig",
    "build_parser",
    "parse_args",
    "run_defining",
]

NOT_RUN_DEFINING = frozenset(
    {
        "out",
        "attn",
        "threads",
        "workers",
        "device",
        "save_every",
        "save_layout",
        "evals",
        "progress",
        "peak_tflops",
        "data_dir",
        "objective_options",
    }
)
"""Arguments that may differ between a run and its resumption (they do not change the weights)."""

PRESET_CHOICES = (*sorted(moonvit.PRESETS), *CLASSIC_PRESETS)
"""``--preset``: MoonViT's sizes, then the classic ViT / DeiT's (:data:`moonvit.families.vit.PRESETS`)."""

PROG = "python -m moonvit_train"

SMOKE = {"steps": 30, "eval_limit": 256, "evals": 2}
"""What ``--smoke`` sets: 30 steps (unless a length is given) and evaluations on at most 256 images."""

SMOKE_DEFAULTS = {"objective": "supervised", "preset": "tiny", "dataset": "digits", "out": "runs/smoke"}
"""What ``--smoke`` takes for the arguments a run otherwise requires, where the command gives none:
``python -m moonvit_train --smoke`` alone trains the tiny preset on scikit-learn's digits (bundled, offline)."""

SMOKE_DIGITS = {"resolution": [28], "batch_patches": 1024}
"""With the digits ``--smoke`` chose, where the command leaves them at their defaults: the 8x8 images at
28 px (2x2 patches) in 1024-patch packs, a run that learns in its 30 steps (top-1 about 0.5, chance 0.1)."""


@dataclass(frozen=True)
class RunSection:
    """What is trained and for how long: ``steps`` / ``epochs`` / ``minutes``, exactly one set."""

    objective: str
    out: Path
    steps: int | None = None
    epochs: float | None = None
    minutes: float | None = None
    seed: int = 0
    smoke: bool = False


@dataclass(frozen=True)
class ModelSection:
    """The encoder: a ``preset`` (its shape overridable) or a ``checkpoint``, a MoonViT or a classic ViT /
    DeiT (``image_size``: the latter's table resampled to that many px first), and what of it trains:
    all of it, none (``freeze="tower"``), all but the embeddings and the first ``freeze_blocks``
    blocks, or LoRA adapters of rank ``lora_rank`` on its ``lora_targets`` linears (the LoRA
    settings are all None without ``lora_rank``)."""

    preset: str | None = None
    checkpoint: str | None = None
    depth: int | None = None
    width: int | None = None
    heads: int | None = None
    mlp_width: int | None = None
    pos_emb_size: int | None = None
    image_size: int | None = None
    drop_path: float = 0.05
    grad_checkpointing: bool = False
    freeze: str | None = None
    freeze_blocks: int | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float | None = None
    lora_targets: tuple[str, ...] | None = None

    def shape_overrides(self, **table_fields: int | None) -> dict[str, int]:
        """The preset's config fields that ``--depth``, ``--width``, ``--heads``, ``--mlp-width`` (and the
        family's table fields, ``table_fields``) replace: those given."""
        fields = {
            "num_hidden_layers": self.depth,
            "hidden_size": self.width,
            "num_attention_heads": self.heads,
            "intermediate_size": self.mlp_width,
            **table_fields,
        }
        return {name: value for name, value in fields.items() if value is not None}


@dataclass(frozen=True)
class DataSection:
    """The images and their packing. ``resolution``: (min, max) short side in px; ``eval_limit``: at
    most this many validation and test images (``--smoke``)."""

    dataset: str
    data_dir: Path | None = None
    skip_bad_images: bool = False
    probe_dataset: str | None = None
    val_fraction: float = 0.1
    resolution: tuple[int, int] = (56, 112)
    eval_resolution: int = 112
    batch_patches: int = 4096
    packs_per_step: int | None = None
    token_drop: TokenDrop = dataclasses.field(default_factory=TokenDrop)
    eval_limit: int | None = None


@dataclass(frozen=True)
class RuntimeSection:
    """How the steps are computed and watched: none of it changes what is trained but ``dtype`` and
    ``fsdp`` (see :data:`NOT_RUN_DEFINING`)."""

    device: str = "cpu"
    dtype: str = "bf16"
    fsdp: bool = False
    attn: str = "auto"
    threads: int | None = None
    workers: int = 0
    save_every: int = 200
    save_layout: str = "own"
    evals: int = 10
    progress: bool = True
    peak_tflops: float | None = None


@dataclass(frozen=True)
class TrainConfig:
    """One training run, as the command line describes it (typed; see ``python -m moonvit_train --help``), in
    sections: ``run``, ``model``, ``data``, ``augment`` (:class:`~train.augment.AugmentConfig`),
    ``optim`` (:class:`~train.optim.OptimConfig`), ``runtime``, and ``options``: the objective's own
    options, its :attr:`~train.objectives.Objective.Options` dataclass. :meth:`flat` gives every
    setting by its flag's name (what ``results.json`` records and the resume check compares).
    """

    run: RunSection
    model: ModelSection
    data: DataSection
    augment: AugmentConfig = dataclasses.field(default_factory=AugmentConfig)
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(2e-3, None, 0.05, 1.0))
    runtime: RuntimeSection = dataclasses.field(default_factory=RuntimeSection)
    options: Any = None

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def flat(self) -> dict[str, Any]:
        """Every setting by its flag's ``dest`` (``--head-lr``: ``head_lr``), in the command line's order;
        the objective's options as one value, ``objective_options``."""
        run, data, augment, optim, runtime = self.run, self.data, self.augment, self.optim, self.runtime
        return {
            "objective": run.objective,
            "out": run.out,
            "dataset": data.dataset,
            "steps": run.steps,
            "epochs": run.epochs,
            "minutes": run.minutes,
            "seed": run.seed,
            "smoke": run.smoke,
            **{f.name: getattr(self.model, f.name) for f in dataclasses.fields(self.model)},
            **{f.name: getattr(data, f.name) for f in dataclasses.fields(data) if f.name != "dataset"},
            "randaugment": (float(augment.randaugment_ops), augment.randaugment_magnitude),
            "hflip": augment.hflip,
            "crop_scale": augment.crop_scale,
            "mixup": augment.mixup,
            "cutmix": augment.cutmix,
            "mix_prob": augment.mix_prob,
            "lr": optim.lr,
            "head_lr": optim.head_lr,
            "min_lr_ratio": optim.min_lr_ratio,
            "warmup": optim.warmup,
            "weight_decay": optim.weight_decay,
            "betas": optim.betas,
            "layer_decay": optim.layer_decay,
            "clip_grad": optim.clip_grad,
            "ema": optim.ema,
            "dtype": runtime.dtype,
            "fsdp": runtime.fsdp,
            **{
                f.name: getattr(runtime, f.name) for f in dataclasses.fields(runtime) if f.name not in ("dtype", "fsdp")
            },
            "objective_options": self.options,
        }


def token_drop(text: str) -> TokenDrop:
    try:
        return TokenDrop.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def lora_targets(text: str) -> tuple[str, ...]:
    """``wqkv,wo``: the names of the blocks' linears LoRA adapts (checked against the tower when it is built)."""
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"give comma-separated linear names such as {','.join(LORA_TARGETS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Train a MoonViT encoder (or a classic ViT / DeiT) on packed native-resolution images. Rerunning "
        "the same command resumes from the last checkpoint in --out.",
        epilog="Data-parallel: torchrun --nproc-per-node K -m moonvit_train ... (gloo on CPU, NCCL on GPUs; each rank "
        "takes its share of every step's packs).",
    )
    run = parser.add_argument_group("run")
    # --objective, --out, --preset / --checkpoint and --dataset are required unless --smoke gives them
    # (SMOKE_DEFAULTS); parse_args checks them
    run.add_argument("--objective", choices=sorted(OBJECTIVES), help="what the encoder learns (required)")
    run.add_argument("--out", type=output_dir, help="output folder, resumed if it holds this run (required)")
    length = run.add_mutually_exclusive_group()
    length.add_argument("--steps", type=positive_int, help="optimizer steps")
    length.add_argument(
        "--epochs", type=positive_float, help="passes over the training images (the step count is derived)"
    )
    length.add_argument(
        "--minutes",
        type=positive_float,
        help="training time: the step count is fixed before step 0 from timed steps (validation included; "
        "the final test evaluation and export come after)",
    )
    add_shared_arguments(run, "seed", seed={"help": "seed of initialisation, plan, augmentation"})
    run.add_argument(
        "--smoke",
        action="store_true",
        help="a quick end-to-end check: 30 steps, small evaluations; alone, the required arguments default to "
        + " ".join(f"--{name} {value}" for name, value in SMOKE_DEFAULTS.items()),
    )

    model = parser.add_argument_group("model")
    source = model.add_mutually_exclusive_group()
    source.add_argument(
        "--preset",
        choices=PRESET_CHOICES,
        metavar="NAME",
        help="a randomly initialised encoder: a MoonViT size (" + ", ".join(sorted(moonvit.PRESETS)) + ") or a "
        "classic ViT / DeiT (" + ", ".join(CLASSIC_PRESETS) + ") (or --checkpoint)",
    )
    add_checkpoint_argument(
        source, "start from this tower: a checkpoint folder (any format the package reads) or hub id"
    )
    model.add_argument("--depth", type=positive_int, help="with --preset: number of blocks")
    model.add_argument("--width", type=positive_int, help="with --preset: hidden size")
    model.add_argument("--heads", type=positive_int, help="with --preset: attention heads")
    model.add_argument("--mlp-width", type=positive_int, help="with --preset: MLP hidden size")
    model.add_argument(
        "--pos-emb-size",
        type=positive_int,
        help="with --preset: side of the learnable position table (64 in the released towers; a small "
        "table suits small images and keeps a small model small)",
    )
    model.add_argument(
        "--image-size",
        type=positive_int,
        metavar="PX",
        help="a classic ViT / DeiT: resample its 1D position table once to PX px (a multiple of the patch) and "
        "train and save it at that native size: the ViT paper's and DeiT's fine-tune at 384 of a 224 checkpoint "
        "(default: the tower's own)",
    )
    model.add_argument(
        "--drop-path",
        type=drop_rate,
        help="stochastic depth at the last block, drawn per image, growing linearly from 0 "
        "(default: the objective's: 0.05 supervised, 0 MAE)",
    )
    model.add_argument(
        "--grad-checkpointing",
        action="store_true",
        help="recompute each block's activations in backward instead of keeping them (less memory, about a "
        "third more compute; see benchmarks/bench_train.py)",
    )

    tune = parser.add_argument_group("fine-tuning: what of the tower trains (default: all of it)")
    frozen = tune.add_mutually_exclusive_group()
    frozen.add_argument(
        "--freeze",
        choices=("tower",),
        help="train none of the tower's weights, only the objective's own modules (a classifier head, a decoder); "
        "the tower builds no autograd graph and runs without stochastic depth",
    )
    frozen.add_argument(
        "--freeze-blocks",
        type=non_negative_int,
        metavar="N",
        help="freeze the patch embedding, the position table and the first N blocks (no stochastic depth there); "
        "the later blocks, the final norm and the objective's modules train",
    )
    tune.add_argument(
        "--lora-rank",
        type=positive_int,
        metavar="R",
        help="train LoRA adapters of rank R on the blocks' linears (--lora-targets), the tower's own weights "
        "frozen; the saved checkpoint is the tower with the adapters merged in, the adapter alone in <out>/adapter",
    )
    tune.add_argument("--lora-alpha", type=positive_float, help="with --lora-rank: scale alpha / R (default: R)")
    tune.add_argument(
        "--lora-dropout", type=drop_rate, help="with --lora-rank: dropout on the adapters' input (default: 0)"
    )
    tune.add_argument(
        "--lora-targets",
        type=lora_targets,
        metavar="NAMES",
        help="with --lora-rank: comma-separated linears of each block to adapt: wqkv (attention's q, k, v), wo "
        f"(its output), fc0 and fc1 (the MLP's) (default: {','.join(LORA_TARGETS)})",
    )

    data = parser.add_argument_group("data")
    data.add_argument(
        "--dataset",
        help="(required) fashion-mnist, digits, imagefolder:DIR (labelled: one folder per class; its train split) or "
        "images:DIR (every image below DIR, no labels: self-supervised objectives)",
    )
    data.add_argument(
        "--probe-dataset",
        help="after training, linear-probe the encoder on this labelled dataset (a --dataset spec; default: the "
        "training data's own test split where it is labelled, else none)",
    )
    data.add_argument(
        "--data-dir", type=existing_folder, help=f"Fashion-MNIST IDX folder (default: {DEFAULT_FASHION_MNIST_DIR})"
    )
    data.add_argument(
        "--skip-bad-images",
        action="store_true",
        help="decode every image file once before training and leave out those that fail (zero-byte, truncated, "
        "not an image), listing them in results.json (default: an unreadable image is an error)",
    )
    data.add_argument(
        "--val-fraction",
        type=fraction,
        default=0.1,
        help="stratified share of train held out for validation (default: 0.1); the test split is scored once, "
        "at the end",
    )
    data.add_argument(
        "--resolution",
        type=positive_int,
        nargs="+",
        default=[56, 112],
        metavar="PX",
        help="short side in px, drawn per image uniformly in MIN MAX (one value: fixed), aspect kept, rounded to 28 px "
        "(default: 56 112)",
    )
    data.add_argument(
        "--eval-resolution", type=positive_int, help="short side for validation and test (default: the largest)"
    )
    data.add_argument(
        "--batch-patches",
        type=positive_int,
        default=4096,
        help="patch budget of one pack (kept patches, after token dropping) (default: 4096)",
    )
    data.add_argument(
        "--packs-per-step",
        type=positive_int,
        help="packs per optimizer step, shared out over the ranks (default: the number of ranks)",
    )
    data.add_argument(
        "--token-drop",
        type=token_drop,
        default=TokenDrop(),
        metavar="RATE|START:END",
        help="share of each image's patches dropped before packing, fixed or moving linearly over the run (default: 0)",
    )

    augment = parser.add_argument_group("augmentation")
    augment.add_argument(
        "--randaugment",
        type=non_negative_float,
        nargs=2,
        default=[2, 9],
        metavar=("OPS", "MAGNITUDE"),
        help="RandAugment operations per image and magnitude 0-10; 0 ops: off (default: 2 9)",
    )
    augment.add_argument("--hflip", type=probability, default=0.5, help="horizontal flip probability (default: 0.5)")
    augment.add_argument(
        "--crop-scale",
        type=probability,
        default=1.0,
        help="random crop of this share to all of the area (default: 1: off)",
    )
    augment.add_argument("--mixup", type=non_negative_float, default=0.0, help="Mixup Beta(a, a); 0: off (default)")
    augment.add_argument("--cutmix", type=non_negative_float, default=0.0, help="CutMix Beta(a, a); 0: off (default)")
    augment.add_argument(
        "--mix-prob", type=probability, default=1.0, help="probability an image is mixed, when mixing (default: 1)"
    )

    optim = parser.add_argument_group("optimisation")
    optim.add_argument(
        "--lr", type=positive_float, default=2e-3, help="peak learning rate of the encoder (default: 2e-3)"
    )
    optim.add_argument(
        "--head-lr", type=positive_float, help="peak learning rate of the objective's head (default: --lr)"
    )
    optim.add_argument("--min-lr-ratio", type=probability, default=0.01, help="final lr / peak lr (default: 0.01)")
    optim.add_argument(
        "--warmup", type=probability, default=0.05, help="warmup share of the steps, linear (default: 0.05)"
    )
    optim.add_argument("--weight-decay", type=non_negative_float, default=0.05, help="AdamW decay (default: 0.05)")
    optim.add_argument(
        "--betas",
        type=drop_rate,
        nargs=2,
        metavar=("BETA1", "BETA2"),
        help="AdamW betas (default: the objective's: 0.9 0.999 supervised, 0.9 0.95 MAE)",
    )
    optim.add_argument(
        "--layer-decay",
        type=probability,
        default=1.0,
        help="layer-wise lr decay for fine-tuning, e.g. 0.75 (default: 1, off)",
    )
    optim.add_argument(
        "--clip-grad", type=non_negative_float, default=1.0, help="gradient norm clip; 0: off (default: 1)"
    )
    add_shared_arguments(
        parser,
        "dtype",
        dtype={
            "default": "bf16",
            "help": "autocast dtype of forward and backward (weights stay fp32)",
            "choices": ("bf16", "fp32"),
        },
    )
    optim.add_argument(
        "--ema",
        type=fraction,
        metavar="DECAY",
        help="keep a moving average of the trained weights, e.g. 0.999 per step (warmed up: at most "
        "(1 + n) / (10 + n) at update n); validation, the test split, the probe and the saved checkpoint "
        "use it, and the state keeps both (default: none)",
    )
    optim.add_argument("--fsdp", action="store_true", help="under torchrun: shard weights with FSDP2 instead of DDP")

    runtime = parser.add_argument_group("runtime")
    add_shared_arguments(parser, *ENCODER_OPTIONS)
    add_shared_arguments(runtime, "workers", workers={"what": "steps' packs"})
    runtime.add_argument(
        "--save-every",
        type=non_negative_int,
        default=200,
        help="checkpoint every N steps; 0: at the end only (default: 200)",
    )
    add_shared_arguments(runtime, "save_layout")
    runtime.add_argument(
        "--evals", type=non_negative_int, default=10, help="validations spread over the run (default: 10)"
    )
    runtime.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    runtime.add_argument(
        "--peak-tflops", type=positive_float, help="matmul peak per process for MFU (default: measured at start)"
    )

    for cls in OBJECTIVES.values():
        cls.add_arguments(parser.add_argument_group(f"--objective {cls.name}"))  # type: ignore[arg-type]
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse and check the command line into a :class:`TrainConfig`; ``--smoke`` fills in its settings and
    the objective its defaults. Errors exit with status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _required_arguments(parser, args)
    if len(args.resolution) > 2:
        parser.error(f"--resolution takes MIN [MAX], got {len(args.resolution)} values")
    low, high = args.resolution * (2 if len(args.resolution) == 1 else 1)
    if low > high:
        parser.error(f"--resolution takes MIN MAX, got MIN {low} above MAX {high} (did you mean {high} {low}?)")
    foreign = _other_objectives_flags(parser, args)
    if foreign:
        owners = "; ".join(f"{flag} is for --objective {name}" for flag, name in foreign.items())
        ignored = "it" if len(foreign) == 1 else "them"
        parser.error(f"{owners}, not --objective {args.objective}, which would ignore {ignored}")
    if args.checkpoint is not None and any(
        getattr(args, name) is not None for name in ("depth", "width", "heads", "mlp_width", "pos_emb_size")
    ):
        parser.error(
            "--depth / --width / --heads / --mlp-width / --pos-emb-size shape a --preset; a --checkpoint has its own"
        )
    if args.preset in CLASSIC_PRESETS and args.pos_emb_size is not None:
        parser.error(f"--pos-emb-size shapes a MoonViT's 2D table; {args.preset}'s 1D table follows --image-size")
    if args.preset in moonvit.PRESETS and args.image_size is not None:
        parser.error(
            f"--image-size resamples a classic ViT's 1D position table; --preset {args.preset} is a MoonViT, whose "
            "2D table is interpolated to every image's grid already (--pos-emb-size sizes it)"
        )
    lora_settings = {"alpha": args.lora_alpha, "dropout": args.lora_dropout, "targets": args.lora_targets}
    if args.lora_rank is None and any(value is not None for value in lora_settings.values()):
        given = next(name for name, value in lora_settings.items() if value is not None)
        parser.error(f"--lora-{given} sets up LoRA adapters: give their rank with --lora-rank")
    if args.lora_rank is not None and (args.freeze is not None or args.freeze_blocks is not None):
        parser.error("--lora-rank already freezes the tower's own weights (only the adapters train); "
                     "leave out --freeze / --freeze-blocks")  # fmt: skip
    ops, magnitude = args.randaugment
    if ops != int(ops) or magnitude > 10:
        parser.error(
            f"--randaugment takes a whole number of operations and a magnitude 0-10, got {ops:g} {magnitude:g}"
        )
    steps, eval_limit, evals = args.steps, None, args.evals
    if args.smoke:
        eval_limit, evals = SMOKE["eval_limit"], min(args.evals, SMOKE["evals"])
        if args.steps is None and args.epochs is None and args.minutes is None:
            steps = SMOKE["steps"]
    if steps is None and args.epochs is None and args.minutes is None:
        parser.error("give the run's length: --steps, --epochs or --minutes (or --smoke)")
    _check_attention(parser, args.attn, args.device)
    objective = OBJECTIVES[args.objective]
    config = TrainConfig(
        run=typed_run(RunSection, args, steps=steps),
        model=typed_run(
            ModelSection,
            args,
            drop_path=objective.default_drop_path if args.drop_path is None else args.drop_path,
            **_lora_defaults(args),
        ),
        data=typed_run(
            DataSection,
            args,
            resolution=(low, high),
            eval_resolution=args.eval_resolution or high,
            eval_limit=eval_limit,
        ),
        augment=AugmentConfig(
            crop_scale=args.crop_scale,
            hflip=args.hflip,
            randaugment_ops=int(ops),
            randaugment_magnitude=float(magnitude),
            mixup=args.mixup,
            cutmix=args.cutmix,
            mix_prob=args.mix_prob,
        ),
        optim=typed_run(OptimConfig, args, betas=objective.default_betas if args.betas is None else tuple(args.betas)),
        runtime=typed_run(RuntimeSection, args, evals=evals),
        options=objective.options_from(args),
    )
    return objective.check_config(config, parser.error)


def _required_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Give ``--smoke`` its :data:`SMOKE_DEFAULTS` for the required arguments the command leaves out (and
    say which it took); without ``--smoke``, refuse a command that leaves any out, in one line."""
    missing = {
        "objective": args.objective is None,
        "out": args.out is None,
        "preset": args.preset is None and args.checkpoint is None,
        "dataset": args.dataset is None,
    }
    names = [name for name, absent in missing.items() if absent]
    if not names:
        return
    if not args.smoke:
        flags = ", ".join("--preset or --checkpoint" if name == "preset" else f"--{name}" for name in names)
        parser.error(f"the following arguments are required: {flags} (or --smoke alone, a quick check)")
    taken: dict[str, Any] = {name: SMOKE_DEFAULTS[name] for name in names}
    if "dataset" in taken:
        taken |= {
            name: value for name, value in SMOKE_DIGITS.items() if getattr(args, name) == parser.get_default(name)
        }
    for name, value in taken.items():
        setattr(args, name, output_dir(value) if name == "out" else value)
    shown = " ".join(
        f"--{name.replace('_', '-')} {' '.join(map(str, value)) if isinstance(value, list) else value}"
        for name, value in taken.items()
    )
    print(f"{PROG} --smoke: {shown}", flush=True)


def _lora_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The LoRA settings a ``--lora-rank`` run leaves out, filled in (the run's identity records them)."""
    if args.lora_rank is None:
        return {}
    return {
        "lora_alpha": float(args.lora_rank if args.lora_alpha is None else args.lora_alpha),
        "lora_dropout": 0.0 if args.lora_dropout is None else args.lora_dropout,
        "lora_targets": LORA_TARGETS if args.lora_targets is None else args.lora_targets,
    }


def _check_attention(parser: argparse.ArgumentParser, attn: str, device: str) -> None:
    """Refuse, as a usage error, an ``--attn`` backend that cannot train on ``device``: the encoder's
    weights stay fp32 under autocast, and its forward picks its backend for them."""
    try:
        resolve_attn_implementation(attn, torch.device(device), torch.float32)
    except AttentionUnavailableError as error:
        parser.error(f"argument --attn: {error}")
    if attn == "flex" and torch.device(device).type == "cpu":
        parser.error(f"argument --attn: flex attention has no backward on CPU in torch {torch.__version__}; use sdpa")


def _objective_flags(parser: argparse.ArgumentParser, name: str) -> dict[str, argparse.Action]:
    """The flags objective ``name`` adds, by their ``dest``."""
    fields = {f.name for f in dataclasses.fields(OBJECTIVES[name].Options)}
    return {action.dest: action for action in parser._actions if action.dest in fields}


def _other_objectives_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """The flags of objectives other than ``args.objective`` that the command line sets away from their
    defaults (the chosen objective would ignore them silently, as a supervised run a ``--teacher``),
    each with the objective it belongs to."""
    mine = _objective_flags(parser, args.objective)
    found: dict[str, str] = {}
    for name in OBJECTIVES:  # a flag two objectives share (--teacher) is named for the first registered
        for dest, action in _objective_flags(parser, name).items():
            if dest not in mine and getattr(args, dest) != action.default:
                found.setdefault(action.option_strings[0], name)
    return found


def run_defining(config: TrainConfig) -> dict[str, Any]:
    """The settings that define the run, by flag, as plain values (the resume check compares these)."""
    values: dict[str, Any] = {}
    options = config.options
    pairs = list(config.flat().items())
    if dataclasses.is_dataclass(options):
        pairs += [(f.name, getattr(options, f.name)) for f in dataclasses.fields(options)]
    for name, value in pairs:
        if name in NOT_RUN_DEFINING:
            continue
        values[f"--{name.replace('_', '-')}"] = str(value) if isinstance(value, (Path, TokenDrop)) else value
    return values

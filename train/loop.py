"""``python -m train``: the training loop.

One step: the plan gives the step's packs (every rank computes all of them, each takes its
share), each pack is rendered (decode, resize, augment, mix, patchify, drop), run through the
encoder and the objective, and its loss sum, scaled by the world size over the step's units,
is backpropagated; gradients are clipped, AdamW steps, the schedule moves on. Validation runs at
``--evals`` points, checkpoints every ``--save-every`` steps and at the end; then the encoder is
exported, the objective's head saved beside it, and the test split scored once.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import platform
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

import moonvit
from moonvit import CheckpointError, MoonViT, MoonViTConfig, MoonViTImageProcessor, preset_config
from moonvit.cli import apply_threads, one_line_warnings, torch_dtype
from moonvit.distributed import Ranks, close_ranks, init_ranks
from moonvit.files import write_text_atomic
from moonvit.perf import config_flops, matmul_peak

from .augment import AugmentConfig
from .batch import ImageSource, UnreadableImageError, render_pack
from .checkpoint import RunMismatch, check_same_run, load_state, rng_states, save_state, set_rng_states, state_path
from .config import parse_args, run_defining
from .data import DataError, TrainingData, load_training_data
from .log import MetricsLog, plot_curves
from .objectives import OBJECTIVES, Objective
from .optim import OptimConfig, build_optimizer, build_schedule, param_groups
from .parallel import Parallel, TrainModule
from .plan import ImageStream, Pack, Packer, PlannedImage, Resolution, default_lookahead, derive_seed, eval_packs

__all__ = ["TrainError", "main"]

MIX_SEED, TORCH_SEED = 1, 2
"""Purposes in :func:`derive_seed`: a pack's mixing draws, and torch's generator for its forward (stochastic depth)."""


class TrainError(RuntimeError):
    """The run cannot go on: a non-finite loss, a tower that cannot be loaded, a budget below one image."""


# ---- building ---------------------------------------------------------------------------------


def describe(config: MoonViTConfig) -> str:
    """An encoder's shape in one line (compared on resume); K3's switches named where they are set."""
    family = ""
    if config.norm_type != "layernorm" or config.qkv_hidden_size is not None or not config.attn_bias:
        family = (
            f", attention {config.attention_width}, {config.norm_type}, "
            f"{'biases' if config.attn_bias and config.linear_bias else 'no biases'}, "
            f"{config.pos_emb_interpolation_mode}"
        )
    return (
        f"{config.num_hidden_layers} blocks x {config.hidden_size} ({config.num_attention_heads} heads, "
        f"MLP {config.intermediate_size}), patch {config.patch_size}, table "
        f"{config.init_pos_emb_height}x{config.init_pos_emb_width}{family}"
    )


def build_encoder(args: argparse.Namespace) -> tuple[MoonViT, MoonViTImageProcessor]:
    """The encoder to train (fp32 weights, in train mode) and the processor whose normalisation it expects."""
    if args.checkpoint is not None:
        try:
            loaded = MoonViT.from_pretrained(args.checkpoint, dtype=torch.float32)
            processor = MoonViTImageProcessor.from_pretrained(args.checkpoint)
        except (CheckpointError, OSError, ValueError) as error:
            raise TrainError(f"cannot load --checkpoint {args.checkpoint}: {error}") from error
        encoder = MoonViT(dataclasses.replace(loaded.config, drop_path_rate=args.drop_path))
        encoder.load_state_dict(loaded.state_dict())
        return encoder.train(), processor
    overrides = {
        field: value
        for field, value in (
            ("num_hidden_layers", args.depth),
            ("hidden_size", args.width),
            ("num_attention_heads", args.heads),
            ("intermediate_size", args.mlp_width),
            ("init_pos_emb_height", args.pos_emb_size),
            ("init_pos_emb_width", args.pos_emb_size),
        )
        if value is not None
    }
    try:
        config = preset_config(args.preset, drop_path_rate=args.drop_path, **overrides)
    except ValueError as error:
        raise TrainError(f"--preset {args.preset} with {overrides}: {error}") from error
    torch.manual_seed(args.seed)
    return MoonViT(config).train(), MoonViTImageProcessor()


@dataclasses.dataclass
class Plan:
    """The run's plan: training sizes and packs, evaluation sizes."""

    resolution: Resolution
    eval_resolution: Resolution
    packer: Packer
    packs_per_step: int

    def eval_grids(self, source: ImageSource) -> list[tuple[int, int]]:
        return [self.eval_resolution.grid(int(w), int(h)) for w, h in source.sizes()]


def build_plan(args: argparse.Namespace, config: MoonViTConfig, data: TrainingData, ranks: Ranks) -> Plan:
    """Resolution, token drop, stream and packer; refuses a budget below one image."""
    unit = math.lcm(*config.merge_kernel_size)
    common = dict(max_patches=args.batch_patches, patch_size=config.patch_size, unit=unit)
    resolution = Resolution(args.resolution[0], args.resolution[1], max_grid_side=config.max_grid_side, **common)
    rows, cols = resolution.smallest_square()
    least = max(args.token_drop.kept(rows * cols, 0.0), args.token_drop.kept(rows * cols, 1.0))
    if args.batch_patches < least:
        raise TrainError(
            f"--batch-patches {args.batch_patches} is below one image: a {args.resolution[0]} px image has "
            f"{rows}x{cols} = {rows * cols} patches ({least} kept); use a budget of a few hundred images "
            f"(e.g. --batch-patches {256 * least}) or a smaller --resolution"
        )
    packs_per_step = args.packs_per_step or ranks.world_size
    if packs_per_step % ranks.world_size:
        raise TrainError(
            f"--packs-per-step {packs_per_step} cannot be shared out over {ranks.world_size} ranks evenly; "
            f"use a multiple of {ranks.world_size}"
        )
    stream = ImageStream(data.train.sizes(), resolution, args.token_drop, args.seed)
    width, height = (int(n) for n in stream.sizes[0])
    rows, cols = resolution.grid(width, height, 0.5)
    typical = args.token_drop.kept(rows * cols, 0.5)
    packer = Packer(stream, args.batch_patches, default_lookahead(args.batch_patches, typical))
    eval_resolution = Resolution(
        args.eval_resolution, args.eval_resolution, max_grid_side=config.max_grid_side, **common
    )
    return Plan(resolution, eval_resolution, packer, packs_per_step)


def steps_for_epochs(plan: Plan, epochs: float, samples: int = 100) -> int:
    """Steps that show about ``epochs`` passes over the training images, from ``samples`` simulated packs
    at the schedule's mean token-drop rate."""
    probe = copy.deepcopy(plan.packer)
    drop = probe.stream.drop
    mean_rate = (drop.start + drop.end) / 2
    probe.stream.drop = dataclasses.replace(drop, start=mean_rate, end=mean_rate)
    images = sum(len(probe.next_pack(0.0)) for _ in range(samples)) / samples
    return max(1, math.ceil(epochs * len(probe.stream.sizes) / (images * plan.packs_per_step)))


# ---- the trainer ------------------------------------------------------------------------------


class Trainer:
    """The training state of one process and the operations on it (see the module docstring)."""

    def __init__(
        self,
        args: argparse.Namespace,
        ranks: Ranks,
        device: torch.device,
        encoder: MoonViT,
        processor: MoonViTImageProcessor,
        objective: Objective,
        data: TrainingData,
        plan: Plan,
    ) -> None:
        self.args, self.ranks, self.device = args, ranks, device
        self.encoder, self.processor, self.objective = encoder, processor, objective
        self.data, self.plan = data, plan
        self.parallel = Parallel(TrainModule(encoder, objective).to(device), ranks, device, args.fsdp)
        self.autocast_dtype = torch_dtype(args.dtype)
        self.augment = AugmentConfig(
            crop_scale=args.crop_scale,
            hflip=args.hflip,
            randaugment_ops=int(args.randaugment[0]),
            randaugment_magnitude=args.randaugment[1],
            mixup=args.mixup,
            cutmix=args.cutmix,
            mix_prob=args.mix_prob,
        )
        head_lr = args.lr if args.head_lr is None else args.head_lr
        self.optim_config = OptimConfig(args.lr, head_lr, args.weight_decay, args.layer_decay)
        self.step = 0
        self.total = 0
        self.images_seen = 0
        self.elapsed_s = 0.0
        self.saved_step: int | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.schedule: torch.optim.lr_scheduler.LambdaLR | None = None

    # ---- set-up -------------------------------------------------------------------------------

    def start(self, total: int, saved: dict[str, Any] | None) -> None:
        """Optimizer and schedule for ``total`` steps, restored from ``saved`` when resuming."""
        self.total = total
        self.optimizer = build_optimizer(
            param_groups(self.encoder, self.objective, self.optim_config), self.optim_config, self.device
        )
        warmup = max(1, round(self.args.warmup * total))
        self.schedule = build_schedule(self.optimizer, total, warmup, self.args.min_lr_ratio)
        if saved is None:
            return
        self.parallel.load_model_state(saved["model"])
        self.parallel.load_optimizer_state(self.optimizer, saved["optimizer"])
        self.schedule.load_state_dict(saved["schedule"])
        self.plan.packer.load_state_dict(saved["plan"])
        set_rng_states(saved["rng"])
        self.step, self.images_seen, self.elapsed_s = saved["step"], saved["images_seen"], saved["elapsed_s"]
        self.saved_step = self.step

    def my_share(self, packs: Sequence[Pack]) -> list[tuple[int, Pack]]:
        """(index in the step, pack) of the packs this rank runs."""
        return [(j, packs[j]) for j in range(self.ranks.rank, len(packs), self.ranks.world_size)]

    def autocast(self) -> contextlib.AbstractContextManager:
        enabled = self.autocast_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=enabled)

    # ---- one step -----------------------------------------------------------------------------

    def forward_backward(self, step: int, packs: Sequence[Pack]) -> tuple[dict[str, float], float]:
        """Render, run and backpropagate this rank's packs of a step; returns the step's summed
        statistics over every rank (loss, objective sums, units) and this rank's rendering time."""
        units = sum(self.objective.weight(pack) for pack in packs)
        scale = self.ranks.world_size / units
        mine = self.my_share(packs)
        sums: dict[str, torch.Tensor] = {}
        render_s = 0.0
        for position, (j, pack) in enumerate(mine):
            start = time.perf_counter()
            mix_rng = np.random.default_rng(derive_seed(self.args.seed, MIX_SEED, step, j))
            batch = render_pack(
                pack, self.data.train, self.encoder.config, self.augment, mix_rng, self.objective.needs_full_pixels
            ).to(self.device)
            render_s += time.perf_counter() - start
            torch.manual_seed(derive_seed(self.args.seed, TORCH_SEED, step, j))
            with self.parallel.gradient_sync(position == len(mine) - 1):
                with self.autocast():
                    output = self.parallel(batch)
                (output.loss_sum * scale).backward()
            for name, value in {"loss": output.loss_sum.detach(), **output.sums}.items():
                sums[name] = sums.get(name, 0) + value.detach().float()
        names = ["loss", *self.objective.sum_names]
        totals = self.ranks.sum(torch.stack([sums[name] for name in names]).cpu())
        return {name: float(total) / units for name, total in zip(names, totals)}, render_s

    def train_step(self, packs: Sequence[Pack]) -> dict[str, Any]:
        """One optimizer step on a step's packs; returns its log record."""
        assert self.optimizer is not None and self.schedule is not None
        start = time.perf_counter()
        lr = max(group["lr"] for group in self.optimizer.param_groups)
        stats, render_s = self.forward_backward(self.step, packs)
        params = [p for p in self.parallel.module.parameters() if p.grad is not None]
        clip = self.args.clip_grad if self.args.clip_grad > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        if not (math.isfinite(stats["loss"]) and math.isfinite(grad_norm)):
            raise TrainError(self._non_finite_message(stats["loss"], grad_norm))
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        step_s = time.perf_counter() - start
        self.step += 1
        self.elapsed_s += step_s
        images = sum(len(pack) for pack in packs)
        patches = sum(item.kept for pack in packs for item in pack)
        self.images_seen += images
        flops = 3 * sum(self._forward_flops(pack) for pack in packs)
        record = {
            "kind": "train",
            "step": self.step,
            "epoch": self.images_seen / len(self.data.train),
            "loss": stats["loss"],
            **({"accuracy": stats["correct"]} if "correct" in stats else {}),
            "lr": lr,
            "grad_norm": grad_norm,
            "images": images,
            "patches": patches,
            "utilisation": patches / (len(packs) * self.args.batch_patches),
            "token_drop": self.args.token_drop.rate(max(self.step - 1, 0) / self.total),
            "step_s": step_s,
            "data_s": render_s,
            "images_per_s": images / step_s,
            "patches_per_s": patches / step_s,
            "tflops": flops / step_s / 1e12,
        }
        return record

    def _forward_flops(self, pack: Pack) -> float:
        return config_flops([item.kept for item in pack], self.encoder.config)

    def _non_finite_message(self, loss: float, grad_norm: float) -> str:
        kept = (
            f"the last good checkpoint, from step {self.saved_step}, is kept in {state_path(self.args.out)}"
            if self.saved_step is not None
            else "no checkpoint had been written yet"
        )
        return (
            f"the loss is {loss} (gradient norm {grad_norm}) at step {self.step + 1}: training stopped and this "
            f"step was not applied; {kept}. Lower --lr, keep --clip-grad on, or try --dtype fp32"
        )

    # ---- evaluation ---------------------------------------------------------------------------

    def evaluate(self, source: ImageSource, outputs: bool = False) -> tuple[dict[str, float], torch.Tensor | None]:
        """The objective's mean sums on ``source`` (every patch, no augmentation), over every rank;
        with ``outputs``, also the per-image outputs in source order (on every rank)."""
        grids = self.plan.eval_grids(source)
        packs = eval_packs(grids, self.args.batch_patches)
        sums: dict[str, torch.Tensor] = {}
        mine: list[tuple[list[int], torch.Tensor]] = []
        self.parallel.module.eval()
        # Under FSDP every rank must run every forward (each gathers weights with the others):
        # a rank short of packs runs the first one again and ignores the result.
        rounds = -(-len(packs) // self.ranks.world_size)
        with torch.no_grad():
            for j in range(self.ranks.rank, rounds * self.ranks.world_size, self.ranks.world_size):
                if j >= len(packs) and not self.parallel.fsdp:
                    break
                pack = packs[j] if j < len(packs) else packs[0]
                items = [PlannedImage(i, *grids[i], grids[i][0] * grids[i][1], 0) for i in pack]
                batch = render_pack(
                    items, source, self.encoder.config, None, full_pixels=self.objective.needs_full_pixels
                ).to(self.device)
                with self.autocast():
                    output = self.parallel(batch, evaluate=True)
                if j >= len(packs):
                    continue
                for name, value in {"loss": output.loss_sum, **output.sums}.items():
                    sums[name] = sums.get(name, 0) + value.float()
                if outputs and output.outputs is not None:
                    mine.append((pack, output.outputs.float().cpu()))
        self.parallel.module.train()
        names = ["loss", *self.objective.sum_names]  # every rank reduces the same tensor, even one with no pack
        totals = self.ranks.sum(torch.stack([torch.as_tensor(sums.get(n, 0.0)).float().cpu() for n in names]))
        means = {name: float(total) / len(source) for name, total in zip(names, totals)}
        if not outputs:
            return means, None
        pairs = [(i, row) for part in self.ranks.all_gather(mine) for ids, rows in part for i, row in zip(ids, rows)]
        ordered = sorted(pairs, key=lambda pair: pair[0])
        return means, torch.stack([row for _, row in ordered])

    def validate(self) -> dict[str, Any]:
        start = time.perf_counter()
        means, _ = self.evaluate(self.data.val)
        self.draw(self.args.out / "pictures" / f"step-{self.step:06d}.png")
        self.elapsed_s += time.perf_counter() - start
        return {"kind": "val", "step": self.step, "loss": means["loss"], **_accuracy("top1", means)}

    def draw(self, path: Path, count: int = 8) -> bool:
        """The objective's picture of the first ``count`` validation images (main rank; every patch)."""
        if not self.objective.draws_pictures or not self.ranks.is_main or self.parallel.fsdp:
            return False  # sharded weights: every rank would have to run it
        source = self.data.val
        grids = self.plan.eval_grids(source)[:count]
        items = [PlannedImage(i, *grid, grid[0] * grid[1], 0) for i, grid in enumerate(grids)]
        batch = render_pack(items, source, self.encoder.config, None, full_pixels=self.objective.needs_full_pixels)
        self.parallel.module.eval()
        try:
            with torch.no_grad(), self.autocast():
                path.parent.mkdir(parents=True, exist_ok=True)
                return self.objective.visualize(self.encoder, batch.to(self.device), self.processor, path)
        finally:
            self.parallel.module.train()

    # ---- checkpoints --------------------------------------------------------------------------

    def save(self, identity: dict[str, Any]) -> None:
        """Write the state (every rank takes part in gathering it; the main rank writes it)."""
        assert self.optimizer is not None and self.schedule is not None
        model = self.parallel.model_state()
        optimizer = self.parallel.optimizer_state(self.optimizer)
        if self.ranks.is_main:
            save_state(
                state_path(self.args.out),
                {
                    "run": identity,
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items()},
                    "step": self.step,
                    "total_steps": self.total,
                    "images_seen": self.images_seen,
                    "elapsed_s": self.elapsed_s,
                    "model": model,
                    "optimizer": optimizer,
                    "schedule": self.schedule.state_dict(),
                    "plan": self.plan.packer.state_dict(),
                    "rng": rng_states(),
                    "threads": torch.get_num_threads(),
                },
            )
        self.ranks.barrier()
        self.saved_step = self.step

    def export(self) -> list[str]:
        """The encoder in the package's format at ``<out>/checkpoint`` (with the processor's settings), and
        the objective's files beside it. Main rank only."""
        out = self.args.out
        state = self.parallel.model_state()
        if not self.ranks.is_main:
            return []
        parts: dict[str, dict[str, torch.Tensor]] = {"encoder": {}, "objective": {}}
        for name, tensor in state.items():
            part, _, rest = name.partition(".")
            parts[part][rest] = tensor
        encoder = MoonViT(dataclasses.replace(self.encoder.config, drop_path_rate=0.0))
        encoder.load_state_dict(parts["encoder"])
        encoder.save_pretrained(out / "checkpoint")
        self.processor.save_pretrained(out / "checkpoint")
        return ["checkpoint", *self.objective.save(out, parts["objective"])]


def _accuracy(name: str, means: dict[str, float]) -> dict[str, float]:
    return {name: means["correct"]} if "correct" in means else {}


# ---- the run ----------------------------------------------------------------------------------


def calibrate_steps(trainer: Trainer, minutes: float) -> tuple[int, dict[str, float]]:
    """Steps that fit ``minutes``: the first step's packs run forward and backward three times (no update),
    one validation pack is timed, and the step count leaves room for the ``--evals`` validations."""
    probe = copy.deepcopy(trainer.plan.packer)
    packs = [probe.next_pack(0.0) for _ in range(trainer.plan.packs_per_step)]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        trainer.forward_backward(0, packs)
        times.append(time.perf_counter() - start)
        trainer.parallel.module.zero_grad(set_to_none=True)
    start = time.perf_counter()
    trainer.evaluate(trainer.data.val)
    val_s = time.perf_counter() - start
    measured = trainer.ranks.max(torch.tensor([float(np.median(times)), val_s], dtype=torch.float64))
    step_s, val_s = float(measured[0]), float(measured[1])
    budget_s = minutes * 60 - trainer.args.evals * val_s
    steps = max(1, int(budget_s / (step_s * 1.03)))  # 3%: the optimizer step and logging
    return int(trainer.ranks.from_main(steps)), {"step_s": step_s, "val_s": val_s}


def run(args: argparse.Namespace, ranks: Ranks, device: torch.device) -> dict[str, Any]:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    encoder, processor = build_encoder(args)
    data = load_training_data(
        args.dataset,
        args.data_dir,
        args.val_fraction,
        args.seed,
        processor,
        args.eval_limit,
        skip_bad=args.skip_bad_images,
        progress=args.progress and ranks.is_main,
    )
    if ranks.is_main:
        for message in data.warnings:
            warnings.warn(message, stacklevel=1)
        if data.skipped:
            first = data.skipped[0]
            warnings.warn(
                f"--skip-bad-images left out {len(data.skipped)} unreadable images (the first: {first.path}: "
                f"{first.reason}); all are listed in results.json",
                stacklevel=1,
            )
    objective = OBJECTIVES[args.objective].from_args(encoder, data.classes, args)
    plan = build_plan(args, encoder.config, data, ranks)
    identity = {
        **run_defining(args),
        "--packs-per-step": plan.packs_per_step,  # resolved: the default follows the world size
        "dataset_fingerprint": data.fingerprint,
        "encoder": describe(encoder.config),
    }
    saved = load_state(state_path(out))
    if saved is not None:
        check_same_run(saved["run"], identity, out)
        threads = saved.get("threads")
        if ranks.is_main and threads is not None and threads != torch.get_num_threads():
            warnings.warn(
                f"resuming with {torch.get_num_threads()} threads, where the run so far used {threads}: CPU kernels "
                "split their sums by thread count, so the result will not be bit-identical to an uninterrupted run "
                f"(--threads {threads} keeps it so)",
                stacklevel=1,
            )
    trainer = Trainer(args, ranks, device, encoder, processor, objective, data, plan)

    calibration: dict[str, float] = {}
    if saved is not None:
        total = saved["total_steps"]
        calibration = saved.get("calibration", {})
    elif args.steps is not None:
        total = args.steps
    elif args.epochs is not None:
        total = steps_for_epochs(plan, args.epochs)
    else:
        total, calibration = calibrate_steps(trainer, args.minutes)
    trainer.start(total, saved)
    results_file = out / "results.json"
    if trainer.step == total and results_file.is_file():
        if ranks.is_main:
            print(f"{out} holds a finished run ({total} steps); results in {results_file}")
        return json.loads(results_file.read_text())

    peak = _peak_flops(args, device) * ranks.world_size
    log = MetricsLog(out / "metrics.jsonl", trainer.step, enabled=ranks.is_main)
    eval_steps = {round(total * (k + 1) / args.evals) for k in range(args.evals)} if args.evals else set()
    identity_state = {**identity}
    bar = tqdm(
        total=total, initial=trainer.step, desc="train", unit="step", disable=not (ranks.is_main and args.progress)
    )
    smoothed: dict[str, float] = {}
    while trainer.step < total:
        packs = [plan.packer.next_pack(trainer.step / total) for _ in range(plan.packs_per_step)]
        record = trainer.train_step(packs)
        record["mfu"] = record["tflops"] * 1e12 / peak
        log.write(record)
        for name in ("loss", "images_per_s", "patches_per_s", "mfu"):
            smoothed[name] = record[name] if name not in smoothed else 0.9 * smoothed[name] + 0.1 * record[name]
        bar.set_postfix(
            loss=f"{smoothed['loss']:.3f}",
            lr=f"{record['lr']:.2e}",
            img_s=f"{smoothed['images_per_s']:.0f}",
            patch_s=f"{smoothed['patches_per_s']:.0f}",
            mfu=f"{smoothed['mfu']:.1%}",
            refresh=False,
        )
        bar.update()
        if trainer.step in eval_steps:
            validation = trainer.validate()
            log.write(validation)
            if ranks.is_main:
                bar.write(f"step {trainer.step}: validation " + _summary(validation))
        if trainer.step == total or (args.save_every and trainer.step % args.save_every == 0):
            trainer.save({**identity_state})
            if ranks.is_main and calibration:
                _note_calibration(out, calibration)
    bar.close()
    return finish(trainer, calibration)


def _summary(record: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in record.items() if k not in ("kind", "step"))


def _note_calibration(out: Path, calibration: dict[str, float]) -> None:
    write_text_atomic(out / "state" / "calibration.json", json.dumps(calibration, indent=2) + "\n")


def _peak_flops(args: argparse.Namespace, device: torch.device) -> float:
    """FLOP/s of one process's matmuls in the autocast dtype: given, or measured now."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    return matmul_peak(torch_dtype(args.dtype), 2048 if device.type == "cpu" else 8192, 3, device)


def finish(trainer: Trainer, calibration: dict[str, float]) -> dict[str, Any]:
    """Export, score the test split once, write results.json and the curves."""
    args, out, ranks = trainer.args, trainer.args.out, trainer.ranks
    files = trainer.export()
    if trainer.draw(out / "pictures.png"):
        files.append("pictures.png")
    val, _ = trainer.evaluate(trainer.data.val)
    _, outputs = trainer.evaluate(trainer.data.test, outputs=True)
    if not ranks.is_main:
        return {}
    assert outputs is not None
    labels = torch.from_numpy(trainer.data.test.labels)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r["kind"] == "train"]
    timed = steps[min(5, len(steps) - 1) :] if steps else []
    results = {
        "objective": args.objective,
        "dataset": trainer.data.name,
        "test": trainer.objective.report(outputs, labels, trainer.data.classes),
        "val": {"loss": val["loss"], **_accuracy("top1", val)},
        "steps": trainer.step,
        "images_seen": trainer.images_seen,
        "epochs": trainer.images_seen / len(trainer.data.train),
        "train_minutes": trainer.elapsed_s / 60,
        "images_per_s": float(np.mean([r["images_per_s"] for r in timed])) if timed else None,
        "patches_per_s": float(np.mean([r["patches_per_s"] for r in timed])) if timed else None,
        "mfu": float(np.mean([r["mfu"] for r in timed])) if timed else None,
        "utilisation": float(np.mean([r["utilisation"] for r in steps])) if steps else None,
        "data_share": float(np.sum([r["data_s"] for r in timed]) / np.sum([r["step_s"] for r in timed]))
        if timed
        else None,
        "encoder": {
            "shape": describe(trainer.encoder.config),
            "parameters": sum(p.numel() for p in trainer.encoder.parameters()),
        },
        "sizes": {"train": len(trainer.data.train), "val": len(trainer.data.val), "test": len(trainer.data.test)},
        "files": files,
        "calibration": calibration or None,
        "data_warnings": list(trainer.data.warnings),
        "skipped_images": [dataclasses.asdict(image) for image in trainer.data.skipped],
        "threads": torch.get_num_threads(),
        "world_size": ranks.world_size,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "command": " ".join(["python -m train", *sys.argv[1:]]),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "moonvit": moonvit.__version__},
    }
    plot_curves(out / "metrics.jsonl", out / "curves.png", f"{args.objective} on {trainer.data.name}")
    write_text_atomic(out / "results.json", json.dumps(results, indent=2, default=str) + "\n")
    print(f"test: {_summary({k: v for k, v in results['test'].items() if isinstance(v, float)})}")
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    apply_threads(args.threads)
    ranks, device = init_ranks(args.device)
    try:
        with one_line_warnings():
            return run(args, ranks, device)
    except (DataError, RunMismatch, TrainError, UnreadableImageError) as error:
        raise SystemExit(f"error: {error}") from error
    finally:
        close_ranks()

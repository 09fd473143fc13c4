"""Evaluation during and after a run: the objective's mean sums on a split (every patch, no
augmentation), the validation record, and the objective's picture of a few held-out images."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .batch import Batch, ImageSource, render_pack
from .plan import PlannedTrainImage, eval_packs
from .trainer import Trainer

__all__ = ["calibrate", "draw", "evaluate", "validate"]


def evaluate(
    trainer: Trainer, source: ImageSource, outputs: bool = False
) -> tuple[dict[str, float], torch.Tensor | None]:
    """The objective's mean sums on ``source`` (every patch, no augmentation), over every rank;
    with ``outputs``, also the per-image outputs in source order (on every rank)."""
    parallel, ranks, objective = trainer.parallel, trainer.ranks, trainer.objective
    grids = trainer.plan.eval_grids(source)
    packs = eval_packs(grids, trainer.config.data.batch_patches)
    sums: dict[str, torch.Tensor] = {}
    mine: list[tuple[list[int], torch.Tensor]] = []
    parallel.module.eval()
    # Under FSDP every rank must run every forward (each gathers weights with the others):
    # a rank short of packs runs the first one again and ignores the result.
    rounds = -(-len(packs) // ranks.world_size)
    with torch.no_grad():
        for j in range(ranks.rank, rounds * ranks.world_size, ranks.world_size):
            if j >= len(packs) and not parallel.fsdp:
                break
            pack = packs[j] if j < len(packs) else packs[0]
            items = [PlannedTrainImage(i, *grids[i], grids[i][0] * grids[i][1], 0) for i in pack]
            batch = render_pack(
                items, source, trainer.encoder.config, None, full_pixels=objective.needs_full_pixels
            ).to(trainer.device)
            with trainer.autocast():
                output = parallel(batch, evaluate=True)
            if j >= len(packs):
                continue
            for name, value in {"loss": output.loss_sum, **output.sums}.items():
                sums[name] = sums.get(name, 0) + value.float()
            if outputs and output.outputs is not None:
                mine.append((pack, output.outputs.float().cpu()))
    parallel.module.train()
    names = ["loss", *objective.sum_names]  # every rank reduces the same tensor, even one with no pack
    totals = ranks.sum(torch.stack([torch.as_tensor(sums.get(n, 0.0)).float().cpu() for n in names]))
    means = {name: float(total) / len(source) for name, total in zip(names, totals)}
    if not outputs:
        return means, None
    pairs = [(i, row) for part in ranks.all_gather(mine) for ids, rows in part for i, row in zip(ids, rows)]
    ordered = sorted(pairs, key=lambda pair: pair[0])
    return means, torch.stack([row for _, row in ordered])


def calibrate(trainer: Trainer) -> dict[str, Any]:
    """The objective's calibration pass (:meth:`~train.objectives.Objective.calibrate`) on the first
    ``calibration_images`` training images at the evaluation resolution, every patch, no
    augmentation: the same images and packs on every rank, so no rank needs another's result."""
    objective = trainer.objective
    count = min(objective.calibration_images, len(trainer.data.train))
    if count == 0:
        return {}
    train = trainer.data.train
    source = ImageSource(train.split, train.processor, train.rows[:count], train.split_sizes)
    grids = trainer.plan.eval_grids(source)

    def batches() -> Iterator[Batch]:
        for pack in eval_packs(grids, trainer.config.data.batch_patches):
            items = [PlannedTrainImage(i, *grids[i], grids[i][0] * grids[i][1], 0) for i in pack]
            yield render_pack(items, source, trainer.encoder.config, None, full_pixels=True).to(trainer.device)

    with torch.no_grad(), trainer.autocast():
        return {"images": count, **objective.calibrate(batches())}


def validate(trainer: Trainer) -> dict[str, Any]:
    """The validation record at this step (and the objective's picture, where it draws)."""
    start = time.perf_counter()
    means, _ = evaluate(trainer, trainer.data.val)
    draw(trainer, trainer.config.run.out / "pictures" / f"step-{trainer.step:06d}.png")
    trainer.elapsed_s += time.perf_counter() - start
    return {"kind": "val", "step": trainer.step, "loss": means["loss"], **trainer.objective.metrics(means)}


def draw(trainer: Trainer, path: Path, count: int = 8) -> bool:
    """The objective's picture of the first ``count`` validation images (main rank; every patch)."""
    if not trainer.objective.draws_pictures or not trainer.ranks.is_main or trainer.parallel.fsdp:
        return False  # sharded weights: every rank would have to run it
    source = trainer.data.val
    grids = trainer.plan.eval_grids(source)[:count]
    items = [PlannedTrainImage(i, *grid, grid[0] * grid[1], 0) for i, grid in enumerate(grids)]
    batch = render_pack(items, source, trainer.encoder.config, None, full_pixels=trainer.objective.needs_full_pixels)
    trainer.parallel.module.eval()
    try:
        with torch.no_grad(), trainer.autocast():
            path.parent.mkdir(parents=True, exist_ok=True)
            return trainer.objective.visualize(trainer.encoder, batch.to(trainer.device), trainer.processor, path)
    finally:
        trainer.parallel.module.train()

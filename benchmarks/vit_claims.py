"""The ViT paper's two claims on Fashion-MNIST, at one equal budget: GAP against a CLS token, and
whether a learned 1D position table learns the 2D neighbourhoods of its patches.

    python benchmarks/vit_claims.py --threads 2 --picture docs/img/vit-claims-position-similarity.png

Three towers of the same width, depth, heads and MLP, patch 4 on the 28 x 28 images (a 7 x 7 grid),
each trained from the same seed on the same batches (the 60,000 training images, light shifts) with
the same AdamW, warmup + cosine schedule and steps, with a linear head trained jointly, and scored
by top-1 on the 10,000 test images:

    cls      the classic ViT: a CLS token and a learned 1D table, the head on the CLS row (§3.1)
    gap      the same without the CLS token: the head on the mean of the patch rows (GAP, §3.2)
    moonvit  this package's MoonViT: a learned 2D table and 2D RoPE, the head on the mean of the
             patch rows

Then each tower's table is scored for locality: the mean cosine similarity of 4-neighbour rows
against rows 4 or more apart along a row or column, and how many positions have a 4-neighbour as
their most similar row (by chance about 3 in 48). The paper's figure of the first tower's table (each
position's similarity to all 49) goes to ``--out`` and, with ``--picture``, to that file too.

Prints the table (markdown) with the host; ``--out`` (default: a new temporary folder, never the
repository) gets ``results.json``, ``results.md``, each trained tower (``save_pretrained``; the
MoonViT's head beside it in ``head.safetensors``) and the pictures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from common import host_line
from safetensors.torch import save_file
from tqdm import tqdm

from moonvit import MoonViT, MoonViTConfig
from moonvit.cli import (
    add_seed_argument,
    add_threads_argument,
    apply_threads,
    existing_folder,
    non_negative_float,
    non_negative_int,
    output_dir,
    output_file,
    positive_float,
    positive_int,
)
from moonvit.families.vit import ClassicViT, ClassicViTConfig
from moonvit_eval.datasets import DEFAULT_FASHION_MNIST_DIR, load_dataset
from moonvit_eval.pictures import grid_table, position_similarity, save_table_similarity
from moonvit_train.optim import build_schedule

TOWERS = {
    "cls": "(a) classic ViT: CLS token + 1D table",
    "gap": "(b) GAP: no CLS token, the same 1D table",
    "moonvit": "(c) MoonViT: 2D table + 2D RoPE, mean of the patch rows",
}
CLASSES = 10
FAR = 4
"""Rows count as far apart when their positions are this many or more apart along a row or column."""


@dataclass(frozen=True)
class Budget:
    """What every tower shares: its shape and its whole training recipe.

    ``shift``: the light augmentation, each training image moved by up to this many pixels along each
    axis (zeros fill in); ``warmup``: the linear warmup's share of ``steps``; ``min_lr_ratio``: the
    rate at the last step over ``lr``; ``clip_grad``: the global gradient norm clip (0: none).
    """

    width: int = 128
    depth: int = 4
    heads: int = 4
    mlp: int = 512
    patch: int = 4
    image: int = 28
    steps: int = 800
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup: float = 0.05
    min_lr_ratio: float = 0.01
    clip_grad: float = 1.0
    shift: int = 2
    seed: int = 0

    @property
    def grid(self) -> int:
        """Patches per side (7 for 28 px at patch 4)."""
        return self.image // self.patch


# ---- data -------------------------------------------------------------------------------------


def pixel_stats(images: np.ndarray) -> tuple[float, float]:
    """(mean, std) of (N, H, W) uint8 images' pixels on the 0-1 scale, in float64."""
    pixels = images.astype(np.float64) / 255.0
    return float(pixels.mean()), float(pixels.std())


def to_patches(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, H, W) one-channel images -> (B * H/p * W/p, 1, p, p): each image's patches in raster order,
    images one after the other (the packed towers' ``pixel_values``); the dtype is kept."""
    if images.ndim != 3:
        raise ValueError(f"expected (B, H, W) one-channel images, got shape {tuple(images.shape)}")
    b, h, w = images.shape
    if h % patch or w % patch:
        raise ValueError(f"{h}x{w} images are not a multiple of the {patch} px patch")
    return (
        images.reshape(b, h // patch, patch, w // patch, patch)
        .permute(0, 1, 3, 2, 4)
        .reshape(b * (h // patch) * (w // patch), 1, patch, patch)
    )


def shift_images(images: torch.Tensor, shift: int, generator: torch.Generator) -> torch.Tensor:
    """(B, H, W) images, each moved by its own random offset of up to ``shift`` pixels along each axis
    (zeros fill in): a crop of the zero-padded image at a random corner."""
    if shift == 0:
        return images
    b, h, w = images.shape
    padded = F.pad(images, (shift, shift, shift, shift))
    corners = torch.randint(0, 2 * shift + 1, (b, 2), generator=generator)
    rows = corners[:, :1] + torch.arange(h)  # (B, H)
    cols = corners[:, 1:] + torch.arange(w)  # (B, W)
    return padded[torch.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]


class Pixels:
    """Fashion-MNIST-style (N, H, W) uint8 images and (N,) labels, normalised per batch by ``mean``
    and ``std`` (0-1 scale) into the towers' packed input."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, mean: float, std: float) -> None:
        if images.ndim != 3 or images.dtype != np.uint8 or labels.shape != images.shape[:1]:
            raise ValueError(f"expected (N, H, W) uint8 images and (N,) labels, got {images.shape} and {labels.shape}")
        self.images = torch.from_numpy(np.array(images))  # a writable copy (IDX arrays are read-only)
        self.labels = torch.from_numpy(np.ascontiguousarray(labels)).long()
        self.mean, self.std = mean, std

    def __len__(self) -> int:
        return len(self.labels)

    def batch(
        self, index: torch.Tensor, patch: int, shift: int = 0, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pixel_values (B * g * g, 1, p, p) float32, grid_thws (B, 2) int64, labels (B,)) of the
        images at ``index``, shifted (training) when ``shift`` > 0."""
        images = self.images[index].float() / 255.0
        if shift:
            if generator is None:
                raise ValueError("shifting images needs the run's generator")
            images = shift_images(images, shift, generator)
        images = (images - self.mean) / self.std
        b, h, w = images.shape
        grid = torch.tensor([[h // patch, w // patch]], dtype=torch.int64).expand(b, 2)
        return to_patches(images, patch), grid, self.labels[index]


# ---- towers -----------------------------------------------------------------------------------


class MeanPoolClassifier(nn.Module):
    """A MoonViT with a linear head on the mean of each image's patch rows (after its final norm)."""

    def __init__(self, encoder: MoonViT, num_classes: int) -> None:
        super().__init__()
        if encoder.config.merge_kernel_size != (1, 1):
            raise ValueError(
                f"the head pools patch rows: merge_kernel_size must be (1, 1), got {encoder.config.merge_kernel_size}"
            )
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, num_classes)
        nn.init.trunc_normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """(L, C, p, p), (N, 2) -> (N, classes) logits."""
        rows = self.encoder(pixel_values, grid_thws).last_hidden_state  # (L, D)
        counts = grid_thws.prod(dim=1)
        item = torch.repeat_interleave(torch.arange(len(counts)), counts)
        sums = rows.new_zeros(len(counts), rows.shape[1]).index_add_(0, item, rows)
        return self.head(sums / counts[:, None].to(rows.dtype))


def build_tower(name: str, budget: Budget) -> nn.Module:
    """A tower of :data:`TOWERS` at ``budget``'s shape, one-channel input, with a 10-class head;
    its weights drawn from ``budget.seed``."""
    torch.manual_seed(budget.seed)
    shared: dict[str, Any] = dict(
        patch_size=budget.patch,
        hidden_size=budget.width,
        num_hidden_layers=budget.depth,
        num_attention_heads=budget.heads,
        intermediate_size=budget.mlp,
        num_channels=1,
        layer_norm_eps=1e-6,
        attn_implementation="sdpa",  # the same attention call in every tower
    )
    if name in ("cls", "gap"):
        pooling: dict[str, Any] = dict(pool="token") if name == "cls" else dict(class_token=False, pool="avg")
        return ClassicViT(ClassicViTConfig(image_size=budget.image, num_classes=CLASSES, **pooling, **shared))
    if name == "moonvit":
        config = MoonViTConfig(
            merge_kernel_size=(1, 1), init_pos_emb_height=budget.grid, init_pos_emb_width=budget.grid, **shared
        )
        return MeanPoolClassifier(MoonViT(config), CLASSES)
    raise ValueError(f"unknown tower {name!r}; choose from {', '.join(TOWERS)}")


def tower_logits(model: nn.Module, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
    """(N, classes) logits of any tower :func:`build_tower` makes."""
    if isinstance(model, ClassicViT):
        logits = model(pixel_values, grid_thws).logits
        assert logits is not None, "the classic towers are built with a head"
        return logits
    return model(pixel_values, grid_thws)


def position_table(model: nn.Module) -> torch.Tensor:
    """(G, G, D) float32: a tower's learned position table (a 1D table's patch rows, in raster order)."""
    if isinstance(model, ClassicViT):
        side = model.config.grid_side
        return grid_table(model.pos_embed[0, model.config.num_prefix_tokens :], (side, side))
    if isinstance(model, MeanPoolClassifier):
        return grid_table(model.encoder.patch_embed.pos_emb.weight)
    raise TypeError(f"no position table known for {type(model).__name__}")


def save_tower(model: nn.Module, folder: Path) -> None:
    """``save_pretrained`` of the tower (the MoonViT's head beside it in ``head.safetensors``)."""
    if isinstance(model, ClassicViT):
        model.save_pretrained(folder)
    elif isinstance(model, MeanPoolClassifier):
        model.encoder.save_pretrained(folder)
        save_file({k: v.detach().contiguous() for k, v in model.head.state_dict().items()}, folder / "head.safetensors")
    else:
        raise TypeError(f"cannot save a {type(model).__name__}")


# ---- training ---------------------------------------------------------------------------------

NO_DECAY = ("pos_embed", "cls_token", "dist_token", "pos_emb.weight")
"""Besides norms and biases (every 1-D tensor), the position tables and prefix tokens: not decayed."""


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on the matrices only (the ViT recipe)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        (no_decay if param.ndim < 2 or name.endswith(NO_DECAY) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_tower(
    model: nn.Module, data: Pixels, budget: Budget, desc: str = "train", progress: bool = True
) -> dict[str, float]:
    """Train ``model`` for ``budget.steps`` steps of cross-entropy on ``data``: AdamW, linear warmup
    then cosine, the global gradient norm clipped. The batches (epochs of a seeded permutation) and
    their shifts come from ``budget.seed`` alone, so every tower sees the very same images.

    Returns the mean loss of the first and the last tenth of the steps, and the seconds taken."""
    generator = torch.Generator().manual_seed(budget.seed)
    groups = param_groups(model, budget.weight_decay)
    try:  # fused where this torch has the kernel: the per-tensor loop costs as much as a small tower's step
        optimizer = torch.optim.AdamW(groups, lr=budget.lr, betas=(0.9, 0.999), fused=True)
    except (RuntimeError, TypeError):
        optimizer = torch.optim.AdamW(groups, lr=budget.lr, betas=(0.9, 0.999))
    schedule = build_schedule(optimizer, budget.steps, round(budget.warmup * budget.steps), budget.min_lr_ratio)
    order = torch.empty(0, dtype=torch.int64)
    losses: list[float] = []
    model.train()
    start = time.perf_counter()
    bar = tqdm(range(budget.steps), desc=desc, disable=not progress, dynamic_ncols=True)
    for _ in bar:
        if len(order) < budget.batch_size:  # a new epoch; the images left over start it
            order = torch.cat([order, torch.randperm(len(data), generator=generator)])
        index, order = order[: budget.batch_size], order[budget.batch_size :]
        pixel_values, grid, labels = data.batch(index, budget.patch, budget.shift, generator)
        loss = F.cross_entropy(tower_logits(model, pixel_values, grid), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if budget.clip_grad:
            nn.utils.clip_grad_norm_(model.parameters(), budget.clip_grad)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if len(losses) % 20 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    seconds = time.perf_counter() - start
    tenth = max(len(losses) // 10, 1)
    return {
        "first_loss": float(np.mean(losses[:tenth])),
        "last_loss": float(np.mean(losses[-tenth:])),
        "seconds": seconds,
    }


@torch.no_grad()
def evaluate(model: nn.Module, data: Pixels, patch: int, batch_size: int = 500) -> float:
    """Top-1 accuracy of ``model`` on every image of ``data`` (eval mode, no augmentation)."""
    model.eval()
    correct = 0
    for start in range(0, len(data), batch_size):
        index = torch.arange(start, min(start + batch_size, len(data)))
        pixel_values, grid, labels = data.batch(index, patch)
        correct += int((tower_logits(model, pixel_values, grid).argmax(dim=1) == labels).sum())
    return correct / len(data)


# ---- the table's locality ---------------------------------------------------------------------


def locality(table: torch.Tensor, far: int = FAR) -> dict[str, Any]:
    """How much a (H, W, D) position table is organised by 2D distance.

    Returns ``neighbours``: the mean cosine similarity of 4-neighbour positions (one step along a row
    or a column); ``far``: of positions ``far`` or more steps apart along a row or a column
    (Chebyshev distance); ``nearest_is_neighbour``: the share of positions whose most similar other
    row is a 4-neighbour's (a table that knows nothing of 2D: about the neighbours' share of the
    other rows, 168 / 2352 = 7% on 7 x 7); ``by_distance``: the mean similarity at each Manhattan
    distance 1, 2, ... (a list); ``directions``: the mean similarity one step up or down
    (``above_below``: for a 1D table, rows ``W`` apart in its list), one step left or right
    (``beside``: adjacent rows of the list), one step diagonally (``diagonal``: two steps away off
    the row and column), and two steps away in the same row or column (``in_line_2``: above
    ``diagonal`` where the table has the paper's row-column structure).
    """
    h, w, _ = table.shape
    sim = position_similarity(table).reshape(h * w, h * w).double()
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    dy, dx = (ys[:, None] - ys[None]).abs(), (xs[:, None] - xs[None]).abs()
    manhattan, chebyshev = dy + dx, torch.maximum(dy, dx)
    neighbour = manhattan == 1
    far_apart = chebyshev >= far
    others = sim.clone().fill_diagonal_(-math.inf)
    nearest = others.argmax(dim=1)
    return {
        "neighbours": float(sim[neighbour].mean()),
        "far": float(sim[far_apart].mean()) if far_apart.any() else math.nan,
        "nearest_is_neighbour": float(neighbour[torch.arange(h * w), nearest].double().mean()),
        "by_distance": [float(sim[manhattan == d].mean()) for d in range(1, int(manhattan.max()) + 1)],
        "directions": {
            name: float(sim[mask].mean()) if mask.any() else math.nan
            for name, mask in (
                ("above_below", (dy == 1) & (dx == 0)),
                ("beside", (dy == 0) & (dx == 1)),
                ("diagonal", (dy == 1) & (dx == 1)),
                ("in_line_2", (manhattan == 2) & ((dy == 0) | (dx == 0))),
            )
        },
    }


# ---- the run ----------------------------------------------------------------------------------


def tower_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def run_tower(
    name: str, budget: Budget, train: Pixels, test: Pixels, out: Path, progress: bool = True
) -> dict[str, Any]:
    """Build, train, score, save one tower; its row of the results."""
    model = build_tower(name, budget)
    fit = train_tower(model, train, budget, desc=name, progress=progress)
    top1 = evaluate(model, test, budget.patch)
    save_tower(model, out / name)
    with torch.no_grad():
        table = position_table(model)
    return {
        "tower": name,
        "what": TOWERS[name],
        "params": tower_params(model),
        "test_top1": top1,
        **fit,
        "locality": locality(table),
        "table": table,
    }


def table_lines(rows: Sequence[dict[str, Any]], budget: Budget, train_size: int, test_size: int) -> list[str]:
    """The results as a markdown table."""
    epochs = budget.steps * budget.batch_size / train_size
    lines = [
        "| tower | params | test top-1 | loss first / last 10% | minutes | table: 4-neighbours | "
        f"table: {FAR}+ apart | nearest row a 4-neighbour |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        loc = row["locality"]
        lines.append(
            f"| {row['what']} | {row['params'] / 1e6:.2f} M | {row['test_top1']:.4f} "
            f"({round(row['test_top1'] * test_size):,} / {test_size:,}) | {row['first_loss']:.3f} / "
            f"{row['last_loss']:.3f} | {row['seconds'] / 60:.1f} | {loc['neighbours']:.3f} | {loc['far']:.3f} | "
            f"{loc['nearest_is_neighbour']:.0%} |"
        )
    lines += [
        "",
        f"Each: {budget.depth} blocks x {budget.width} ({budget.heads} heads, MLP {budget.mlp}), patch {budget.patch} "
        f"on {budget.image} px ({budget.grid}x{budget.grid} grid); {budget.steps:,} steps of {budget.batch_size} "
        f"({epochs:.1f} epochs of {train_size:,}); AdamW lr {budget.lr:g}, weight decay {budget.weight_decay:g}, "
        f"warmup {budget.warmup:.0%} then cosine to {budget.min_lr_ratio:g}x, clip {budget.clip_grad:g}; "
        f"shifts up to {budget.shift} px; seed {budget.seed}; test {test_size:,} images.",
    ]
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/vit_claims.py", description=__doc__.split("\n\n")[0])
    d = Budget()
    parser.add_argument(
        "--out", type=output_dir, help="folder for the results, towers and pictures (default: a new temporary folder)"
    )
    parser.add_argument("--picture", type=output_file, help="also write the (a) tower's table picture here (PNG)")
    parser.add_argument(
        "--data-dir", type=existing_folder, default=DEFAULT_FASHION_MNIST_DIR,
        help=f"Fashion-MNIST's IDX files (default: {DEFAULT_FASHION_MNIST_DIR})",
    )  # fmt: skip
    parser.add_argument(
        "--towers", nargs="+", choices=list(TOWERS), default=list(TOWERS), help="which towers (default: all three)"
    )
    parser.add_argument("--width", type=positive_int, default=d.width, help=f"hidden size (default: {d.width})")
    parser.add_argument("--depth", type=positive_int, default=d.depth, help=f"blocks (default: {d.depth})")
    parser.add_argument("--heads", type=positive_int, default=d.heads, help=f"attention heads (default: {d.heads})")
    parser.add_argument("--mlp", type=positive_int, default=d.mlp, help=f"MLP hidden size (default: {d.mlp})")
    parser.add_argument("--steps", type=positive_int, default=d.steps, help=f"training steps (default: {d.steps})")
    parser.add_argument(
        "--batch-size", type=positive_int, default=d.batch_size, help=f"images per step (default: {d.batch_size})"
    )
    parser.add_argument("--lr", type=positive_float, default=d.lr, help=f"peak learning rate (default: {d.lr:g})")
    parser.add_argument(
        "--weight-decay", type=non_negative_float, default=d.weight_decay,
        help=f"AdamW weight decay of the matrices (default: {d.weight_decay:g})",
    )  # fmt: skip
    parser.add_argument(
        "--shift", type=non_negative_int, default=d.shift,
        help=f"training images moved by up to this many px per axis (0: no augmentation; default: {d.shift})",
    )  # fmt: skip
    parser.add_argument(
        "--limit-train", type=positive_int, help="train on the first N training images only (smoke runs)"
    )
    parser.add_argument("--limit-test", type=positive_int, help="score the first N test images only (smoke runs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_seed_argument(parser, "seed of every tower's weights, batches and shifts")
    add_threads_argument(parser)
    return parser


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    threads = apply_threads(args.threads)
    budget = Budget(
        width=args.width,
        depth=args.depth,
        heads=args.heads,
        mlp=args.mlp,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        shift=args.shift,
        seed=args.seed,
    )
    out = args.out or Path(tempfile.mkdtemp(prefix="vit-claims-"))
    out.mkdir(parents=True, exist_ok=True)
    dataset = load_dataset("fashion-mnist", args.data_dir)
    train_images, train_labels = dataset.train.images[: args.limit_train], dataset.train.labels[: args.limit_train]
    test_images, test_labels = dataset.test.images[: args.limit_test], dataset.test.labels[: args.limit_test]
    assert isinstance(train_images, np.ndarray) and isinstance(test_images, np.ndarray)
    mean, std = pixel_stats(train_images)
    train, test = Pixels(train_images, train_labels, mean, std), Pixels(test_images, test_labels, mean, std)
    host = host_line()
    command = shlex.join(["python", "benchmarks/vit_claims.py", *(sys.argv[1:] if argv is None else argv)])
    log(f"host: {host}; {threads} threads; torch {torch.__version__}")
    log(f"data: {len(train):,} train, {len(test):,} test; pixel mean {mean:.4f}, std {std:.4f}; out: {out}")

    load_before = os.getloadavg()  # the machine may be shared: what else ran is part of the wall time
    start = time.perf_counter()
    rows = []
    for name in args.towers:
        row = run_tower(name, budget, train, test, out, progress=not args.no_progress)
        log(f"{name}: test top-1 {row['test_top1']:.4f} in {row['seconds'] / 60:.1f} min")
        rows.append(row)
    total = time.perf_counter() - start
    load = f"load average (1, 5, 15 min) {_loads(load_before)} before, {_loads(os.getloadavg())} after"

    pictures = {}
    for row in rows:
        title = f"{row['what']}: position-table cosine similarity, {budget.grid}x{budget.grid}"
        pictures[row["tower"]] = str(
            save_table_similarity(row["table"], out / f"position-similarity-{row['tower']}.png", title)
        )
        if row["tower"] == "cls" and args.picture:
            save_table_similarity(row["table"], args.picture, title)
    lines = [
        f"host: {host}; {threads} threads; torch {torch.__version__}",
        "",
        *table_lines(rows, budget, len(train), len(test)),
        f"Wall time of the {len(rows)} trainings and scorings: {total / 60:.1f} min; {load}.",
    ]
    for row in rows:
        by_distance = ", ".join(f"{v:.3f}" for v in row["locality"]["by_distance"])
        directions = ", ".join(f"{k} {v:.3f}" for k, v in row["locality"]["directions"].items())
        lines.append(f"{row['tower']}: table similarity by Manhattan distance 1, 2, ...: {by_distance}; {directions}")
    log("")
    for line in lines:
        log(line)
    results = {
        "command": command,
        "host": host,
        "threads": threads,
        "torch": torch.__version__,
        "budget": asdict(budget),
        "train_images": len(train),
        "test_images": len(test),
        "pixel_mean_std": [mean, std],
        "minutes": total / 60,
        "load": load,
        "towers": [{k: v for k, v in row.items() if k != "table"} for row in rows],
        "pictures": pictures,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(f"```\n{command}\n```\n\n" + "\n".join(lines) + "\n")
    log(f"wrote {out / 'results.md'}, {out / 'results.json'}, the towers and the pictures")
    return results


def _loads(loads: Sequence[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in loads)


if __name__ == "__main__":
    main()

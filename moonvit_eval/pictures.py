"""Pictures of what an encoder learned: its position table's similarity map (the ViT paper's figure).

    python -m moonvit_eval.pictures --checkpoint checkpoints/fm-supervised --grid 4 4
    # -> outputs/pictures/fm-supervised-position-similarity-4x4.png (or --out FILE.png)

Each small map is one position of the learnable table; its pixels are that position's cosine
similarity to every other position. ``--grid ROWS COLS`` draws the table as the encoder adds it to
an image of that patch grid (its bicubic resampling); without it, the table as stored. A table
trained at small grids is best looked at at those grids: the stored rows are seen only through
the resampling's taps. A random table shows noise.
"""

from __future__ import annotations

import argparse
import math
import textwrap
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moonvit import MoonViT
from moonvit.cli import ArgumentParser, add_checkpoint_argument, exit_on, output_file, positive_int
from moonvit.families.vit import ClassicViT
from moonvit.model.interface import tower_name

__all__ = [
    "grid_table",
    "position_similarity",
    "resampled_table",
    "save_position_similarity",
    "save_table_similarity",
    "stored_table",
]


def resampled_table(encoder: MoonViT | ClassicViT, height: int, width: int) -> torch.Tensor:
    """(height, width, D) float32: the position table as the encoder adds it to an image of a
    height x width patch grid (``position_table``: its own resampling, as in the forward; a classic
    ViT's by its checkpoint's rule)."""
    with torch.no_grad():
        return encoder.position_table(height, width).detach().float()


def stored_table(encoder: MoonViT | ClassicViT) -> torch.Tensor:
    """(H, W, D) float32: the position table as the checkpoint stores it: MoonViT's 2D table, or a
    classic ViT's 1D table's patch rows on its native G x G grid (its prefix tokens' rows left out)."""
    with torch.no_grad():
        if isinstance(encoder, ClassicViT):
            side = encoder.config.grid_side
            return encoder.position_table(side, side).detach().float()  # the native grid: the stored rows
        return encoder.patch_embed.pos_emb.weight.detach().float()


def position_similarity(table: torch.Tensor) -> torch.Tensor:
    """(H, W, D) table -> (H, W, H, W): the cosine similarity of each position to every position."""
    h, w, d = table.shape
    rows = F.normalize(table.reshape(h * w, d).double(), dim=1)
    return (rows @ rows.T).reshape(h, w, h, w).float()


def save_position_similarity(table: torch.Tensor, path: Path, title: str, stride: int = 1) -> None:
    """Draw :func:`position_similarity` as an (H / stride) x (W / stride) grid of small maps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    similarity = position_similarity(table)[::stride, ::stride]
    rows, cols = similarity.shape[:2]
    width, maps_height = cols * 0.5 + 1, rows * 0.5 + 0.4
    figure, axes = plt.subplots(rows, cols, figsize=(width, maps_height), squeeze=False, dpi=DPI)
    for r in range(rows):
        for c in range(cols):
            axes[r, c].imshow(similarity[r, c].numpy(), cmap="viridis", vmin=-1, vmax=1)
            axes[r, c].set_axis_off()
    text, title_height = fit_title(figure, title, fontsize=9)
    # the maps keep their size; the figure grows by the title's height, wrapped to the figure's width
    figure.set_figheight(maps_height + title_height)
    text.set_y(1 - 0.04 / (maps_height + title_height))  # a small margin above the title
    top = maps_height / (maps_height + title_height)
    figure.subplots_adjust(left=0.01, right=0.99, bottom=0.01 * top, top=top - 0.01, wspace=0.08, hspace=0.08)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI)
    plt.close(figure)


def grid_table(table: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
    """A position table as (H, W, D) float32, from (H, W, D) or from (H * W, D) rows in raster order.

    ``grid`` (H, W) says how the rows of a (H * W, D) table lie; without it they must fill a square
    (a classic ViT's 1D table: its patch rows, without the prefix tokens' rows)."""
    if not isinstance(table, torch.Tensor) or not table.is_floating_point():
        raise TypeError(f"the position table must be a floating tensor, got {getattr(table, 'dtype', type(table))}")
    table = table.detach().float().cpu()
    if table.ndim == 3:
        if grid is not None and tuple(grid) != tuple(table.shape[:2]):
            raise ValueError(
                f"a {tuple(table.shape)} table lies on a {table.shape[0]}x{table.shape[1]} grid, not {grid}"
            )
        return table
    if table.ndim != 2:
        raise ValueError(f"the position table must be (G*G, D) or (H, W, D), got shape {tuple(table.shape)}")
    count = table.shape[0]
    if grid is None:
        side = math.isqrt(count)
        if side * side != count:
            raise ValueError(
                f"a (N, D) table of {count} rows is not a square grid; give its grid (H, W), or drop the "
                "prefix tokens' rows (CLS, distillation) first"
            )
        grid = (side, side)
    rows, cols = grid
    if rows * cols != count:
        raise ValueError(f"a table of {count} rows does not fill a {rows}x{cols} grid")
    return table.reshape(rows, cols, -1)


def save_table_similarity(
    table: torch.Tensor, path: str | Path, title: str, grid: tuple[int, int] | None = None
) -> Path:
    """Write the ViT paper's position-similarity figure of a table as a PNG: one small map per
    position (H x W maps), each the cosine similarity of that position's row to every row.

    Args:
        table: (H * W, D) rows in raster order (a 1D table's patch rows) or (H, W, D) (a 2D table);
            any floating dtype, any device.
        path: the PNG to write (its folder is created).
        title: the picture's title (wrapped to the picture's width).
        grid: (H, W) of a (H * W, D) table that is not square.

    Returns the path written.
    """
    path = Path(path)
    save_position_similarity(grid_table(table, grid), path, title)
    return path


DPI = 80


def fit_title(figure: Any, text: str, fontsize: float) -> tuple[Any, float]:
    """Set ``text`` as the figure's title, wrapped at word boundaries to fit its width; returns the
    title's Text and the height in inches it takes (with a margin)."""
    renderer = figure.canvas.get_renderer()
    room = figure.get_figwidth() * figure.dpi * 0.96
    title = figure.suptitle(text, fontsize=fontsize, y=1.0, va="top")
    for columns in range(len(text), 0, -1):
        title.set_text(textwrap.fill(text, columns, break_long_words=True))
        if title.get_window_extent(renderer).width <= room:
            break
    return title, title.get_window_extent(renderer).height / figure.dpi + 0.16


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m moonvit_eval.pictures", description=__doc__.split("\n\n")[0])
    add_checkpoint_argument(parser, required=True)
    parser.add_argument(
        "--out",
        type=output_file,
        help="the PNG to write (default: outputs/pictures/<checkpoint>-position-similarity[-ROWSxCOLS].png)",
    )
    parser.add_argument(
        "--grid", type=positive_int, nargs=2, metavar=("ROWS", "COLS"),
        help="draw the table resampled to this patch grid, as the encoder adds it to such an image "
        "(default: the stored table)",
    )  # fmt: skip
    parser.add_argument("--stride", type=positive_int, default=1, help="draw every N-th position per axis (default: 1)")
    parser.add_argument("--title", help="the picture's title (default: the checkpoint's name)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    with exit_on(parser):
        encoder = MoonViT.from_pretrained(args.checkpoint, dtype=torch.float32)
    if not isinstance(encoder, (MoonViT, ClassicViT)):  # OpenVLA's fused backbone: a table per tower
        parser.error(
            f"--checkpoint {args.checkpoint} holds a {tower_name(encoder.config)}, not one tower with one position "
            "table; draw a tower's with save_position_similarity(encoder.featurizer.position_table(rows, cols), ...)"
        )
    if args.grid:
        table = resampled_table(encoder, *args.grid)
        shape = f"resampled to {args.grid[0]}x{args.grid[1]}"
    else:
        table = stored_table(encoder)
        shape = "as stored"
    name = Path(str(args.checkpoint)).name
    title = args.title or f"{name}: position-table cosine similarity ({shape})"
    out = args.out or default_out(name, args.grid)
    save_position_similarity(table, out, title, args.stride)
    print(f"wrote {out}")


def default_out(name: str, grid: list[int] | None) -> Path:
    """Where a picture goes without ``--out``."""
    suffix = f"-{grid[0]}x{grid[1]}" if grid else ""
    return Path("outputs") / "pictures" / f"{name}-position-similarity{suffix}.png"


if __name__ == "__main__":
    main()

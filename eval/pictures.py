"""Pictures of what an encoder learned: its position table's similarity map (the ViT paper's figure).

    python -m eval.pictures --checkpoint checkpoints/fm-supervised --grid 4 4 --out docs/img/position-similarity.png

Each small map is one position of the learnable table; its pixels are that position's cosine
similarity to every other position. ``--grid ROWS COLS`` draws the table as the encoder adds it to
an image of that patch grid (its bicubic resampling); without it, the table as stored. A table
trained at small grids is best looked at at those grids: the stored rows are seen only through
the resampling's taps. A random table shows noise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from moonvit import MoonViT
from moonvit.cli import add_checkpoint_argument, exit_on, output_file, positive_int
from moonvit.model.position import bicubic_resample_taps

__all__ = ["position_similarity", "resampled_table", "save_position_similarity"]


def resampled_table(encoder: MoonViT, height: int, width: int) -> torch.Tensor:
    """(height, width, D) float32: the position table as the encoder adds it to an image of a
    height x width patch grid (its own bicubic resampling, as in the forward)."""
    table = encoder.patch_embed.pos_emb
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    positions = torch.stack([rows.flatten(), cols.flatten()], dim=1)
    count = height * width
    taps, weights = bicubic_resample_taps(
        positions, torch.full((count,), height), torch.full((count,), width), *table.weight.shape[:2]
    )
    with torch.no_grad():
        return table(taps, weights).float().reshape(height, width, -1)


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
    figure, axes = plt.subplots(rows, cols, figsize=(cols * 0.5 + 1, rows * 0.5 + 0.8), squeeze=False)
    for r in range(rows):
        for c in range(cols):
            axes[r, c].imshow(similarity[r, c].numpy(), cmap="viridis", vmin=-1, vmax=1)
            axes[r, c].set_axis_off()
    figure.suptitle(title, fontsize=9)
    figure.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.94, wspace=0.08, hspace=0.08)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.pictures", description=__doc__.split("\n\n")[0])
    add_checkpoint_argument(parser, required=True)
    parser.add_argument("--out", type=output_file, required=True, help="the PNG to write")
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
    if args.grid:
        table = resampled_table(encoder, *args.grid)
        shape = f"resampled to {args.grid[0]}x{args.grid[1]}"
    else:
        table = encoder.patch_embed.pos_emb.weight.detach().float()
        shape = "as stored"
    title = args.title or f"{Path(str(args.checkpoint)).name}: position-table cosine similarity ({shape})"
    save_position_similarity(table, args.out, title, args.stride)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

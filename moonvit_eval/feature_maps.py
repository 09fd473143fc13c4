"""Pictures of patch features: the first three principal components of each encoder's patch tokens
as RGB, encoders side by side (DINO's and RADIO's picture of a teacher beside its students).

    python -m moonvit_eval.feature_maps --checkpoint checkpoints/fm-mae-ft --checkpoint checkpoints/fm-distilled \
        --dataset fashion-mnist --count 6 --short-side 168
    # -> outputs/pictures/feature-maps-fm-mae-ft-fm-distilled.png (or --out FILE.png)
    python -m moonvit_eval.feature_maps --checkpoint checkpoints/fm-mae-ft --dataset images:photos/

The images are a seeded choice of a dataset's test split, or of the images below a folder
(``images:DIR``, at any depth: a picture needs no labels).

Per encoder, one PCA over the patch tokens (``last_hidden_state``) of all shown images together,
so colours compare across images; each component is stretched to [0, 1] between its 1st and 99th
percentiles. Encoders of different widths have unrelated bases; a principal component's sign is
arbitrary, so each later encoder's components are flipped where that makes them correlate
positively, patch for patch, with the first encoder's same component: alike features then get
alike colours.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from moonvit import ImageProcessor, MoonViT, VisionEncoder, load_image
from moonvit.cli import (
    ArgumentParser,
    add_seed_argument,
    add_threads_argument,
    apply_threads,
    checkpoint_source,
    existing_folder,
    exit_on,
    output_file,
    positive_int,
)
from moonvit.encode import checkpoint_processors
from moonvit.media.image import ImageInput, images_below
from moonvit.names import display_name

from .datasets import DatasetError, load_dataset
from .features import ResizePolicy

__all__ = ["UNLABELLED_PREFIX", "align_signs", "patch_tokens", "pca_rgb", "save_feature_maps", "shown_images"]

UNLABELLED_PREFIX = "images:"
"""``--dataset images:DIR``: the images below DIR, at any depth; the pictures need no labels."""


def shown_images(spec: str, data_dir: Path | None, count: int, seed: int) -> tuple[str, list[ImageInput], list[str]]:
    """A seeded choice of ``count`` images (all when fewer) of a ``--dataset`` spec: a labelled
    dataset's test split, or the images below DIR for ``images:DIR``.

    Returns:
        (what the images are, for the title; the images in a stable order; their names).

    Raises:
        DatasetError: an unknown spec, missing files, or a folder with no image.
    """
    if spec.startswith(UNLABELLED_PREFIX):
        folder = Path(spec.removeprefix(UNLABELLED_PREFIX))
        try:
            files = images_below(folder)
        except ValueError as error:
            raise DatasetError(str(error)) from error
        rows = _choose(len(files), count, seed)
        # names are text of the title and the record: a file name that is not UTF-8 is escaped
        names = [display_name(files[row].relative_to(folder).as_posix()) for row in rows]
        return f"images of {display_name(folder)}", [files[row] for row in rows], names
    test = load_dataset(spec, data_dir, seed=seed).test
    rows = _choose(len(test), count, seed)
    return f"{spec} test images", [test.images[row] for row in rows], [f"test #{row}" for row in rows]


def _choose(total: int, count: int, seed: int) -> list[int]:
    """``count`` of ``range(total)`` (all when fewer), seeded, in ascending order."""
    return sorted(np.random.default_rng(seed).choice(total, min(count, total), replace=False).tolist())


@torch.no_grad()
def patch_tokens(encoder: VisionEncoder, processor: ImageProcessor, images: list[Image.Image]) -> list[torch.Tensor]:
    """Each image's (rows, cols, D) float32 patch tokens, the image encoded on its own (a classic ViT's
    patch rows, its CLS row left out)."""
    out = []
    for image in images:
        batch = processor(image)
        hidden = encoder(batch.pixel_values.to(encoder.dtype), batch.grid_hws).last_hidden_state
        rows, cols = batch.grid_hws[0].tolist()
        out.append(hidden.float().reshape(rows, cols, -1))
    return out


def pca_rgb(tokens: list[torch.Tensor]) -> torch.Tensor:
    """(L, 3) float64 scores of all images' patches on the first three principal components of
    their tokens together (``tokens``: per image (rows, cols, D)), before any stretching."""
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in tokens]).double()
    x = x - x.mean(dim=0)
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    return x @ vh[:3].T


def align_signs(reference: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``scores`` (L, 3) with each column negated where it correlates negatively with ``reference``'s."""
    if scores.shape != reference.shape:
        raise ValueError(
            f"the encoders cut the images into different patches ({reference.shape[0]} and {scores.shape[0]}): "
            "their maps cannot be compared patch for patch"
        )
    signs = torch.where((reference * scores).sum(dim=0) < 0, -1.0, 1.0).to(scores.dtype)
    return scores * signs


def stretch(scores: torch.Tensor) -> torch.Tensor:
    """Each column to [0, 1] between its 1st and 99th percentiles."""
    low, high = torch.quantile(scores, 0.01, dim=0), torch.quantile(scores, 0.99, dim=0)
    return ((scores - low) / (high - low).clamp_min(1e-12)).clamp(0, 1)


def save_feature_maps(
    images: list[Image.Image], maps: dict[str, list[torch.Tensor]], path: Path, title: str = ""
) -> None:
    """A grid: one row per image, its picture then one (rows, cols, 3) RGB map per encoder (``maps``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(maps)
    figure, axes = plt.subplots(
        len(images), 1 + len(names), figsize=(2 * (1 + len(names)), 2 * len(images)), squeeze=False
    )
    for row, image in enumerate(images):
        axes[row, 0].imshow(np.asarray(image.convert("RGB")))
        for col, name in enumerate(names, start=1):
            axes[row, col].imshow(maps[name][row].numpy(), interpolation="nearest")
        for col, label in enumerate(["image", *names]):
            axes[row, col].set_axis_off()
            if row == 0:
                axes[row, col].set_title("\n".join(textwrap.wrap(label, 18)), fontsize=9)
    if title:
        figure.suptitle("\n".join(textwrap.wrap(title, 12 * (1 + len(names)))), fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m moonvit_eval.feature_maps", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkpoint", action="append", required=True, type=checkpoint_source,
        help="a checkpoint folder or hub id; repeat for encoders side by side (the first sets the colours)",
    )  # fmt: skip
    parser.add_argument(
        "--dataset", default="fashion-mnist",
        help="fashion-mnist, digits or imagefolder:DIR (their test images), or images:DIR (the images below "
        "DIR, no labels needed; default: fashion-mnist)",
    )  # fmt: skip
    parser.add_argument("--data-dir", type=existing_folder, help="Fashion-MNIST IDX folder")
    parser.add_argument("--count", type=positive_int, default=6, help="images shown (default: 6)")
    parser.add_argument(
        "--short-side", type=positive_int, default=168,
        help="images resized to this short side, px (default: 168: 12 x 12 patches for a square image)",
    )  # fmt: skip
    add_seed_argument(parser, "which test images are shown")
    parser.add_argument("--out", type=output_file, help="the PNG (default: outputs/pictures/feature-maps-....png)")
    add_threads_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    with exit_on(parser, DatasetError, ValueError):
        shown, images, image_names = shown_images(args.dataset, args.data_dir, args.count, args.seed)
        resize = ResizePolicy(args.short_side)
        pictures = [resize(load_image(image)) for image in images]
        maps: dict[str, list[torch.Tensor]] = {}
        reference = None
        for folder in args.checkpoint:
            encoder = MoonViT.from_pretrained(folder, dtype=torch.float32).eval()
            processor = checkpoint_processors(folder, encoder.config).image  # a classic ViT's: its native rule
            tokens = patch_tokens(encoder, processor, pictures)
            scores = pca_rgb(tokens)
            scores = scores if reference is None else align_signs(reference, scores)
            reference = scores if reference is None else reference
            rgb = stretch(scores).float()
            sizes = [t.shape[0] * t.shape[1] for t in tokens]
            name = str(folder).rstrip("/").rsplit("/", 1)[-1]
            maps[name] = [m.reshape(t.shape[0], t.shape[1], 3) for m, t in zip(rgb.split(sizes), tokens)]
    names = "-".join(maps)
    out = args.out or Path("outputs/pictures") / f"feature-maps-{names}.png"
    title = f"first 3 principal components of the patch tokens, {shown} at {args.short_side} px"
    save_feature_maps(pictures, maps, out, title)
    print(f"wrote {out}")
    return {"path": str(out), "encoders": list(maps), "images": image_names}


if __name__ == "__main__":
    main()

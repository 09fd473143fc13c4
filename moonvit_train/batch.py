"""From planned images to a batch the encoder takes: pixels decoded, resized, augmented, cut into
patches, the dropped patches left out, and the pack's grid metadata built.

A :class:`Batch` holds only the kept patches of each image; its grid gives every kept patch the
position-table row and RoPE angles of its place in the image's full grid
(``build_packed_grid(..., keep=...)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from moonvit import (
    ImageLoadError,
    MoonViTImageProcessor,
    PackedGrid,
    build_packed_grid,
    image_size,
    patchify,
)
from moonvit_eval.datasets import Split

from .augment import AugmentConfig, Mixed, augment_image, mix_images
from .classic import EncoderConfig
from .plan import PlannedTrainImage

__all__ = ["Batch", "ImageSource", "UnreadableImageError", "kept_rows", "render_pack"]


class UnreadableImageError(ValueError):
    """A planned image could not be decoded when its pack was rendered (the message names the file)."""


class ImageSource:
    """The images and labels of a split (or of some of its rows) as Pillow images, with their sizes.

    Arrays of (N, H, W) uint8 give grayscale ("L") images, (N, H, W, 3) RGB ones; files are decoded
    by the processor's loader (RGB, EXIF orientation, transparency).

    Args:
        rows: the split's rows this source holds (default: all).
        split_sizes: (len(split), 2) int64 (width, height) of every image of the split, when they
            were read already (else file headers are read on demand).
    """

    def __init__(
        self,
        split: Split,
        processor: MoonViTImageProcessor,
        rows: np.ndarray | None = None,
        split_sizes: np.ndarray | None = None,
    ) -> None:
        self.split = split
        self.processor = processor
        self.rows = np.arange(len(split)) if rows is None else np.asarray(rows, dtype=np.int64)
        self.labels = np.asarray(split.labels)[self.rows]
        self.split_sizes = split_sizes

    def __len__(self) -> int:
        return len(self.rows)

    def sizes(self) -> np.ndarray:
        """(N, 2) int64 native (width, height) of each image (file headers only, for files)."""
        images = self.split.images
        if isinstance(images, np.ndarray):
            return np.tile(np.array([images.shape[2], images.shape[1]], dtype=np.int64), (len(self), 1))
        if self.split_sizes is not None:
            return self.split_sizes[self.rows]
        return np.array([image_size(images[int(row)]) for row in self.rows], dtype=np.int64).reshape(-1, 2)

    def image(self, index: int) -> Image.Image:
        """Image ``index`` (a position in this source).

        Raises:
            UnreadableImageError: a file that cannot be decoded, named.
        """
        images = self.split.images
        row = int(self.rows[index])
        if isinstance(images, np.ndarray):
            return Image.fromarray(images[row])
        try:
            return self.processor.load_image(images[row])
        except (ImageLoadError, OSError) as error:
            raise UnreadableImageError(
                f"image {images[row]} cannot be decoded ({error}); --skip-bad-images checks every image before "
                "training and leaves out the ones that fail (listed in results.json)"
            ) from error


@dataclass
class Batch:
    """One pack of N images, L kept patches.

    Attributes:
        pixel_values: (L, 3, p, p) float32, normalised like the processor's output; each image's
            kept patches in raster order, images concatenated.
        grid: the pack's grid metadata (full grids, kept patches).
        labels: (N,) int64 class of each image.
        partner: (N,) int64 pack index of the image each was mixed with (itself when not mixed).
        lam: (N,) float32 weight of each image's own label.
        full_pixels: (L_full, 3, p, p) every patch of every image, normalised, for objectives
            that need the dropped ones too (MAE's targets); None otherwise.
        keep: per image, the sorted indices of its kept patches in its raster; None when every
            patch is kept.
    """

    pixel_values: torch.Tensor
    grid: PackedGrid
    labels: torch.Tensor
    partner: torch.Tensor
    lam: torch.Tensor
    full_pixels: torch.Tensor | None = None
    keep: list[torch.Tensor] | None = None

    @property
    def num_images(self) -> int:
        return self.grid.num_images

    def to(self, device: torch.device) -> Batch:
        return Batch(
            self.pixel_values.to(device),
            self.grid.to(device),
            self.labels.to(device),
            self.partner.to(device),
            self.lam.to(device),
            None if self.full_pixels is None else self.full_pixels.to(device),
            None if self.keep is None else [k.to(device) for k in self.keep],
        )


def kept_rows(grid_thws: torch.Tensor, keep: Sequence[torch.Tensor]) -> torch.Tensor:
    """(K,) int64 rows of the kept patches in the pack of the full images.

    ``grid_thws`` (N, 3) are the images' full grids; ``keep`` per image, its kept patches (sorted
    indices into its raster, as :attr:`Batch.keep`).
    """
    sizes = grid_thws.prod(dim=1)
    starts = sizes.cumsum(0) - sizes
    return torch.cat([start + k.to(starts.device) for start, k in zip(starts, keep)])


def render_pack(
    items: Sequence[PlannedTrainImage],
    source: ImageSource,
    encoder_config: EncoderConfig,
    augment: AugmentConfig | None,
    mix_rng: np.random.Generator | None = None,
    full_pixels: bool = False,
) -> Batch:
    """Decode, resize, augment (unless ``augment`` is None), mix and patchify a pack's images.

    Each image's randomness (crop, flip, RandAugment, which patches are kept) comes from its own
    seed; mixing draws from ``mix_rng`` (needed when ``augment`` mixes). With ``full_pixels`` the
    batch also holds every patch, dropped ones included (:attr:`Batch.full_pixels`).
    """
    p = encoder_config.patch_size
    arrays, keeps = [], []
    for item in items:
        rng = np.random.default_rng(item.seed)
        image = augment_image(source.image(item.index), (item.cols * p, item.rows * p), augment, rng)
        arrays.append(np.array(image))
        keeps.append(None if item.kept == item.patches else np.sort(rng.choice(item.patches, item.kept, replace=False)))
    grids = [(item.rows, item.cols) for item in items]
    mixed = Mixed.unmixed(len(items))
    if augment is not None and augment.mixing:
        if mix_rng is None:
            raise ValueError("mixing needs a generator")
        mixed = mix_images(arrays, grids, keeps, p, augment, mix_rng)

    patches, every = [], []
    for array, keep in zip(arrays, keeps):
        pixels = torch.from_numpy(array)
        pixels = pixels.unsqueeze(0).expand(3, -1, -1) if pixels.ndim == 2 else pixels.permute(2, 0, 1)
        cut = patchify(pixels, p)
        patches.append(cut if keep is None else cut[torch.from_numpy(keep)])
        every.append(cut)
    dropped = any(keep is not None for keep in keeps)
    keep_index = None
    if dropped:
        keep_index = [torch.arange(r * c) if k is None else torch.from_numpy(k) for k, (r, c) in zip(keeps, grids)]
    grid = build_packed_grid(torch.tensor(grids, dtype=torch.int64), encoder_config, keep=keep_index)
    labels = torch.from_numpy(source.labels[[item.index for item in items]])
    return Batch(
        source.processor.normalize(torch.cat(patches)),
        grid,
        labels,
        torch.from_numpy(mixed.partner),
        torch.from_numpy(mixed.lam),
        source.processor.normalize(torch.cat(every)) if full_pixels else None,
        keep_index,
    )

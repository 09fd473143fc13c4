"""Augmentation on the uint8 image, before it is cut into patches: crop, resize, flip, RandAugment
(all Pillow operations), and Mixup / CutMix between the images of a pack.

Everything random comes from a ``numpy`` generator handed in by the caller (seeded per image or
per pack by the plan), so an image is augmented the same way whenever its step is replayed.

**Mixup and CutMix on packed images of different sizes.** Each image of a pack is paired with
the next one (the last with the first) and, with probability ``mix_prob``, mixed with it: the
partner is resized to the image's own size (Pillow bilinear), then either blended (Mixup,
weight ``lam ~ Beta(a, a)`` on the image) or pasted into a box of about ``1 - lam`` of the
image's area (CutMix). CutMix boxes are aligned to the patch grid, so every patch comes from one
image alone and ``lam`` is recomputed exactly as the share of the image's *kept* patches (after
token dropping) lying outside the box. The label is mixed with the same ``lam``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

__all__ = ["RAND_AUGMENT_OPS", "AugmentConfig", "Mixed", "augment_image", "mix_images", "rand_augment"]


@dataclass(frozen=True)
class AugmentConfig:
    """Training augmentation (evaluation uses none).

    Attributes:
        crop_scale: smallest share of the image's area a random crop keeps (1: no crop). The
            crop has the aspect ratio of the target grid, so nothing is stretched.
        hflip: probability of a horizontal flip.
        randaugment_ops: RandAugment operations drawn per image (0: off).
        randaugment_magnitude: their strength, 0-10.
        mixup, cutmix: Beta(a, a) parameters (0: off); with both on, each mixed image uses one of
            them with equal probability.
        mix_prob: probability that an image is mixed with its partner when either is on.
        fill: the grey level that geometric operations fill uncovered pixels with.
    """

    crop_scale: float = 1.0
    hflip: float = 0.5
    randaugment_ops: int = 2
    randaugment_magnitude: float = 9.0
    mixup: float = 0.0
    cutmix: float = 0.0
    mix_prob: float = 1.0
    fill: int = 0

    @property
    def mixing(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0


# ---- RandAugment --------------------------------------------------------------------------------
# Each operation takes the image, a level in [0, 1] (magnitude / 10) and a random sign, as in
# RandAugment (Cubuk et al. 2020) with timm's ranges.


def _affine(image: Image.Image, matrix: tuple[float, ...], fill: int) -> Image.Image:
    return image.transform(image.size, Image.Transform.AFFINE, matrix, Image.Resampling.BILINEAR, fillcolor=fill)


def _enhance(kind: Callable[[Image.Image], ImageEnhance._Enhance]) -> Callable[..., Image.Image]:
    return lambda image, level, sign, fill: kind(image).enhance(1.0 + sign * 0.9 * level)


RAND_AUGMENT_OPS: dict[str, Callable[[Image.Image, float, float, int], Image.Image]] = {
    "AutoContrast": lambda image, level, sign, fill: ImageOps.autocontrast(image),
    "Equalize": lambda image, level, sign, fill: ImageOps.equalize(image),
    "Rotate": lambda image, level, sign, fill: image.rotate(
        sign * 30.0 * level, Image.Resampling.BILINEAR, fillcolor=fill
    ),
    "Solarize": lambda image, level, sign, fill: ImageOps.solarize(image, int(256 - 256 * level)),
    "Posterize": lambda image, level, sign, fill: ImageOps.posterize(image, 8 - int(4 * level)),
    "Color": _enhance(ImageEnhance.Color),
    "Contrast": _enhance(ImageEnhance.Contrast),
    "Brightness": _enhance(ImageEnhance.Brightness),
    "Sharpness": _enhance(ImageEnhance.Sharpness),
    "ShearX": lambda image, level, sign, fill: _affine(image, (1, sign * 0.3 * level, 0, 0, 1, 0), fill),
    "ShearY": lambda image, level, sign, fill: _affine(image, (1, 0, 0, sign * 0.3 * level, 1, 0), fill),
    "TranslateX": lambda image, level, sign, fill: _affine(
        image, (1, 0, sign * 0.45 * level * image.width, 0, 1, 0), fill
    ),
    "TranslateY": lambda image, level, sign, fill: _affine(
        image, (1, 0, 0, 0, 1, sign * 0.45 * level * image.height), fill
    ),
}
_OP_NAMES = tuple(RAND_AUGMENT_OPS)


def rand_augment(
    image: Image.Image, ops: int, magnitude: float, rng: np.random.Generator, fill: int = 0
) -> Image.Image:
    """RandAugment: ``ops`` operations drawn uniformly (with repeats), each applied with probability 0.5."""
    level = min(max(magnitude, 0.0), 10.0) / 10.0
    for name in rng.choice(_OP_NAMES, size=ops):
        if rng.random() < 0.5:
            sign = 1.0 if rng.random() < 0.5 else -1.0
            image = RAND_AUGMENT_OPS[str(name)](image, level, sign, fill)
    return image


# ---- one image ----------------------------------------------------------------------------------


def _crop_box(
    width: int, height: int, aspect: float, scale: float, rng: np.random.Generator
) -> tuple[float, float, float, float]:
    """A random box of ``scale`` to 1 of the image's area, with the target's ``aspect`` (w / h) where it fits."""
    area = width * height * rng.uniform(scale, 1.0)
    box_w = min(width, np.sqrt(area * aspect))
    box_h = min(height, box_w / aspect)
    left = rng.uniform(0, width - box_w)
    top = rng.uniform(0, height - box_h)
    return (left, top, left + box_w, top + box_h)


def augment_image(
    image: Image.Image, size: tuple[int, int], config: AugmentConfig | None, rng: np.random.Generator
) -> Image.Image:
    """Resize ``image`` to ``size`` (width, height) with Pillow bicubic, augmented unless ``config`` is None.

    Order: random crop (resized in the same call), horizontal flip, RandAugment.
    """
    if config is None:
        return image.resize(size, Image.Resampling.BICUBIC)
    box: tuple[float, float, float, float] | None = None
    if config.crop_scale < 1.0:
        box = _crop_box(image.width, image.height, size[0] / size[1], config.crop_scale, rng)
    image = image.resize(size, Image.Resampling.BICUBIC, box=box)
    if rng.random() < config.hflip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if config.randaugment_ops > 0:
        image = rand_augment(image, config.randaugment_ops, config.randaugment_magnitude, rng, config.fill)
    return image


# ---- Mixup / CutMix within a pack ---------------------------------------------------------------


@dataclass(frozen=True)
class Mixed:
    """Which image each image of a pack was mixed with, and how much of it is its own.

    Attributes:
        partner: (N,) int64, the pack index of each image's partner (itself when not mixed).
        lam: (N,) float32, the weight of the image's own label.
    """

    partner: np.ndarray
    lam: np.ndarray

    @classmethod
    def unmixed(cls, count: int) -> Mixed:
        return cls(np.arange(count, dtype=np.int64), np.ones(count, dtype=np.float32))


def mix_images(
    images: list[np.ndarray],
    grids: Sequence[tuple[int, int]],
    keeps: Sequence[np.ndarray | None],
    patch_size: int,
    config: AugmentConfig,
    rng: np.random.Generator,
) -> Mixed:
    """Mix each image of a pack with the next one, in place (see the module docstring).

    Args:
        images: N uint8 arrays (H, W) or (H, W, 3), of sizes ``grids`` x ``patch_size``; replaced.
        grids: (rows, cols) of each image.
        keeps: the sorted kept patch indices of each image (None: all).
    """
    count = len(images)
    if not config.mixing or count < 2:
        return Mixed.unmixed(count)
    originals = list(images)
    partner = (np.arange(count) + 1) % count
    lam = np.ones(count, dtype=np.float32)
    for i in range(count):
        if rng.random() >= config.mix_prob:
            partner[i] = i
            continue
        use_cutmix = config.cutmix > 0 and (config.mixup <= 0 or rng.random() < 0.5)
        draw = rng.beta(config.cutmix, config.cutmix) if use_cutmix else rng.beta(config.mixup, config.mixup)
        own = originals[i]
        other = np.asarray(
            Image.fromarray(originals[partner[i]]).resize((own.shape[1], own.shape[0]), Image.Resampling.BILINEAR)
        )
        if not use_cutmix:
            images[i] = (draw * own.astype(np.float32) + (1 - draw) * other).round().astype(np.uint8)
            lam[i] = draw
            continue
        rows, cols = grids[i]
        box_rows, box_cols = round(rows * np.sqrt(1 - draw)), round(cols * np.sqrt(1 - draw))
        top, left = rng.integers(0, rows - box_rows + 1), rng.integers(0, cols - box_cols + 1)
        mixed = own.copy()
        p = patch_size
        mixed[top * p : (top + box_rows) * p, left * p : (left + box_cols) * p] = other[
            top * p : (top + box_rows) * p, left * p : (left + box_cols) * p
        ]
        images[i] = mixed
        kept = keeps[i]
        if kept is None:
            kept = np.arange(rows * cols)
        inside = (kept // cols >= top) & (kept // cols < top + box_rows)
        inside &= (kept % cols >= left) & (kept % cols < left + box_cols)
        lam[i] = 1.0 - inside.mean()
    return Mixed(partner.astype(np.int64), lam)

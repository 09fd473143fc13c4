"""SigLIP's and SigLIP2 NaFlex's image processors, on the classic ViT's machinery
(:mod:`moonvit.families.vit.processor`).

Rules, chosen by name (:data:`SIGLIP_RULES`, :data:`SIGLIP2_RULES`, :func:`moonvit.media.processor_for`):

- ``siglip``: transformers' ``SiglipImageProcessor`` as the google/siglip-* releases ship it: resize to
  ``size`` (the release's size square: 224, 256, 384, 512, the tower's ``input_size`` where its table
  does not cover it, else its ``image_size``) with bicubic, ``x / 255``, mean and
  std 0.5, no crop (a :class:`~moonvit.families.vit.processor.ClassicViTImageProcessor`). A side
  that is not whole patches keeps its top-left patches, as the patch convolution reads it
  (so400m at 384 px, patch 14: 27 x 27 patches of the 384 x 384 resize);
- ``naflex``: SigLIP2 NaFlex's ``Siglip2ImageProcessor`` (:class:`NaFlexImageProcessor`): each image
  resized, aspect kept, to the largest size of whole patches within ``max_num_patches`` (256 by
  default; small images are scaled up to it), bilinear, ``x / 255``, mean and std 0.5;
- ``native``: for SigLIP, the classic ViT's native rule
  (:class:`~moonvit.families.vit.processor.NativeViTImageProcessor`: whole patches within a
  budget, never scaled up) with SigLIP's filter and normalisation; for SigLIP2 NaFlex, another
  name of ``naflex``: the NaFlex weights were trained on NaFlex's sizes (images scaled up or down
  to fill the budget, sides rounded up to whole patches), and that rule already keeps the aspect,
  uses whole patches and pads nothing, so it is their native rule.

A folder's own rule is its ``preprocessor_config.json``'s (``SiglipImageProcessor``,
``Siglip2ImageProcessor``, or this package's classes) or its timm ``pretrained_cfg``'s (timm's
so400m: crop_pct 1.0, bicubic, mean and std 0.5).

:class:`NaFlexImageProcessor` gives ``(rows * cols, 3, p, p)`` patches in raster order and each
image's ``(rows, cols)`` grid, not padded: transformers' ``Siglip2ImageProcessor`` pads every image
to ``max_num_patches`` rows with a mask and flattens each patch as (row, column, channel); its
unpadded rows are these patches, channels first. Pixel values equal, in float32, those of
transformers' PIL-backend processors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...media.processor import ImagePlan, _check_positive_int
from ...media.selection import register_processor_loader
from ...weights.config_keys import warn_unread_keys
from ..vit.config import ClassicViTConfig
from ..vit.processor import (
    HALF,
    RESAMPLE_NAMES,
    TRANSFORMERS_BOOKKEEPING,
    ClassicViTImageProcessor,
    NativeViTImageProcessor,
    PatchRule,
    RuleSet,
    fixed_file_reader,
    native_rule,
    transformers_normalisation,
)

__all__ = [
    "NAFLEX_EPS",
    "SIGLIP2_RULES",
    "SIGLIP_RULES",
    "NaFlexImageProcessor",
    "naflex_grid",
    "naflex_rule",
    "siglip_rule",
]

NAFLEX_EPS = 1e-5
"""The width of scales at which NaFlex's bisection stops (transformers' ``eps``)."""


def naflex_grid(height: int, width: int, patch_size: int, max_num_patches: int) -> tuple[int, int]:
    """(rows, cols) of a ``height`` x ``width`` image under SigLIP2 NaFlex's rule.

    transformers' ``get_image_size_for_max_num_patches``, step for step (the same float operations,
    so the same grid): a side scaled by ``s`` takes ``max(1, ceil(side * s / p))`` patches; ``s`` is
    bisected over ``[eps / 10, 100]`` until the interval is narrower than ``eps`` (1e-5), keeping
    the lower end whenever the grid fits ``max_num_patches``; the grid is the lower end's. Images
    are scaled up as well as down, so the grid fills most of the budget; the aspect is kept to
    within a patch per side.

    Raises:
        ValueError: a non-positive size, patch or budget, or an image so long and thin that one
            patch across its short side is already over the budget.
    """
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    _check_positive_int("patch_size", patch_size)
    _check_positive_int("max_num_patches", max_num_patches)

    def patches(side: int, scale: float) -> int:
        return max(1, math.ceil(side * scale / patch_size))

    low, high = NAFLEX_EPS / 10, 100.0
    while high - low >= NAFLEX_EPS:
        scale = (low + high) / 2
        if patches(height, scale) * patches(width, scale) <= max_num_patches:
            low = scale
        else:
            high = scale
    rows, cols = patches(height, low), patches(width, low)
    if rows * cols > max_num_patches:  # the bisection never found a fitting scale
        raise ValueError(
            f"a {width}x{height} image gives at least {rows * cols} patches of {patch_size} px under NaFlex's rule, "
            f"over max_num_patches={max_num_patches}"
        )
    return rows, cols


@dataclass(frozen=True)
class NaFlexImageProcessor(PatchRule):
    """SigLIP2 NaFlex's rule: each image resized to whole patches within a budget, aspect kept.

    The grid is :func:`naflex_grid`'s, each side capped at ``patch_limit_on_one_side`` patches (the
    tower's ``max_grid_side``, which only a budget over it lets a very thin image reach: that image is
    stretched to the cap, as the native rule stretches it, where transformers' grid would be refused
    by the tower); one Pillow resize (``resample``) to ``(cols * p, rows * p)``, no padding, no crop;
    then ``x * rescale_factor``, ``(x - mean) / std`` as transformers' PIL backend computes them.
    :meth:`plan_image` gives the grid from the image size alone, so packing plans from headers; its
    ``in_token_limit`` (the pipeline's budget) replaces ``max_num_patches`` for one image.

    Attributes:
        patch_size: patch side p in pixels (16 for the releases).
        max_num_patches: the patch budget per image (transformers' ``max_num_patches``, 256).
        patch_limit_on_one_side: most patches along either side (the tower's ``max_grid_side``).
        resample: Pillow's filter code (2, bilinear).
        rescale_factor, image_mean, image_std: the normalisation (1/255, 0.5, 0.5).
    """

    patch_size: int = 16
    max_num_patches: int = 256
    patch_limit_on_one_side: int = 512
    resample: int = 2
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = HALF
    image_std: tuple[float, float, float] = HALF

    def __post_init__(self) -> None:
        self._check_common()
        _check_positive_int("max_num_patches", self.max_num_patches)
        _check_positive_int("patch_limit_on_one_side", self.patch_limit_on_one_side)

    @property
    def kind(self) -> str:
        return "naflex"

    @property
    def in_token_limit(self) -> int:
        """The pipeline's name of the budget: ``max_num_patches``."""
        return self.max_num_patches

    def plan_image(self, width: int, height: int, *, in_token_limit: int | None = None) -> ImagePlan:
        """The resize and grid of a ``width`` x ``height`` image, without pixels; ``in_token_limit``
        replaces ``max_num_patches`` for this image."""
        limit = self.max_num_patches if in_token_limit is None else in_token_limit
        rows, cols = naflex_grid(height, width, self.patch_size, limit)
        rows, cols = min(rows, self.patch_limit_on_one_side), min(cols, self.patch_limit_on_one_side)
        resized = (cols * self.patch_size, rows * self.patch_size)
        return ImagePlan((width, height), resized, (0, 0, *resized), (rows, cols))

    def describe(self) -> str:
        """One line: the rule, its budget and normalisation."""
        return (
            f"SigLIP2 NaFlex's rule: up to {self.max_num_patches} patches of {self.patch_size} px an image (sides "
            f"over {self.patch_limit_on_one_side} capped), aspect kept, resized ({RESAMPLE_NAMES[self.resample]}) "
            f"up or down to whole patches, {self._normalisation()}"
        )


# ---- rules by name -------------------------------------------------------------------------------


def siglip_rule(config: ClassicViTConfig) -> tuple[type[PatchRule], dict[str, Any]]:
    """``siglip``: resize to the release's size square (``input_size``: 384 for so400m/14 at 384, whose
    27 x 27 table covers 378 px; else ``image_size``), bicubic, its top-left whole patches kept; 0.5 / 0.5."""
    size = config.input_size or config.image_size
    return ClassicViTImageProcessor, {
        "rule": "siglip", "patch_size": config.patch_size, "size": (size, size), "resample": 3,
        "drop_remainder": True,
    }  # fmt: skip


def naflex_rule(config: ClassicViTConfig) -> tuple[type[PatchRule], dict[str, Any]]:
    """``naflex``: :class:`NaFlexImageProcessor` at the tower's patch size, 256 patches, its sides capped
    at the tower's ``max_grid_side``."""
    return NaFlexImageProcessor, {"patch_size": config.patch_size, "patch_limit_on_one_side": config.max_grid_side}


def _read_naflex(file: Path, values: dict[str, Any], patch_size: int) -> tuple[str, PatchRule]:
    """transformers' ``Siglip2ImageProcessor`` settings (its class defaults where a key is missing)."""
    warn_unread_keys(
        file,
        values,
        TRANSFORMERS_BOOKKEEPING
        | {"do_resize", "resample", "patch_size", "max_num_patches", "do_rescale", "rescale_factor"}
        | {"do_normalize", "image_mean", "image_std"},
    )
    if not values.get("do_resize", True):
        raise ValueError("do_resize false: each image would have to be on whole patches already; NaFlex resizes")
    own_patch = values.get("patch_size", 16)
    if own_patch != patch_size:
        raise ValueError(f"patch_size {own_patch!r} is not the tower's {patch_size} px patch")
    return "naflex", NaFlexImageProcessor(
        patch_size=patch_size,
        max_num_patches=values.get("max_num_patches", 256),
        resample=values.get("resample", 2),
        **transformers_normalisation(values),
    )


# transformers' SiglipImageProcessor's class defaults, which a key the file lacks takes
_SIGLIP_DEFAULTS: dict[str, Any] = {"size": {"height": 224, "width": 224}, "resample": 3}
_FILE_TYPES = {
    "SiglipImageProcessor": fixed_file_reader("siglip", _SIGLIP_DEFAULTS, drop_remainder=True),
    "Siglip2ImageProcessor": _read_naflex,
}
_OWN_TYPES: tuple[type[PatchRule], ...] = (ClassicViTImageProcessor, NativeViTImageProcessor, NaFlexImageProcessor)

SIGLIP_RULES = RuleSet(
    label="SigLIP",
    rules={"siglip": siglip_rule, "native": native_rule},
    file_types=_FILE_TYPES,
    own_types=_OWN_TYPES,
)
"""SigLIP's rules (``siglip``, ``native``) and folders."""
SIGLIP2_RULES = RuleSet(
    label="SigLIP2 NaFlex",
    rules={"naflex": naflex_rule, "siglip": siglip_rule},
    file_types=_FILE_TYPES,
    own_types=_OWN_TYPES,
    aliases={"native": "naflex"},
)
"""SigLIP2 NaFlex's rules (``naflex``; ``native``, another name of it; ``siglip``: the square
resize to the table's native size) and folders."""

register_processor_loader("siglip", SIGLIP_RULES.from_folder)
register_processor_loader("siglip2", SIGLIP2_RULES.from_folder)

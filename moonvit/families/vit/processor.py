"""The classic ViT's and DeiT's image processors: each checkpoint's own rule, and a native-resolution one.

The machinery here is every ClassicViT-tower family's (SigLIP, SigLIP2, DINOv2 too): the fixed rule
(:class:`ClassicViTImageProcessor`), the native rule (:class:`NativeViTImageProcessor`), the readers
of transformers' and timm's processor settings, and :class:`RuleSet`, a family's named rules and
folder reader; :mod:`moonvit.families.siglip.processor` and :mod:`moonvit.families.dinov2.processor`
are each family's rules on it.

Rules, chosen by name (:data:`RULES`, :func:`processor_for_config`, :func:`from_folder`):

- ``vit``: transformers' ``ViTImageProcessor``: resize to ``size`` (224 x 224) with ``resample``
  (bilinear), ``x * rescale_factor`` (1/255), ``(x - image_mean) / image_std`` (0.5, 0.5);
- ``deit``: ``DeiTImageProcessor`` as the DeiT releases ship it: resize to 256 x 256 bicubic,
  centre-crop 224 x 224, ImageNet's mean and std;
- ``native``: :class:`NativeViTImageProcessor`: each image at about its own size, sides resized to
  whole patches within a patch budget, aspect kept, the checkpoint's normalisation.

A timm folder's own rule is timm's evaluation transform from its ``config.json``'s ``pretrained_cfg``
(``input_size``, ``interpolation``, ``crop_pct``, ``crop_mode``, ``mean``, ``std``): the shorter side
resized to ``floor(size / crop_pct)``, a centre crop of ``size`` (offsets rounded, as torchvision's
``CenterCrop``), ``x / 255``, then the normalisation.

The fixed rules (:class:`ClassicViTImageProcessor`) give pixel values equal, in float32, to
transformers' PIL-backend processors (``ViTImageProcessorPil``, ``DeiTImageProcessorPil``, the
"slow" ones): the same Pillow resize of the uint8 image, the same crop offsets, the rescale in
float64 cast to float32, the normalisation in float32. Both processors cut each image into
``(rows * cols, 3, p, p)`` patches in raster order (:func:`~moonvit.media.processor.patchify`), the
layout :class:`~moonvit.families.vit.ClassicViT` takes, and share the pipeline's interface
(:class:`~moonvit.media.processor.ImageProcessor`): ``plan_image`` gives an image's grid from its size
alone (a fixed rule: the same grid for every image, 14 x 14 at 224 px), so packing plans from headers.

:func:`moonvit.media.processor_for` is the entry point for a checkpoint folder of any family.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch
from PIL import Image

from ...media.image import ImageInput, load_image
from ...media.processor import (
    CONFIG_NAME,
    ImageBatch,
    ImagePlan,
    ImageProcessor,
    MoonViTImageProcessor,
    SavedSettings,
    _as_tuple,
    _check_choice,
    _check_positive_int,
    process_images,
    unpatchify_pack,
)
from ...media.selection import register_processor_loader
from ...weights.checkpoint import read_config
from ...weights.config_keys import warn_unread_keys
from ...weights.storage import CheckpointError, read_json
from .config import ClassicViTConfig

__all__ = [
    "HALF",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "NATIVE_BUDGET_FACTOR",
    "RESAMPLE_NAMES",
    "RULES",
    "TRANSFORMERS_BOOKKEEPING",
    "VIT_RULES",
    "ClassicViTImageProcessor",
    "NativeViTImageProcessor",
    "PatchRule",
    "RuleSet",
    "deit_rule",
    "fixed_file_reader",
    "from_folder",
    "native_rule",
    "own_rule",
    "processor_for_config",
    "transformers_normalisation",
    "vit_rule",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)
NATIVE_BUDGET_FACTOR = 4
"""The native rule's default patch budget per image: this many times the checkpoint's native grid
(784 patches for 224 px at patch 16, a 448 x 448 image's)."""
DEIT_CROP_RATIO = 224 / 256
"""DeiT's evaluation crop: the image resized to ``floor(size / ratio)`` (256 for 224), then cropped to ``size``."""

# Pillow's filter codes, as transformers' ``resample`` stores them, and timm's names for them.
RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
TIMM_INTERPOLATION = {name: code for code, name in RESAMPLE_NAMES.items()}
CropOffset = Literal["floor", "round"]
Rule = Literal["vit", "deit", "timm", "siglip", "dinov2"]

TRANSFORMERS_BOOKKEEPING = {
    "image_processor_type", "feature_extractor_type", "processor_class", "auto_map", "do_convert_rgb",
    "input_data_format", "data_format", "return_tensors", "device", "default_to_square",
}  # fmt: skip
"""Keys of transformers' processor files that do not change the pixels here: bookkeeping, and
``do_convert_rgb`` (images are always decoded to RGB)."""
_TRANSFORMERS_KEYS = {
    "do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale", "rescale_factor",
    "do_normalize", "image_mean", "image_std",
}  # fmt: skip


# ---- what both rules share -------------------------------------------------------------------


class PatchRule(SavedSettings):
    """Decoding, rendering, normalising and patchifying, shared by the ClassicViT tower's processors
    (the classic ViT's, SigLIP's, SigLIP2 NaFlex's, DINOv2's).

    Subclasses are frozen dataclasses with ``patch_size``, ``resample``, ``rescale_factor``,
    ``image_mean`` and ``image_std`` fields, an ``in_token_limit`` (field or property), and
    ``plan_image`` and ``kind``.
    """

    patch_size: int
    resample: int
    rescale_factor: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @property
    def merge_kernel_size(self) -> tuple[int, int]:
        """(1, 1): the classic ViT has no patch merger; each patch is one output token."""
        return (1, 1)

    @property
    def kind(self) -> str:
        """The rule's name, as its family names it (``"vit"``, ``"native"``, ...)."""
        raise NotImplementedError

    def plan_image(self, width: int, height: int, *, in_token_limit: int | None = None) -> ImagePlan:
        raise NotImplementedError

    def load_image(self, source: ImageInput) -> Image.Image:
        """:func:`~moonvit.media.image.load_image`: RGB, EXIF orientation applied, transparency over white."""
        return load_image(source)

    def __call__(
        self,
        images: ImageInput | Iterable[ImageInput],
        *,
        in_token_limit: int | Sequence[int | None] | None = None,
    ) -> ImageBatch:
        """Process one image or any iterable of them into an :class:`~moonvit.media.processor.ImageBatch`:
        ``pixel_values`` (L, 3, p, p) float32, each image's patches in raster order, and
        ``grid_hws`` (N, 2) int64.

        ``in_token_limit`` (one value, or one per image, None meaning the processor's own) replaces
        the native rule's patch budget; a fixed-size rule ignores it.

        Raises:
            ImageLoadError: an input cannot be read as an image.
        """
        return process_images(cast(ImageProcessor, self), images, in_token_limit)  # each subclass is one

    def render(self, image: Image.Image, plan: ImagePlan) -> torch.Tensor:
        """Resize (Pillow, ``resample``, on the uint8 image) and crop an RGB image as ``plan`` says:
        (3, rows * p, cols * p) uint8. A crop box past the image's edges reads black there, as
        transformers' ``center_crop`` pads."""
        if image.size != plan.resized_size:
            image = image.resize(plan.resized_size, Image.Resampling(self.resample))
        if plan.box != (0, 0, *image.size):
            image = image.crop(plan.box)
        return torch.from_numpy(np.array(image)).permute(2, 0, 1)

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 (..., 3, p, p) -> float32 ``(x * rescale_factor - mean) / std`` in transformers' dtypes:
        the rescale in float64 cast to float32 (equal to torchvision's float32 ``x / 255`` for every
        uint8 value), the normalisation in float32."""
        mean = torch.tensor(self.image_mean, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(self.image_std, dtype=torch.float32).view(3, 1, 1)
        scaled = pixels.to(torch.float64).mul_(self.rescale_factor).to(torch.float32)
        return scaled.sub_(mean).div_(std)

    def to_images(self, pixel_values: torch.Tensor, grid_hws: torch.Tensor) -> list[torch.Tensor]:
        """Invert :meth:`normalize` and the patching: one (3, rows * p, cols * p) uint8 image per grid."""
        mean = torch.tensor(self.image_mean).view(3, 1, 1)
        std = torch.tensor(self.image_std).view(3, 1, 1)
        pixels = (pixel_values.float().cpu() * std + mean).div_(self.rescale_factor)
        pixels = pixels.round_().clamp_(0, 255).to(torch.uint8)
        return unpatchify_pack(pixels, grid_hws)

    def _check_common(self) -> None:
        _check_positive_int("patch_size", self.patch_size)
        if self.resample not in RESAMPLE_NAMES:
            raise ValueError(f"resample must be one of Pillow's filters {RESAMPLE_NAMES}, got {self.resample!r}")
        if isinstance(self.rescale_factor, bool) or not isinstance(self.rescale_factor, (int, float)):
            raise ValueError(f"rescale_factor must be a number, got {self.rescale_factor!r}")
        if not (self.rescale_factor > 0 and math.isfinite(self.rescale_factor)):
            raise ValueError(f"rescale_factor must be a positive number, got {self.rescale_factor!r}")
        mean = _as_tuple("image_mean", self.image_mean, 3, float)
        std = _as_tuple("image_std", self.image_std, 3, float)
        if min(std) <= 0:
            raise ValueError(f"image_std must be positive, got {std}")
        object.__setattr__(self, "image_mean", mean)
        object.__setattr__(self, "image_std", std)
        object.__setattr__(self, "rescale_factor", float(self.rescale_factor))

    def _normalisation(self) -> str:
        mean = "/".join(f"{v:g}" for v in self.image_mean)
        std = "/".join(f"{v:g}" for v in self.image_std)
        return f"mean {mean}, std {std}"


# ---- each checkpoint's own rule: resize, maybe crop ------------------------------------------


@dataclass(frozen=True)
class ClassicViTImageProcessor(PatchRule):
    """A fixed-size rule: resize, optionally centre-crop, rescale, normalise, patchify.

    Every image gives the same grid, ``output_size / patch_size`` (14 x 14 at 224 px, patch 16).

    Attributes:
        rule: the rule's name, for messages and saved files: ``"vit"`` (transformers' ViT),
            ``"deit"`` (resize then crop), ``"timm"`` (timm's evaluation transform), ``"siglip"``
            (SigLIP's square resize) or ``"dinov2"`` (DINOv2's shorter side then crop).
        patch_size: patch side p in pixels (the checkpoint's).
        size: (height, width) every image is resized to, aspect not kept (transformers'
            ``size {"height", "width"}``); None with ``shortest_edge``.
        shortest_edge: the shorter side is resized to this, the longer to
            ``int(shortest_edge * long / short)`` (transformers' ``size {"shortest_edge"}``,
            torchvision's ``Resize(int)``); needs ``crop_size``.
        resample: Pillow's filter code (0 nearest, 1 lanczos, 2 bilinear, 3 bicubic, 4 box, 5 hamming).
        crop_size: (height, width) of the centre crop after the resize; None: no crop.
        crop_offset: the crop's top-left offset from ``(resized - crop) / 2``: ``"floor"``
            (transformers' ``center_crop``) or ``"round"`` (torchvision's ``CenterCrop``, Python's
            round half to even, which timm uses).
        drop_remainder: an output whose sides are not whole patches keeps its top-left
            ``rows * p`` x ``cols * p`` pixels, the ones a strided patch convolution reads
            (transformers' and timm's: SigLIP so400m at 384 px and patch 14 reads 27 x 27 patches,
            378 px); False: such an output is an error.
        rescale_factor: pixels are multiplied by it (1/255; 1.0 for a file with ``do_rescale`` false).
        image_mean, image_std: per-channel normalisation (0 and 1 for ``do_normalize`` false).
    """

    rule: Rule = "vit"
    patch_size: int = 16
    size: tuple[int, int] | None = (224, 224)
    shortest_edge: int | None = None
    resample: int = 2
    crop_size: tuple[int, int] | None = None
    crop_offset: CropOffset = "floor"
    drop_remainder: bool = False
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = HALF
    image_std: tuple[float, float, float] = HALF

    def __post_init__(self) -> None:
        self._check_common()
        _check_choice("rule", self.rule, Rule)
        _check_choice("crop_offset", self.crop_offset, CropOffset)
        if (self.size is None) == (self.shortest_edge is None):
            raise ValueError(
                f"give exactly one of size and shortest_edge, got {self.size!r} and {self.shortest_edge!r}"
            )
        if self.size is not None:
            object.__setattr__(self, "size", _pair("size", self.size))
        else:
            _check_positive_int("shortest_edge", self.shortest_edge)
            if self.crop_size is None:
                raise ValueError(
                    "shortest_edge without crop_size gives images of any size, not a fixed grid; "
                    "add crop_size, or use the native rule for images at their own size"
                )
        if self.crop_size is not None:
            object.__setattr__(self, "crop_size", _pair("crop_size", self.crop_size))
        if not isinstance(self.drop_remainder, bool):
            raise ValueError(f"drop_remainder must be a bool, got {self.drop_remainder!r}")
        height, width = self.output_size
        if (
            height < self.patch_size
            or width < self.patch_size
            or (not self.drop_remainder and (height % self.patch_size or width % self.patch_size))
        ):
            raise ValueError(
                f"the output of {height}x{width} px ({'crop_size' if self.crop_size else 'size'}) is not a multiple "
                f"of the {self.patch_size} px patch"
            )

    @property
    def kind(self) -> str:
        return self.rule

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of every image after the resize and crop (with ``drop_remainder``, of
        which the top-left :attr:`grid_hw` patches are kept)."""
        size = self.crop_size or self.size
        assert size is not None  # __post_init__: shortest_edge comes with crop_size
        return size

    @property
    def grid_hw(self) -> tuple[int, int]:
        """(rows, cols) of patches of every image (14, 14 at 224 px, patch 16)."""
        height, width = self.output_size
        return height // self.patch_size, width // self.patch_size

    @property
    def in_token_limit(self) -> int:
        """The patches every image gives (rows * cols): the pipeline's per-image budget."""
        rows, cols = self.grid_hw
        return rows * cols

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of a ``width`` x ``height`` image after the resize, before the crop."""
        if self.size is not None:
            return self.size[1], self.size[0]
        assert self.shortest_edge is not None
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_short, new_long) if width <= height else (new_long, new_short)

    def plan_image(self, width: int, height: int, *, in_token_limit: int | None = None) -> ImagePlan:
        """The resize, crop and grid of a ``width`` x ``height`` image, without pixels.

        ``in_token_limit`` is accepted for the pipeline's interface and changes nothing: every
        image gives :attr:`grid_hw`.
        """
        if width < 1 or height < 1:
            raise ValueError(f"image size must be positive, got {width}x{height}")
        resized = self.resized_size(width, height)
        if self.crop_size is None:
            left = top = 0
        else:
            crop_h, crop_w = self.crop_size
            left, top = self._offset(resized[0] - crop_w), self._offset(resized[1] - crop_h)
        rows, cols = self.grid_hw  # the whole output, but with drop_remainder
        box = (left, top, left + cols * self.patch_size, top + rows * self.patch_size)
        return ImagePlan((width, height), resized, box, self.grid_hw)

    def _offset(self, extra: int) -> int:
        # transformers: (orig - crop) // 2 (a floor, also for a crop larger than the image, which it
        # pads around the image); torchvision: int(round((orig - crop) / 2.0))
        return extra // 2 if self.crop_offset == "floor" else round(extra / 2)

    def describe(self) -> str:
        """One line: the rule, its geometry and normalisation."""
        name = {
            "vit": "ViT's rule", "deit": "DeiT's rule", "timm": "timm's rule", "siglip": "SigLIP's rule",
            "dinov2": "DINOv2's rule",
        }[self.rule]  # fmt: skip
        filter_name = RESAMPLE_NAMES[self.resample]
        if self.size is not None:
            resize = f"resize to {self.size[1]}x{self.size[0]} ({filter_name})"
        else:
            resize = f"shorter side to {self.shortest_edge} ({filter_name})"
        crop = "" if self.crop_size is None else f", centre crop {self.crop_size[1]}x{self.crop_size[0]}"
        rows, cols = self.grid_hw
        if (rows * self.patch_size, cols * self.patch_size) != self.output_size:
            crop += f", its top-left {cols * self.patch_size}x{rows * self.patch_size} px kept"
        return f"{name}: {resize}{crop}, {self._normalisation()}; {rows}x{cols} patches of {self.patch_size} px"


# ---- the native-resolution rule ----------------------------------------------------------------


@dataclass(frozen=True)
class NativeViTImageProcessor(PatchRule):
    """Each image at about its own size: sides resized to whole patches, within a patch budget.

    For a ``W`` x ``H`` image, patch ``p`` and budget ``N`` (``in_token_limit``):

    1. ``s = min(1, sqrt(N * p^2 / (W * H)))``: images are scaled down to about ``N`` patches,
       never up;
    2. ``rows, cols = round(H * s / p), round(W * s / p)`` (halves up, at least 1); if that is over
       ``N``, both are rounded down instead, which never is (a side held at 1 patch can leave the
       other over it, and it is cut to ``N // 1``);
    3. each side is capped at ``patch_limit_on_one_side`` patches;
    4. one Pillow resize (``resample``) to ``(cols * p, rows * p)``; no padding, no crop.

    So sides are multiples of ``p``, ``rows * cols <= N``, and each side is within one patch of the
    image's scaled side (the aspect kept; very thin images, held at one patch or at the side cap,
    are stretched). An image already on whole patches within the budget is not resized at all.

    MoonViT's rule (:class:`~moonvit.media.processor.MoonViTImageProcessor` with patch 16 and no
    merger) is not reused: it pads the last row and column of patches with black, which the classic
    ViT's class token attends to, and the padding can take an image over the budget.

    Attributes:
        patch_size: patch side p in pixels (the checkpoint's).
        in_token_limit: the patch budget per image (default :data:`NATIVE_BUDGET_FACTOR` times the
            checkpoint's native grid: 784 for 224 px at patch 16).
        patch_limit_on_one_side: most patches along either side (the tower's ``max_grid_side``).
        resample: Pillow's filter code (the checkpoint's own rule's).
        rescale_factor, image_mean, image_std: the checkpoint's normalisation.
    """

    patch_size: int = 16
    in_token_limit: int = NATIVE_BUDGET_FACTOR * 14 * 14
    patch_limit_on_one_side: int = 512
    resample: int = 3
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = HALF
    image_std: tuple[float, float, float] = HALF

    def __post_init__(self) -> None:
        self._check_common()
        _check_positive_int("in_token_limit", self.in_token_limit)
        _check_positive_int("patch_limit_on_one_side", self.patch_limit_on_one_side)

    @property
    def kind(self) -> str:
        return "native"

    def plan_image(self, width: int, height: int, *, in_token_limit: int | None = None) -> ImagePlan:
        """The resize and grid of a ``width`` x ``height`` image (see the class docstring), without
        pixels; ``in_token_limit`` replaces the budget for this image."""
        if width < 1 or height < 1:
            raise ValueError(f"image size must be positive, got {width}x{height}")
        limit = self.in_token_limit if in_token_limit is None else in_token_limit
        _check_positive_int("in_token_limit", limit)
        p = self.patch_size
        scale = min(1.0, math.sqrt(limit * p * p / (width * height)))
        exact_rows, exact_cols = height * scale / p, width * scale / p
        rows, cols = max(1, math.floor(exact_rows + 0.5)), max(1, math.floor(exact_cols + 0.5))
        if rows * cols > limit:
            rows, cols = max(1, math.floor(exact_rows)), max(1, math.floor(exact_cols))
        if rows * cols > limit:  # a side held at one patch leaves the other over the budget
            rows, cols = min(rows, limit), min(cols, limit)
        rows, cols = min(rows, self.patch_limit_on_one_side), min(cols, self.patch_limit_on_one_side)
        resized = (cols * p, rows * p)
        return ImagePlan((width, height), resized, (0, 0, *resized), (rows, cols))

    def describe(self) -> str:
        """One line: the rule, its budget and normalisation."""
        return (
            f"native rule: up to {self.in_token_limit} patches of {self.patch_size} px an image (sides over "
            f"{self.patch_limit_on_one_side} capped), aspect kept, resized ({RESAMPLE_NAMES[self.resample]}) to "
            f"whole patches, {self._normalisation()}"
        )


def _pair(name: str, value: Any) -> tuple[int, int]:
    pair = _as_tuple(name, value, 2, int)
    for side in pair:
        _check_positive_int(name, side)
    return pair


# ---- rules by name -----------------------------------------------------------------------------

Processor = PatchRule | MoonViTImageProcessor
"""What a folder's own files may give: one of the rules here, or a MoonViT-style processor file."""
RuleBuilder = Callable[[ClassicViTConfig], tuple[type[PatchRule], dict[str, Any]]]
"""A named rule for a tower: ``builder(config)`` gives the processor class and its settings."""
FileReader = Callable[[Path, dict[str, Any], int], tuple[str, PatchRule]]
"""A reader of one ``image_processor_type``'s settings: ``reader(file, values, patch_size)`` gives
the rule's kind and processor (``values``: the file's dict; ``patch_size``: the tower's)."""


def vit_rule(config: ClassicViTConfig) -> tuple[type[PatchRule], dict[str, Any]]:
    """``vit``: resize to ``image_size`` square, bilinear; 0.5 / 0.5."""
    size = config.image_size
    return ClassicViTImageProcessor, {"rule": "vit", "patch_size": config.patch_size, "size": (size, size),
                                      "resample": 2}  # fmt: skip


def deit_rule(config: ClassicViTConfig) -> tuple[type[PatchRule], dict[str, Any]]:
    """``deit``: resize to ``floor(image_size * 256 / 224)`` square, bicubic, centre-crop
    ``image_size``; ImageNet's mean and std."""
    size, resized = config.image_size, math.floor(config.image_size / DEIT_CROP_RATIO)
    return ClassicViTImageProcessor, {
        "rule": "deit", "patch_size": config.patch_size, "size": (resized, resized), "resample": 3,
        "crop_size": (size, size), "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD,
    }  # fmt: skip


def native_rule(config: ClassicViTConfig) -> tuple[type[PatchRule], dict[str, Any]]:
    """``native``: :class:`NativeViTImageProcessor` with a budget of :data:`NATIVE_BUDGET_FACTOR`
    times the tower's native grid and its ``max_grid_side``; bicubic, 0.5 / 0.5."""
    return NativeViTImageProcessor, {
        "patch_size": config.patch_size,
        "in_token_limit": NATIVE_BUDGET_FACTOR * config.grid_side**2,
        "patch_limit_on_one_side": config.max_grid_side,
        "resample": 3,
    }


# ---- reading transformers' and timm's settings ---------------------------------------------------


def fixed_file_reader(rule: Rule, defaults: dict[str, Any], *, drop_remainder: bool = False) -> FileReader:
    """The reader of a transformers processor of the fixed shape (resize, optional centre crop,
    rescale, normalise: ``ViTImageProcessor``, ``SiglipImageProcessor``, ``BitImageProcessor``, ...),
    giving a :class:`ClassicViTImageProcessor` of kind ``rule``.

    ``defaults`` are the transformers class's own, which a key the file lacks takes (``size``,
    ``resample``, ``do_center_crop``, ``crop_size``, ``image_mean``, ``image_std``);
    ``drop_remainder`` is :class:`ClassicViTImageProcessor`'s (where the model's patch convolution
    reads an output that is not whole patches).
    """

    def read(file: Path, values: dict[str, Any], patch_size: int) -> tuple[str, PatchRule]:
        warn_unread_keys(file, values, _TRANSFORMERS_KEYS | TRANSFORMERS_BOOKKEEPING)
        return rule, _from_transformers({**defaults, **values}, rule, patch_size, drop_remainder)

    return read


def _from_transformers(
    settings: dict[str, Any], rule: Rule, patch_size: int, drop_remainder: bool
) -> ClassicViTImageProcessor:
    """A fixed-shape transformers processor's settings (the file's over its class's defaults)."""
    if not settings.get("do_resize", True):
        raise ValueError(
            "do_resize false: the image's own size would decide its grid; use the native rule for images at "
            "their own size"
        )
    fields: dict[str, Any] = {
        "rule": rule, "patch_size": patch_size, "resample": settings["resample"], "drop_remainder": drop_remainder,
    }  # fmt: skip
    fields.update(_size_fields(settings["size"], "size"))
    if settings.get("do_center_crop"):
        crop = _size_fields(settings.get("crop_size"), "crop_size")
        if "size" not in crop:
            raise ValueError(f"crop_size {settings.get('crop_size')!r}: a centre crop needs a height and width")
        fields["crop_size"] = crop["size"]
    fields.update(transformers_normalisation(settings))
    return ClassicViTImageProcessor(**fields)


def transformers_normalisation(settings: dict[str, Any]) -> dict[str, Any]:
    """``rescale_factor``, ``image_mean`` and ``image_std`` from a transformers processor's settings:
    ``do_rescale`` false is a factor of 1, ``do_normalize`` false a mean of 0 and std of 1; a
    missing mean or std is 0.5 (transformers' ``IMAGENET_STANDARD_*``)."""
    fields: dict[str, Any] = {}
    fields["rescale_factor"] = settings.get("rescale_factor", 1 / 255) if settings.get("do_rescale", True) else 1.0
    if settings.get("do_normalize", True):
        fields["image_mean"] = _channels("image_mean", settings.get("image_mean", HALF))
        fields["image_std"] = _channels("image_std", settings.get("image_std", HALF))
    else:
        fields["image_mean"], fields["image_std"] = (0.0,) * 3, (1.0,) * 3  # (x - 0) / 1: x unchanged
    return fields


def _size_fields(value: Any, key: str) -> dict[str, Any]:
    """transformers' ``size`` / ``crop_size``: an int (a square, as ``get_size_dict`` reads it), a
    ``{"height", "width"}`` dict, or ``{"shortest_edge"}``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {"size": (value, value)}
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return {"size": tuple(value)}
    if isinstance(value, dict):
        given = {k for k, v in value.items() if v is not None}
        if given == {"height", "width"}:
            return {"size": (value["height"], value["width"])}
        if given == {"shortest_edge"}:
            return {"size": None, "shortest_edge": value["shortest_edge"]}
        raise ValueError(
            f"{key} {value!r}: only height and width, or shortest_edge alone, are supported (keys {sorted(given)})"
        )
    raise ValueError(f"{key} {value!r} is not an int or a size dict")


def _channels(key: str, value: Any) -> tuple[float, ...]:
    """A per-channel value of a processor file: a number for all three channels, or three numbers."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),) * 3
    return _as_tuple(key, value, 3, float)


def _from_timm(cfg: dict[str, Any], patch_size: int) -> ClassicViTImageProcessor:
    """timm's evaluation transform from a ``pretrained_cfg`` (timm's ``resolve_data_config`` defaults
    where a key is missing: 224 px, bicubic, crop_pct 0.875, ImageNet's mean and std, centre mode).
    A crop that is not whole patches keeps its top-left patches, as timm's patch convolution reads it."""
    input_size = cfg.get("input_size") or (3, 224, 224)
    if not isinstance(input_size, (list, tuple)) or len(input_size) != 3:
        raise ValueError(f"input_size {input_size!r} is not (channels, height, width)")
    height, width = int(input_size[1]), int(input_size[2])
    interpolation = cfg.get("interpolation") or "bicubic"
    if interpolation not in TIMM_INTERPOLATION:
        raise ValueError(f"interpolation {interpolation!r} is not one of {', '.join(TIMM_INTERPOLATION)}")
    crop_pct = float(cfg.get("crop_pct") or 0.875)
    crop_mode = cfg.get("crop_mode") or "center"
    scaled = (math.floor(height / crop_pct), math.floor(width / crop_pct))
    fields: dict[str, Any] = {
        "rule": "timm",
        "patch_size": patch_size,
        "resample": TIMM_INTERPOLATION[interpolation],
        "crop_size": (height, width),
        "crop_offset": "round",
        "drop_remainder": True,
        "image_mean": _channels("mean", cfg.get("mean") or IMAGENET_MEAN),
        "image_std": _channels("std", cfg.get("std") or IMAGENET_STD),
    }
    if crop_mode == "squash":  # both sides to the scaled size, aspect not kept
        fields["size"] = scaled
    elif crop_mode == "center":
        if scaled[0] != scaled[1]:
            raise ValueError(f"crop_mode 'center' with a non-square input_size {input_size!r} is not supported")
        fields.update(size=None, shortest_edge=scaled[0])
    else:
        raise ValueError(f"crop_mode {crop_mode!r} is not supported (only 'center' and 'squash')")
    return ClassicViTImageProcessor(**fields)


# ---- a family's rules and folders ----------------------------------------------------------------


@dataclass(frozen=True)
class RuleSet:
    """The processor rules of one family of ClassicViT towers, and how its folders give their own.

    A folder's own rule is read from its ``preprocessor_config.json`` (one of :attr:`file_types`,
    transformers' names; its ``Pil`` / ``Fast`` variants and older ``...FeatureExtractor`` names
    too; one of :attr:`own_types`, this package's; or a
    :class:`~moonvit.media.processor.MoonViTImageProcessor` file), else from a timm ``config.json``'s
    ``pretrained_cfg``. A named rule takes the normalisation of the folder's own rule where it has
    one (and the rules at each image's own size its filter too).

    Attributes:
        label: the family as messages name it (``"classic ViT / DeiT"``).
        rules: each named rule's builder (:data:`RuleBuilder`), in the order they are listed.
        file_types: transformers' ``image_processor_type`` names a folder's file may give, each with
            its reader (:data:`FileReader`).
        own_types: this package's processor classes a folder's file may name (as
            ``save_pretrained`` writes them).
        aliases: other names of a rule (``{"native": "naflex"}``: SigLIP2's native rule is NaFlex).
    """

    label: str
    rules: Mapping[str, RuleBuilder]
    file_types: Mapping[str, FileReader]
    own_types: tuple[type[PatchRule], ...] = (ClassicViTImageProcessor, NativeViTImageProcessor)
    aliases: Mapping[str, str] = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        """Every rule name (the family's ``Family.processors``)."""
        return (*self.rules, *self.aliases)

    def for_config(
        self, config: ClassicViTConfig, rule: str, *, base: Processor | None = None, **overrides: Any
    ) -> PatchRule:
        """The rule ``rule`` for a tower of ``config``: the builder's settings, the normalisation
        (``rescale_factor``, ``image_mean``, ``image_std``) of ``base`` (the checkpoint's own rule)
        where given, and for a rule at each image's own size (not a
        :class:`ClassicViTImageProcessor`) ``base``'s filter; ``overrides`` replace any field last.

        Raises:
            ValueError: an unknown rule name, or an invalid override.
        """
        name = self.aliases.get(rule, rule)
        if name not in self.rules:
            raise ValueError(f"unknown processor rule {rule!r}; choose one of {', '.join(self.names)}")
        cls, settings = self.rules[name](config)
        if base is not None:
            settings.update(image_mean=base.image_mean, image_std=base.image_std)
            if isinstance(base, PatchRule):
                settings["rescale_factor"] = base.rescale_factor
                if cls is not ClassicViTImageProcessor:
                    settings["resample"] = base.resample
        unknown = sorted(set(overrides) - _field_names(cls))
        if unknown:
            raise ValueError(f"{cls.__name__} has no setting {', '.join(unknown)} (the {rule!r} rule)")
        return cls(**{**settings, **overrides})

    def own_rule(self, folder: Path, config: ClassicViTConfig) -> tuple[str, Processor] | None:
        """The rule a folder's own files give, with its kind (a rule name, ``"timm"``, or
        ``"moonvit"`` for a MoonViT-style processor file), or None when they give none. The patch
        size is the tower's (``config``).

        Raises:
            CheckpointError: a file that is not valid JSON, names another processor type, or holds a
                setting this package cannot reproduce (the file and key named).
        """
        file = folder / CONFIG_NAME
        if file.is_file():
            return self._from_preprocessor_file(file, config)
        model_file = folder / "config.json"
        pretrained = read_json(model_file).get("pretrained_cfg") if model_file.is_file() else None
        if pretrained is None:
            return None
        if not isinstance(pretrained, dict):
            raise CheckpointError(f"{model_file}: pretrained_cfg is a {type(pretrained).__name__}, not an object")
        try:
            return "timm", _from_timm(pretrained, config.patch_size)
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"{model_file}: pretrained_cfg: {error}") from error

    def from_folder(self, folder: Path, rule: str | None = None, **overrides: Any) -> ImageProcessor:
        """The processor of a folder of the family: its own rule (``rule`` None), or the rule
        ``rule`` names for its weights (:meth:`for_config`, with the folder's own rule as ``base``;
        a name of the folder's own kind gives the folder's own rule unchanged). ``overrides``
        replace fields last. The family's loader for :func:`moonvit.media.processor_for`.

        Raises:
            CheckpointError: the folder's config or processor files cannot be read, or ``rule`` is
                None and the folder does not say its processor (the folder and the rules named).
            ValueError: an unknown rule name, or an invalid override.
        """
        if rule is not None and rule not in self.names:
            raise ValueError(f"unknown processor rule {rule!r} for {folder}; choose one of {', '.join(self.names)}")
        config, _ = read_config(folder)
        if not isinstance(config, ClassicViTConfig):
            raise CheckpointError(f"{folder} is not a {self.label} checkpoint")
        own = self.own_rule(folder, config)
        if rule is None:
            if own is None:
                raise CheckpointError(
                    f"{folder}: cannot tell the checkpoint's processor: it has no {CONFIG_NAME} (transformers' "
                    f"{' / '.join(self.file_types)}) and its config.json has no pretrained_cfg (timm's); choose a "
                    f"rule by name: {', '.join(self.names)}"
                )
            return _as_processor(_replace(own[1], overrides, folder))
        if own is not None and own[0] == self.aliases.get(rule, rule):
            return _as_processor(_replace(own[1], overrides, folder))
        return _as_processor(self.for_config(config, rule, base=None if own is None else own[1], **overrides))

    def _from_preprocessor_file(self, file: Path, config: ClassicViTConfig) -> tuple[str, Processor]:
        values = read_json(file)
        kind = values.get("image_processor_type", values.get("feature_extractor_type"))
        own = {cls.__name__: cls for cls in self.own_types}
        try:
            if kind in own:
                cls = own[kind]
                fields = _field_names(cls)
                warn_unread_keys(file, values, {*fields, "image_processor_type"})
                processor = cls(**{k: v for k, v in values.items() if k in fields})
                return processor.kind, processor
            if kind == MoonViTImageProcessor.__name__:
                return "moonvit", MoonViTImageProcessor.from_pretrained(file)
            name = str(kind).removesuffix("Pil").removesuffix("Fast").replace("FeatureExtractor", "ImageProcessor")
            if name not in self.file_types:
                short = [t.removesuffix("ImageProcessor") for t in self.file_types]
                raise CheckpointError(
                    f"{file}: image_processor_type {kind!r} is not a {' or '.join(short)} processor "
                    f"({', '.join(self.file_types)}, or this package's {' / '.join(own)}); pass a rule by name "
                    f"({', '.join(self.names)}) to choose one"
                )
            return self.file_types[name](file, values, config.patch_size)
        except CheckpointError:  # already names the file
            raise
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"{file}: {error}") from error


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _as_processor(processor: Processor) -> ImageProcessor:
    # each PatchRule subclass is an ImageProcessor (its budget a field or a property of its own)
    return cast(ImageProcessor, processor)


def _replace(processor: Processor, overrides: dict[str, Any], folder: Path) -> Processor:
    if not overrides:
        return processor
    try:
        return dataclasses.replace(processor, **overrides)  # type: ignore[type-var]
    except TypeError as error:  # an unknown field
        raise ValueError(f"{folder}: {type(processor).__name__} has no such setting: {error}") from error


# ---- the classic ViT's and DeiT's --------------------------------------------------------------

# transformers' own class defaults (ViTImageProcessor, DeiTImageProcessor), which a key the file lacks
# takes: both normalise with 0.5 by default; the DeiT releases' files give ImageNet's.
_VIT_DEFAULTS: dict[str, Any] = {"size": {"height": 224, "width": 224}, "resample": 2}
_DEIT_DEFAULTS: dict[str, Any] = {
    "size": {"height": 256, "width": 256}, "resample": 3, "do_center_crop": True,
    "crop_size": {"height": 224, "width": 224},
}  # fmt: skip

VIT_RULES = RuleSet(
    label="classic ViT / DeiT",
    rules={"vit": vit_rule, "deit": deit_rule, "native": native_rule},
    file_types={
        "ViTImageProcessor": fixed_file_reader("vit", _VIT_DEFAULTS),
        "DeiTImageProcessor": fixed_file_reader("deit", _DEIT_DEFAULTS),
    },
)
"""The classic ViT / DeiT family's rules (:data:`RULES`) and folders."""
RULES = VIT_RULES.names
"""The rules chosen by name (``Family.processors`` of the classic-ViT family): vit, deit, native."""


def processor_for_config(
    config: ClassicViTConfig, rule: str = "vit", *, base: Processor | None = None, **overrides: Any
) -> ClassicViTImageProcessor | NativeViTImageProcessor:
    """The rule ``rule`` for a classic ViT / DeiT tower of ``config`` (a preset's, or a folder's).

    The geometry is the named rule's at the tower's ``image_size`` and ``patch_size``: ``vit``
    resizes to ``image_size`` square (bilinear); ``deit`` resizes to ``floor(image_size * 256 / 224)``
    square (bicubic) and crops ``image_size``; ``native`` gives :class:`NativeViTImageProcessor` with
    a budget of :data:`NATIVE_BUDGET_FACTOR` times the native grid and the tower's ``max_grid_side``.
    The normalisation (and the native rule's filter) is ``base``'s, the checkpoint's own rule, where
    given; else the named rule's: 0.5 / 0.5 for ``vit`` and ``native``, ImageNet's for ``deit``.
    ``overrides`` replace any field last (:meth:`RuleSet.for_config`).

    Raises:
        ValueError: an unknown rule name, or an invalid override.
    """
    processor = VIT_RULES.for_config(config, rule, base=base, **overrides)
    assert isinstance(processor, (ClassicViTImageProcessor, NativeViTImageProcessor))
    return processor


def own_rule(folder: Path, config: ClassicViTConfig) -> tuple[str, Processor] | None:
    """The rule a classic-ViT folder's own files give, with its kind (``"vit"``, ``"deit"``,
    ``"timm"``, ``"native"``, or ``"moonvit"`` for a MoonViT-style processor file), or None when
    they give none (:meth:`RuleSet.own_rule`).

    Raises:
        CheckpointError: a file that is not valid JSON, names another processor type, or holds a
            setting this package cannot reproduce (the file and key named).
    """
    return VIT_RULES.own_rule(folder, config)


def from_folder(folder: Path, rule: str | None = None, **overrides: Any) -> ImageProcessor:
    """The processor of a classic-ViT / DeiT folder: its own rule (``rule`` None), or the rule
    ``rule`` names for its weights (:meth:`RuleSet.from_folder`). The classic-ViT family's loader
    for :func:`moonvit.media.processor_for`.

    Raises:
        CheckpointError: the folder's config or processor files cannot be read, or ``rule`` is None
            and the folder does not say its processor (the folder named).
        ValueError: an unknown rule name, or an invalid override.
    """
    return VIT_RULES.from_folder(folder, rule, **overrides)


register_processor_loader("classic-vit", from_folder)

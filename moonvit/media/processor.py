"""Native-resolution image processor for MoonViT, following Kimi-VL's ``KimiVLImageProcessor``.

Each image goes through five steps, every one set by a field of :class:`MoonViTImageProcessor`
(named as in Kimi-VL's ``preprocessor_config.json`` where upstream has the setting):

1. **Load** to RGB with Pillow: files are opened, the EXIF orientation is applied, any Pillow mode
   is converted to RGB and transparency follows ``alpha_mode`` (see :func:`load_image`).
2. **Resize** when ``(W // p) * (H // p) > in_token_limit`` (``p = patch_size``): both sides are
   scaled by ``sqrt(in_token_limit / ((W // p) * (H // p)))``, truncated to int, with Pillow
   bicubic on the uint8 image. Images are never upscaled.
3. **Pad** the bottom and right with black (0 before normalisation) to multiples of
   ``p * merge_kernel_size`` (28 px), so every image gives at least one merged token; with
   ``stretch_input`` (NVIDIA LocateAnything's rule), **stretch** instead: a second Pillow bicubic
   resize of the step-2 image to those multiples, each side rounded up.
4. **Check** that no side exceeds ``patch_limit_on_one_side`` (512) patches, the encoder's
   position table: an error by default, or, with ``side_limit_mode="resize"``, Kimi-K2.5's
   per-side cap folded into step 2.
5. **Normalise** ``(x / 255 - image_mean) / image_std`` and **patchify** each image into
   (rows * cols, 3, p, p) patches in raster order; images are concatenated.

:meth:`MoonViTImageProcessor.plan_image` gives steps 2-4 from an image's size alone, and
:func:`image_size` reads that size from a file header, so batches can be planned without decoding.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

import numpy as np
import torch
from PIL import Image

from ..files import write_text_atomic
from ..model.config import merge_kernel
from ..weights.config_keys import warn_unread_keys
from ..weights.formats import LOCATEANYTHING
from ..weights.hub import HubSnapshot, resolve_pretrained
from ..weights.storage import CheckpointError, read_json
from .image import (
    AlphaMode,
    ImageInput,
    ImageLoadError,
    ImageTooLargeError,
    image_size,
    image_sources,
    is_image,
    load_image,
)

__all__ = [
    "CONFIG_NAME",
    "ImageBatch",
    "ImageInput",
    "ImageLoadError",
    "ImagePlan",
    "ImageProcessor",
    "ImageSizeError",
    "ImageTooLargeError",
    "MoonViTImageProcessor",
    "SavedSettings",
    "image_size",
    "is_image",
    "load_image",
    "patchify",
    "unpatchify",
    "unpatchify_pack",
]

logger = logging.getLogger(__name__)

CONFIG_NAME = "preprocessor_config.json"
KIMI_UNUSED_KEYS = ("num_pooled_tokens",)
"""Keys of Kimi-VL's preprocessor_config.json that do not change the processing."""
LOCATEANYTHING_SETTINGS: dict[str, Any] = {
    "in_token_limit": 25600,
    "stretch_input": True,
    "patch_limit_on_one_side": 511,  # LocateAnything refuses a side of 512 patches
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
    "alpha_mode": "composite_rgba",
    "background_color": (255, 255, 255),
}
"""NVIDIA LocateAnything's processor rule as :class:`MoonViTImageProcessor` fields; its
``preprocessor_config.json`` values replace these (its class default limit is 4096, the file's 25600)."""


class ImageSizeError(ValueError):
    """An image the processor cannot fit: a side over the position table, smaller than one merged
    token without padding, or larger than a pack budget allows."""


SideLimitMode = Literal["error", "resize"]
Size = tuple[int, int]
Box = tuple[int, int, int, int]


# ---- patches ---------------------------------------------------------------------------------


def patchify(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Cut a (C, H, W) image into (H/p * W/p, C, p, p) patches in raster (row-major) order.

    H and W must be multiples of ``patch_size``; the dtype is kept.
    """
    channels, height, width = image.shape
    if height % patch_size or width % patch_size:
        raise ValueError(f"image of {height}x{width} px is not a multiple of the {patch_size} px patch")
    rows, cols = height // patch_size, width // patch_size
    return (
        image.reshape(channels, rows, patch_size, cols, patch_size)
        .permute(1, 3, 0, 2, 4)
        .reshape(rows * cols, channels, patch_size, patch_size)
    )


def unpatchify(patches: torch.Tensor, grid_hw: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`patchify`: (rows * cols, C, p, p) patches -> (C, rows * p, cols * p)."""
    rows, cols = (int(n) for n in grid_hw)
    count, channels, patch_size, _ = patches.shape
    if count != rows * cols:
        raise ValueError(f"{count} patches do not fill a {rows}x{cols} grid")
    return (
        patches.reshape(rows, cols, channels, patch_size, patch_size)
        .permute(2, 0, 3, 1, 4)
        .reshape(channels, rows * patch_size, cols * patch_size)
    )


def unpatchify_pack(pixels: torch.Tensor, grid_hws: torch.Tensor) -> list[torch.Tensor]:
    """A pack's (L, C, p, p) patches, images concatenated, -> one (C, rows * p, cols * p) image per
    (N, 2) grid row (see :func:`unpatchify`)."""
    grids = grid_hws.tolist()
    return [unpatchify(chunk, grid) for chunk, grid in zip(pixels.split([h * w for h, w in grids]), grids)]


# ---- processor -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImagePlan:
    """Geometry of one image through the processor, computed from its size alone.

    Attributes:
        size: (width, height) of the input, after EXIF orientation.
        resized_size: (width, height) after the size-budget / side-limit resize (== ``size``
            when the image is not resized).
        box: (left, top, right, bottom) region of the resized image that becomes the output; the
            part past its right and bottom edges is black padding (with ``stretch_input``: the
            whole resized image, stretched instead).
        grid_hw: (rows, cols) of patches.
        stretched_size: (width, height) = (cols * p, rows * p) that the resized image is stretched
            to by a second Pillow bicubic resize (``stretch_input``); None when nothing is
            stretched (padded or cropped output, or resized sides already multiples of ``p * merge``).
    """

    size: Size
    resized_size: Size
    box: Box
    grid_hw: Size
    stretched_size: Size | None = None

    @property
    def num_patches(self) -> int:
        return self.grid_hw[0] * self.grid_hw[1]


@dataclass
class ImageBatch:
    """The processor's output for N images holding L patches in total.

    Attributes:
        pixel_values: (L, C, p, p) float32, normalised (C = 3; 6 for OpenVLA's fused processor: each
            tower's RGB); each image's patches in raster order, images concatenated.
        grid_hws: (N, 2) int64, patch rows and columns of each image.
    """

    pixel_values: torch.Tensor
    grid_hws: torch.Tensor

    def to(self, device: torch.device | str) -> ImageBatch:
        return ImageBatch(self.pixel_values.to(device), self.grid_hws.to(device))


class ImageProcessor(Protocol):
    """What the pipeline (packing, :mod:`moonvit.encode`, videos, the trainer) reads of an image processor.

    :class:`MoonViTImageProcessor` is one; the classic ViT's rules
    (:mod:`moonvit.families.vit.processor`) are others. :func:`moonvit.media.processor_for` gives a
    checkpoint's.

    Attributes:
        patch_size: patch side p in pixels.
        merge_kernel_size: (rows, cols) of patches the tower merges into one token ((1, 1): none).
        in_token_limit: the patch budget per image (a fixed-size rule: the patches every image gives).
        image_mean, image_std: the per-channel normalisation, one value per channel of its
            ``pixel_values`` (3; 6 for OpenVLA's fused backbone: each tower's RGB).
    """

    @property
    def patch_size(self) -> int: ...
    @property
    def merge_kernel_size(self) -> tuple[int, int]: ...
    @property
    def in_token_limit(self) -> int: ...
    @property
    def image_mean(self) -> tuple[float, ...]: ...
    @property
    def image_std(self) -> tuple[float, ...]: ...

    def plan_image(self, width: int, height: int, *, in_token_limit: int | None = None) -> ImagePlan:
        """An image's geometry and patch grid from its size alone (``in_token_limit``: another budget)."""
        ...

    def load_image(self, source: ImageInput) -> Image.Image:
        """``source`` decoded to an RGB Pillow image."""
        ...

    def render(self, image: Image.Image, plan: ImagePlan) -> torch.Tensor:
        """The RGB image resized / padded / cropped as ``plan`` says: (C, rows * p, cols * p) uint8 (3
        channels; OpenVLA's fused processor stacks each tower's copy, 6)."""
        ...

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 (..., C, p, p) -> float32 normalised pixels."""
        ...

    def __call__(
        self, images: ImageInput | Iterable[ImageInput], *, in_token_limit: int | Sequence[int | None] | None = None
    ) -> ImageBatch:
        """Images -> ``pixel_values`` (L, C, p, p) float32 and ``grid_hws`` (N, 2) int64."""
        ...

    def to_images(self, pixel_values: torch.Tensor, grid_hws: torch.Tensor) -> list[torch.Tensor]:
        """The processor's output back to one (3, rows * p, cols * p) uint8 image per grid."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """The settings, with ``image_processor_type``."""
        ...

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``directory/preprocessor_config.json``; returns its path."""
        ...


def process_images(
    processor: ImageProcessor,
    images: ImageInput | Iterable[ImageInput],
    in_token_limit: int | Sequence[int | None] | None = None,
) -> ImageBatch:
    """Any processor's ``__call__``: each image decoded, planned (``in_token_limit``: one budget, or one
    per image, None meaning the processor's own), rendered and cut into patches, one image at a time;
    then normalised. ``pixel_values`` (L, C, p, p) float32 (C: the processor's channels, 3, or 6 for
    OpenVLA's fused backbone) and ``grid_hws`` (N, 2) int64.

    Raises:
        ImageLoadError: an input cannot be read as an image.
        ValueError: a list of budgets of another length than the images.
    """
    sources = list(image_sources(images))
    if in_token_limit is None or isinstance(in_token_limit, int):
        limits: list[int | None] = [in_token_limit] * len(sources)
    else:
        limits = list(in_token_limit)
        if len(limits) != len(sources):
            raise ValueError(f"got {len(limits)} in_token_limit values for {len(sources)} images")
    patches, grids = [], []
    for source, limit in zip(sources, limits):
        image = processor.load_image(source)
        plan = processor.plan_image(*image.size, in_token_limit=limit)
        patches.append(patchify(processor.render(image, plan), processor.patch_size))
        grids.append(plan.grid_hw)
    p, channels = processor.patch_size, len(processor.image_mean)
    pixels = torch.cat(patches) if patches else torch.empty((0, channels, p, p), dtype=torch.uint8)
    return ImageBatch(processor.normalize(pixels), torch.tensor(grids, dtype=torch.int64).reshape(-1, 2))


class SavedSettings:
    """The settings file of an image-processor dataclass (every family's): :meth:`to_dict`, its fields
    after its class name, and :meth:`save_pretrained`, which writes them as ``preprocessor_config.json``
    (read back by the family's processor reader)."""

    def to_dict(self) -> dict[str, Any]:
        assert dataclasses.is_dataclass(self)
        return {"image_processor_type": type(self).__name__, **dataclasses.asdict(self)}

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write the settings to ``directory/preprocessor_config.json`` and return that path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        file = directory / CONFIG_NAME
        write_text_atomic(file, json.dumps(self.to_dict(), indent=2) + "\n")
        return file


@dataclass(frozen=True)
class MoonViTImageProcessor(SavedSettings):
    """Kimi-VL's native-resolution image processor (see the module docstring for the steps).

    Call it on one image or a list of them (:data:`ImageInput`) to get an :class:`ImageBatch`.

    Attributes:
        patch_size: patch side p in pixels.
        merge_kernel_size: (rows, cols) of the patch merger; images are padded to multiples of
            ``p * merge_kernel_size`` px.
        in_token_limit: patch budget per image: larger images are scaled down to about this many
            patches (4096 for Kimi-VL-A3B-Instruct/-Thinking, 16384 for -Thinking-2506). Padding
            can push the final count slightly above it, as upstream.
        pad_input: pad to multiples of ``p * merge`` (upstream's shipped setting). False
            centre-crops to those multiples instead (upstream crops to multiples of p, which
            leaves grids the merger cannot split into 2x2 groups).
        stretch_input: stretch each side up to a multiple of ``p * merge`` (Pillow bicubic, a
            second resize after the budget's) instead of padding, as NVIDIA LocateAnything does.
            It replaces the padding of ``pad_input=True``; with ``pad_input=False`` it is an error.
        image_mean, image_std: per-channel normalisation of pixels scaled to [0, 1].
        patch_limit_on_one_side: most patches along either side (the encoder's 512x512 tables).
        side_limit_mode: "error" refuses an image whose grid exceeds the limit, as Kimi-VL does
            (Kimi-VL also refuses exactly 512, which the encoder accepts); "resize" scales it
            down, with Kimi-K2.5's ``min(1, sqrt(limit / patches), 512 p / W, 512 p / H)``.
        alpha_mode: "composite" paints transparent pixels over ``background_color``; "drop"
            discards alpha like upstream's ``convert("RGB")``; "composite_rgba" paints mode RGBA
            only and drops every other alpha, as LocateAnything (see :func:`load_image`).
        background_color: RGB (0-255) behind transparent pixels in the compositing modes.
    """

    patch_size: int = 14
    merge_kernel_size: tuple[int, int] = (2, 2)
    in_token_limit: int = 4096
    pad_input: bool = True
    stretch_input: bool = False
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    patch_limit_on_one_side: int = 512
    side_limit_mode: SideLimitMode = "error"
    alpha_mode: AlphaMode = "composite"
    background_color: tuple[int, int, int] = (255, 255, 255)

    def __post_init__(self) -> None:
        for name in ("patch_size", "in_token_limit", "patch_limit_on_one_side"):
            _check_positive_int(name, getattr(self, name))
        merge = merge_kernel(self.merge_kernel_size)
        mean = _as_tuple("image_mean", self.image_mean, 3, float)
        std = _as_tuple("image_std", self.image_std, 3, float)
        if min(std) <= 0:
            raise ValueError(f"image_std must be positive, got {std}")
        background = _as_tuple("background_color", self.background_color, 3, int)
        if not all(0 <= value <= 255 for value in background):
            raise ValueError(f"background_color must be RGB values in 0-255, got {background}")
        if self.patch_limit_on_one_side < max(merge):
            raise ValueError("patch_limit_on_one_side must hold at least one merge kernel")
        _check_choice("side_limit_mode", self.side_limit_mode, SideLimitMode)
        _check_choice("alpha_mode", self.alpha_mode, AlphaMode)
        for name in ("pad_input", "stretch_input"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.stretch_input and not self.pad_input:
            raise ValueError("stretch_input=True and pad_input=False conflict: an image is stretched or cropped")
        for name, value in (
            ("merge_kernel_size", merge),
            ("image_mean", mean),
            ("image_std", std),
            ("background_color", background),
        ):
            object.__setattr__(self, name, value)

    # ---- configuration ---------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **overrides: Any) -> MoonViTImageProcessor:
        """Read ``preprocessor_config.json`` from a checkpoint folder, the file itself, or a hub id.

        Four forms are read (see :func:`image_settings`): this project's and Kimi-VL's flat
        fields, a Kimi-K2.5 / K2.6 release's ``media_proc_cfg``, transformers'
        ``Kimi_K25ImageProcessor`` keys, and NVIDIA LocateAnything's flat fields, recognised by an
        ``auto_map`` naming LocateAnything or, in a file without ``image_processor_type``, by
        ``"model_type": "locateanything"`` in the ``config.json`` beside it. A folder without the
        file gives the defaults, or :meth:`locateanything` when its ``config.json`` is
        LocateAnything's. In the flat forms, bookkeeping keys (``image_processor_type``,
        ``auto_map``, ``processor_class``, ``num_pooled_tokens``) are ignored and any other key that
        is not a field is named in a warning. ``overrides`` replace the file's values.

        Raises:
            CheckpointError: the path does not exist, or the file is not valid JSON or holds an
                invalid setting (the file named).
        """
        path = resolve_pretrained(path, _fetch_processor_files)
        if not path.exists():
            raise CheckpointError(f"processor config path {path} does not exist")
        file = path / CONFIG_NAME if path.is_dir() else path
        if path.is_dir() and not file.is_file():
            if _model_type(path) == LOCATEANYTHING:
                logger.info("no %s in %s: using LocateAnything's processor settings", CONFIG_NAME, path)
                return cls.locateanything(**overrides)
            logger.info("no %s in %s: using the default processor settings", CONFIG_NAME, path)
            return cls(**overrides)
        config = read_json(file)
        # A sibling config.json decides only for a file that does not name its processor type
        model_type = None if "image_processor_type" in config else _model_type(file.parent)
        if image_settings_form(config, model_type=model_type) in ("flat", "locateanything"):
            known = {f.name for f in dataclasses.fields(cls)}
            warn_unread_keys(file, config, {*known, *KIMI_UNUSED_KEYS})
        try:
            return cls(**{**image_settings(config, model_type=model_type), **overrides})
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"{file}: {error}") from error

    @classmethod
    def kimi_k25(cls, **overrides: Any) -> MoonViTImageProcessor:
        """Kimi-K2.5 / K2.6's image rule: 16384 patches, the per-side cap folded into the resize,
        mean / std 0.5."""
        return cls(**{"in_token_limit": 16384, "side_limit_mode": "resize", **overrides})

    @classmethod
    def kimi_k3(cls, **overrides: Any) -> MoonViTImageProcessor:
        """Kimi K3's image rule: K2.5's at 65536 patches (16384 LLM tokens)."""
        return cls.kimi_k25(**{"in_token_limit": 65536, **overrides})

    @classmethod
    def locateanything(cls, **overrides: Any) -> MoonViTImageProcessor:
        """NVIDIA LocateAnything-3B's image rule: 25600 patches, sides stretched (not padded) to
        multiples of 28 px, a side of 512 patches refused, mean / std 0.5, mode RGBA composited on
        white and every other alpha dropped."""
        return cls(**{**LOCATEANYTHING_SETTINGS, **overrides})

    # ---- geometry --------------------------------------------------------------------------

    def plan_image(self, width: int, height: int, *, in_token_limit: int | None = None) -> ImagePlan:
        """The resize, padding (or stretch) and patch grid of a ``width`` x ``height`` image, without pixels.

        ``in_token_limit`` replaces the processor's own budget for this image.

        Raises:
            ImageSizeError: the grid exceeds ``patch_limit_on_one_side`` with ``side_limit_mode="error"``,
                or, with ``pad_input=False``, the image is smaller than one merged token.
        """
        if width < 1 or height < 1:
            raise ValueError(f"image size must be positive, got {width}x{height}")
        limit = self.in_token_limit if in_token_limit is None else in_token_limit
        _check_positive_int("in_token_limit", limit)
        scale = self._scale(width, height, limit)
        resized = (width, height) if scale >= 1 else (max(1, int(width * scale)), max(1, int(height * scale)))
        stretched = None
        if self.stretch_input:
            box = (0, 0, *resized)  # the whole resized image, stretched
            out_w, out_h = self._round_up(*resized)
            if (out_w, out_h) != resized:
                stretched = (out_w, out_h)
        else:
            box = self._box(*resized)
            out_w, out_h = box[2] - box[0], box[3] - box[1]
        grid = (out_h // self.patch_size, out_w // self.patch_size)
        if max(grid) > self.patch_limit_on_one_side:
            raise ImageSizeError(
                f"a {width}x{height} image gives a {grid[0]}x{grid[1]} patch grid: a side over "
                f"{self.patch_limit_on_one_side} patches (patch_limit_on_one_side) exceeds the position table "
                "(side_limit_mode='resize', --side-limit-mode resize on the command lines, scales such images down)"
            )
        return ImagePlan((width, height), resized, box, grid, stretched)

    def _scale(self, width: int, height: int, limit: int) -> float:
        """Resize factor: the token budget, and in "resize" mode the per-side cap (never > 1)."""
        patches = (width // self.patch_size) * (height // self.patch_size)
        scale = math.sqrt(limit / patches) if patches > limit else 1.0
        if self.side_limit_mode == "resize":
            max_h, max_w = (
                self.patch_limit_on_one_side // kernel * kernel * self.patch_size for kernel in self.merge_kernel_size
            )
            scale = min(scale, max_w / width, max_h / height)
        return scale

    def _round_up(self, width: int, height: int) -> Size:
        """(width, height) rounded up to multiples of ``p * merge_kernel_size``, in px."""
        unit_h, unit_w = (kernel * self.patch_size for kernel in self.merge_kernel_size)
        return -(-width // unit_w) * unit_w, -(-height // unit_h) * unit_h

    def _box(self, width: int, height: int) -> Box:
        if self.pad_input:
            return (0, 0, *self._round_up(width, height))
        unit_h, unit_w = (kernel * self.patch_size for kernel in self.merge_kernel_size)
        crop_w, crop_h = width // unit_w * unit_w, height // unit_h * unit_h
        if crop_w == 0 or crop_h == 0:
            raise ImageSizeError(
                f"a {width}x{height} image is smaller than one merged token ({unit_w}x{unit_h} px); "
                "pad_input=False crops instead of padding"
            )
        left, top = (width - crop_w) // 2, (height - crop_h) // 2
        return (left, top, left + crop_w, top + crop_h)

    # ---- processing ------------------------------------------------------------------------

    def load_image(self, source: ImageInput) -> Image.Image:
        """:func:`load_image` with this processor's transparency settings."""
        return load_image(source, alpha_mode=self.alpha_mode, background_color=self.background_color)

    def __call__(
        self,
        images: ImageInput | Iterable[ImageInput],
        *,
        in_token_limit: int | Sequence[int | None] | None = None,
    ) -> ImageBatch:
        """Process one image or any iterable of them (list, generator, dataset) into an :class:`ImageBatch`.

        Images are decoded one at a time. ``in_token_limit`` (one value, or one per image, None
        meaning the processor's own) replaces the size budget.

        Raises:
            ImageLoadError: an input cannot be read as an image.
            ValueError: an image exceeds the position table (see :meth:`plan_image`).
        """
        return process_images(self, images, in_token_limit)

    @staticmethod
    def render(image: Image.Image, plan: ImagePlan) -> torch.Tensor:
        """Resize (Pillow bicubic on uint8) and pad, crop or stretch an RGB image: (3, rows * p, cols * p) uint8."""
        if image.size != plan.resized_size:
            image = image.resize(plan.resized_size, Image.Resampling.BICUBIC)
        if plan.stretched_size is not None:
            # A second resize, as LocateAnything does: one resize to the final size differs in pixels
            image = image.resize(plan.stretched_size, Image.Resampling.BICUBIC)
        elif plan.box != (0, 0, *image.size):
            image = image.crop(plan.box)  # Pillow fills the area past the image with 0: black padding
        return torch.from_numpy(np.array(image)).permute(2, 0, 1)

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 (..., 3, p, p) -> float32 ``(x / 255 - mean) / std``, in upstream's op order."""
        mean = torch.tensor(self.image_mean).view(3, 1, 1)
        std = torch.tensor(self.image_std).view(3, 1, 1)
        return pixels.float().div_(255).sub_(mean).div_(std)

    def to_images(self, pixel_values: torch.Tensor, grid_hws: torch.Tensor) -> list[torch.Tensor]:
        """Invert the processor's output: one (3, rows * p, cols * p) uint8 image per grid, padded."""
        mean = torch.tensor(self.image_mean).view(3, 1, 1)
        std = torch.tensor(self.image_std).view(3, 1, 1)
        pixels = (pixel_values.float().cpu() * std + mean).mul_(255).round_().clamp_(0, 255).to(torch.uint8)
        return unpatchify_pack(pixels, grid_hws)


def _fetch_processor_files(snapshot: HubSnapshot) -> None:
    """From a hub repository: preprocessor_config.json, or, when it has none, config.json (so that
    the snapshot folder exists and the defaults apply). Offline, a config not in the cache is an
    error rather than the defaults: Kimi-VL's releases differ in ``in_token_limit``."""
    if snapshot.optional_file(CONFIG_NAME) is None:
        snapshot.file("config.json")


def _fetch_video_processor_files(snapshot: HubSnapshot) -> None:
    """From a hub repository: the image processor's files, and the video one's where it has one."""
    _fetch_processor_files(snapshot)
    snapshot.optional_file(VIDEO_CONFIG_NAME, unknown="absent")


def _model_type(folder: Path) -> str | None:
    """``model_type`` of the checkpoint config ``folder/config.json``; None without one."""
    file = folder / "config.json"
    if not file.is_file():
        return None
    value = read_json(file).get("model_type")
    return value if isinstance(value, str) else None


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_choice(name: str, value: object, choices: Any) -> None:
    if value not in get_args(choices):
        raise ValueError(f"{name} must be one of {get_args(choices)}, got {value!r}")


def _as_tuple(name: str, value: Any, length: int, kind: type) -> tuple:
    values = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else (value,)
    if len(values) != length:
        raise ValueError(f"{name} must hold {length} values, got {value!r}")
    return tuple(kind(v) for v in values)


# ---- preprocessor_config.json forms ------------------------------------------------------------


def _fields_of(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in known}


def image_settings_form(config: dict[str, Any], *, model_type: str | None = None) -> str:
    """Which ``preprocessor_config.json`` form ``config`` is: ``"media_proc_cfg"``, ``"transformers"``,
    ``"locateanything"`` or ``"flat"``.

    LocateAnything's file has no ``image_processor_type``: it is known by an ``auto_map`` value
    naming LocateAnything, or by ``model_type`` (the checkpoint's ``config.json``'s) being
    ``"locateanything"``.
    """
    if isinstance(config.get("media_proc_cfg"), dict):
        return "media_proc_cfg"
    if str(config.get("image_processor_type", "")).startswith("Kimi_K25") or "max_patches" in config:
        return "transformers"
    auto_map = config.get("auto_map")
    names = auto_map.values() if isinstance(auto_map, dict) else ()
    if model_type == LOCATEANYTHING or any(LOCATEANYTHING in str(name).lower() for name in names):
        return "locateanything"
    return "flat"


def image_settings(config: dict[str, Any], *, model_type: str | None = None) -> dict[str, Any]:
    """:class:`MoonViTImageProcessor` fields from any of the ``preprocessor_config.json`` forms:

    - flat fields (this project's, Kimi-VL's): taken as they are;
    - ``media_proc_cfg`` (Kimi-K2.5 / K2.6 releases): ``in_patch_limit`` is the budget,
      ``patch_limit_on_one_side`` the per-side cap, applied by resizing;
    - transformers' ``Kimi_K25ImageProcessor``: ``max_patches``, ``size.max_height``, ``merge_size``;
    - NVIDIA LocateAnything's (see :func:`image_settings_form`; ``model_type`` as there):
      :data:`LOCATEANYTHING_SETTINGS` with the file's flat fields in their place.
    """
    form = image_settings_form(config, model_type=model_type)
    if form == "locateanything":
        return {**LOCATEANYTHING_SETTINGS, **_fields_of(MoonViTImageProcessor, config)}
    if form == "media_proc_cfg":
        media = config["media_proc_cfg"]
        fields = _fields_of(MoonViTImageProcessor, media)
        fields["side_limit_mode"] = "resize"
        if "in_patch_limit" in media:
            fields["in_token_limit"] = media["in_patch_limit"]
        return fields
    if form == "transformers":
        fields = _fields_of(MoonViTImageProcessor, config)
        fields["side_limit_mode"] = "resize"
        if "max_patches" in config:
            fields["in_token_limit"] = config["max_patches"]
        if "merge_size" in config:
            fields["merge_kernel_size"] = config["merge_size"]
        size = config.get("size") or {}
        if "max_height" in size:
            fields["patch_limit_on_one_side"] = size["max_height"]
        return fields
    return _fields_of(MoonViTImageProcessor, config)


VIDEO_CONFIG_NAME = "video_preprocessor_config.json"


def read_video_settings(path: str | os.PathLike, cls: type, **overrides: Any) -> Any:
    """A :class:`~moonvit.media.video.MoonViTVideoProcessor` from a checkpoint folder.

    Its frames use the folder's image settings (:meth:`MoonViTImageProcessor.from_pretrained`)
    with K2.5's per-side cap and per-frame budget: ``in_patch_limit_each_frame`` of a release's
    ``media_proc_cfg`` or of this package's ``video_preprocessor_config.json`` (default 4096), or
    ``max_patches`` of transformers' ``video_preprocessor_config.json``; the sampling rate
    (``sample_fps`` / ``fps``) and the chunk length (``temporal_merge_kernel_size`` /
    ``frames_per_chunk`` / ``temporal_patch_size``) likewise, and Kimi K3's budget for a whole
    video (``in_patch_limit_video``, in either file). A hub id is fetched like the image
    processor's files.
    """
    folder = resolve_pretrained(path, _fetch_video_processor_files)
    image = MoonViTImageProcessor.from_pretrained(folder)
    release: dict[str, Any] = {}
    if (folder / CONFIG_NAME).is_file():
        media = read_json(folder / CONFIG_NAME).get("media_proc_cfg")
        release = media if isinstance(media, dict) else {}
    video = read_json(folder / VIDEO_CONFIG_NAME) if (folder / VIDEO_CONFIG_NAME).is_file() else {}
    frame_limit = (
        release.get("in_patch_limit_each_frame")
        or video.get("in_patch_limit_each_frame")  # this package's own file
        or video.get("max_patches")  # transformers'
        or 4096
    )
    frames = dataclasses.replace(image, in_token_limit=int(frame_limit), side_limit_mode="resize")
    settings: dict[str, Any] = {"frame_processor": frames}
    video_limit = release.get("in_patch_limit_video", video.get("in_patch_limit_video"))
    if video_limit is not None:  # Kimi K3: a budget for the whole video
        settings["video_patch_limit"] = int(video_limit)
    rate = release.get("sample_fps", video.get("sample_fps", video.get("fps")))
    if rate is not None:
        settings["sample_fps"] = float(rate)
    chunk = release.get("temporal_merge_kernel_size", video.get("frames_per_chunk", video.get("temporal_patch_size")))
    if chunk is not None:
        settings["frames_per_chunk"] = int(chunk)
    return cls(**{**settings, **overrides})

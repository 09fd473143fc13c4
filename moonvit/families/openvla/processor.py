"""OpenVLA's (Prismatic's) image processors: one image, two towers' pixels, 6 channels per patch.

Prismatic (openvla/openvla's ``prismatic/extern/hf/processing_prismatic.py``, ``PrismaticImageProcessor``;
its training transform, ``prismatic/models/backbones/vision/dinosiglip_vit.py``) turns each image into
two tensors, one per tower, each the image resized (torchvision's ``resize`` and ``center_crop`` on the
Pillow image), ``to_tensor`` (``x / 255`` in float32) and normalised with that tower's mean and std, then
stacks them on channels: DINOv2's RGB, then SigLIP's. Here both come from one plan of the image's size
and are cut into patches in raster order, ``(rows * cols, 6, p, p)``, the layout
:class:`~moonvit.families.openvla.FusedBackbone` takes.

Rules, chosen by name (:func:`from_folder`, :func:`moonvit.media.processor_for`):

- ``openvla`` (:class:`FusedImageProcessor`, the default): Prismatic's ``image_resize_strategy`` at the
  towers' ``image_size`` (224 px: 16 x 16 patches of 14 px):

  - ``resize-naive`` (OpenVLA's): both sides to ``image_size``, aspect not kept;
  - ``resize-crop``: the shorter side to ``image_size`` (the longer to ``int(size * long / short)``,
    torchvision's ``Resize(int)``), then a centre crop of ``image_size`` square (offsets rounded half to
    even, torchvision's ``center_crop``), as timm's evaluation transform at ``crop_pct`` 1;
  - ``letterbox``: first padded to about a square, ``int((max(w, h) - side) / 2)`` pixels on both ends
    of the shorter side (one short of square where the difference is odd), in a constant colour, then
    as ``resize-crop``. Prismatic's training transform pads each tower's copy with its own mean
    (``int(mean * 255)``: DINOv2's 123 / 116 / 103, SigLIP's 127 / 127 / 127), so the towers' pixels
    differ in the padding; transformers' port (``PrismaticImageProcessor``) pads once, with the last
    tower's (SigLIP's) colour or its file's ``tvf_letterbox_fill``, and a folder's own file is read as
    it applies it (:attr:`FusedImageProcessor.letterbox_fills`).

  Every resize is Pillow's on the uint8 image (bicubic, the towers' timm ``interpolation``); an output
  that is not whole patches keeps its top-left ``rows * p`` pixels per side, the ones the strided patch
  convolution reads (384 px at patch 14: 27 x 27 patches, 378 px).
- ``native`` (:class:`NativeFusedImageProcessor`): each image at its own aspect, resized to whole
  patches within a patch budget (the towers' native grid, 256 patches, by default; never scaled up), no
  padding, no crop, both towers' normalisations. The towers' tables are resampled to each grid by timm's
  rule, so any grid runs; but OpenVLA's towers, projector and language model were trained on 16 x 16
  grids of 224 px images alone, so this rule's features are the towers' at other grids (useful for
  probes and features), not inputs OpenVLA was trained to act on.

A folder's own rule is its ``preprocessor_config.json``'s: transformers' ``PrismaticImageProcessor``
(``use_fused_vision_backbone``, ``image_resize_strategy``, ``input_sizes``, ``interpolations``,
``means``, ``stds`` and the ``tvf_*`` parameters it applies: where the file holds them, they are what
transformers runs, since ``ImageProcessingMixin`` sets them over the ones its ``__init__`` derives;
OpenVLA's release normalises DINOv2's half with ImageNet's statistics rounded to bfloat16,
0.484375 / 0.455078125 / 0.40625 and 0.228515625 / 0.2236328125 / 0.224609375, in its
``tvf_normalize_params``), or this package's classes. Without the file, the folder's ``config.json``
gives the rule (``image_resize_strategy``, ``image_sizes``) with timm's statistics of each tower
(ImageNet's for DINOv2, 0.5 / 0.5 for SigLIP) and each tower's letterbox colour.

Images decode as Prismatic's ``img.convert("RGB")`` does: alpha dropped, not composited
(:func:`~moonvit.media.image.load_image` with ``alpha_mode="drop"``); but the EXIF orientation of a file
is applied and the wide-range modes (``I;16``, ``I``, ``F``) are mapped from their value range, where
Pillow's conversion clips them, as every processor here does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
from PIL import Image, ImageOps

from ...media.image import ImageInput, load_image
from ...media.processor import (
    CONFIG_NAME,
    ImageBatch,
    ImagePlan,
    ImageProcessor,
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
from ..vit.processor import (
    HALF,
    IMAGENET_MEAN,
    IMAGENET_STD,
    RESAMPLE_NAMES,
    TIMM_INTERPOLATION,
    TRANSFORMERS_BOOKKEEPING,
    ClassicViTImageProcessor,
    NativeViTImageProcessor,
)
from .config import RESIZE_STRATEGIES, TOWERS, FusedBackboneConfig

__all__ = [
    "OPENVLA_RULES",
    "TOWER_MEANS",
    "TOWER_STDS",
    "FusedImageProcessor",
    "NativeFusedImageProcessor",
    "from_folder",
    "letterbox",
    "letterbox_fill",
    "native_rule",
    "openvla_rule",
]

Triple = tuple[float, float, float]
RGB = tuple[int, int, int]
ResizeStrategy = Literal["resize-naive", "resize-crop", "letterbox"]

TOWER_MEANS: tuple[Triple, Triple] = (IMAGENET_MEAN, HALF)
"""timm's mean of each tower (``data_cfg["mean"]``): DINOv2's ImageNet mean, then SigLIP's 0.5."""
TOWER_STDS: tuple[Triple, Triple] = (IMAGENET_STD, HALF)
"""timm's std of each tower: DINOv2's ImageNet std, then SigLIP's 0.5."""
OPENVLA_RULES = ("openvla", "native")
"""The rules the family names (``Family.processors``); ``openvla`` is the default."""
PRISMATIC_TYPE = "PrismaticImageProcessor"


def letterbox_fill(mean: Sequence[float]) -> RGB:
    """Prismatic's padding colour for a tower of ``mean``: ``int(m * 255)`` per channel (truncated)."""
    red, green, blue = (int(m * 255) for m in mean)
    return red, green, blue


def letterbox(image: Image.Image, fill: RGB) -> Image.Image:
    """Prismatic's ``letterbox_pad_transform``: ``int((max(w, h) - side) / 2)`` pixels of ``fill`` on both
    ends of each side (torchvision's constant ``pad``, Pillow's ``ImageOps.expand``); one pixel short of
    a square where the sides differ by an odd count."""
    (width, height), side = image.size, max(image.size)
    across, down = (side - width) // 2, (side - height) // 2
    return ImageOps.expand(image, border=(across, down, across, down), fill=fill)


def _letterboxed_size(width: int, height: int) -> tuple[int, int]:
    side = max(width, height)
    return width + (side - width) // 2 * 2, height + (side - height) // 2 * 2


# ---- what both rules share ---------------------------------------------------------------------


class _FusedRule(SavedSettings):
    """Decoding, rendering, normalising and patchifying for the two towers (both rules).

    Subclasses are frozen dataclasses with ``patch_size``, ``resamples``, ``image_means`` and
    ``image_stds`` fields, an ``in_token_limit`` (field or property), and ``kind``, ``plan_image``,
    :meth:`_geometry` and :meth:`describe`.
    """

    patch_size: int
    resamples: tuple[int, int]
    image_means: tuple[Triple, Triple]
    image_stds: tuple[Triple, Triple]

    @property
    def kind(self) -> str:
        """The rule's name (``openvla`` or ``native``)."""
        raise NotImplementedError

    @property
    def merge_kernel_size(self) -> tuple[int, int]:
        """(1, 1): each patch is one token of the fused backbone."""
        return (1, 1)

    @property
    def image_mean(self) -> tuple[float, ...]:
        """The mean of each of the 6 channels: DINOv2's RGB, then SigLIP's."""
        return (*self.image_means[0], *self.image_means[1])

    @property
    def image_std(self) -> tuple[float, ...]:
        """The std of each of the 6 channels: DINOv2's RGB, then SigLIP's."""
        return (*self.image_stds[0], *self.image_stds[1])

    def plan_image(self, width: int, height: int, *, in_token_limit: int | None = None) -> ImagePlan:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def _geometry(self, tower: int) -> ClassicViTImageProcessor | NativeViTImageProcessor:
        """The resize / crop of tower ``tower`` (0: DINOv2, 1: SigLIP) as the classic ViT's rule of that shape."""
        raise NotImplementedError

    def _fill(self, tower: int) -> RGB | None:
        """The letterbox colour of tower ``tower``; None: no letterbox."""
        return None

    def load_image(self, source: ImageInput) -> Image.Image:
        """RGB as Prismatic's ``img.convert("RGB")``: alpha dropped (see :func:`~moonvit.media.image.load_image`)."""
        return load_image(source, alpha_mode="drop")

    def render(self, image: Image.Image, plan: ImagePlan) -> torch.Tensor:
        """Each tower's copy of an RGB image, letterboxed (``openvla``'s ``letterbox``), resized and cropped as
        ``plan`` says, stacked: (6, rows * p, cols * p) uint8, DINOv2's RGB then SigLIP's (one render where
        the towers' colour and filter agree)."""
        copies: dict[tuple[RGB | None, int], torch.Tensor] = {}
        halves = []
        for tower in range(len(TOWERS)):
            key = (self._fill(tower), self.resamples[tower])
            if key not in copies:
                fill = key[0]
                padded = image if fill is None else letterbox(image, fill)
                copies[key] = self._geometry(tower).render(padded, plan)
            halves.append(copies[key])
        return torch.cat(halves)

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 (..., 6, p, p) -> float32: ``x / 255`` in float32 (torchvision's ``to_tensor``), then
        ``(x - mean) / std`` in float32 with each tower's statistics (its ``normalize``).

        Raises:
            ValueError: another channel count than 6.
        """
        if pixels.ndim < 3 or pixels.shape[-3] != 6:
            raise ValueError(
                f"the fused processor normalises 6 channels (DINOv2's RGB, then SigLIP's), got pixels of shape "
                f"{tuple(pixels.shape)}"
            )
        mean = torch.tensor(self.image_mean, dtype=torch.float32).view(6, 1, 1)
        std = torch.tensor(self.image_std, dtype=torch.float32).view(6, 1, 1)
        return pixels.to(torch.float32).div_(255).sub_(mean).div_(std)

    def __call__(
        self, images: ImageInput | Iterable[ImageInput], *, in_token_limit: int | Sequence[int | None] | None = None
    ) -> ImageBatch:
        """Process one image or any iterable of them: ``pixel_values`` (L, 6, p, p) float32, each image's
        patches in raster order, and ``grid_hws`` (N, 2) int64. ``in_token_limit`` (one value, or one per
        image) replaces the native rule's budget; ``openvla`` ignores it.

        Raises:
            ImageLoadError: an input cannot be read as an image.
        """
        return process_images(cast(ImageProcessor, self), images, in_token_limit)

    def to_images(self, pixel_values: torch.Tensor, grid_hws: torch.Tensor) -> list[torch.Tensor]:
        """Invert :meth:`normalize` and the patching of DINOv2's half: one (3, rows * p, cols * p) uint8
        image per grid (the towers' halves differ only in ``letterbox``'s padding colour)."""
        mean = torch.tensor(self.image_means[0]).view(3, 1, 1)
        std = torch.tensor(self.image_stds[0]).view(3, 1, 1)
        pixels = (pixel_values[:, :3].float().cpu() * std + mean).mul_(255).round_().clamp_(0, 255).to(torch.uint8)
        return unpatchify_pack(pixels, grid_hws)

    def _check_common(self) -> None:
        _check_positive_int("patch_size", self.patch_size)
        resamples = _as_tuple("resamples", self.resamples, 2, int)
        for value in resamples:
            if value not in RESAMPLE_NAMES:
                raise ValueError(f"resamples must be Pillow's filters {RESAMPLE_NAMES}, got {self.resamples!r}")
        means = _towers("image_means", self.image_means, float)
        stds = _towers("image_stds", self.image_stds, float)
        if (
            not all(math.isfinite(v) for v in (*means[0], *means[1], *stds[0], *stds[1]))
            or min(*stds[0], *stds[1]) <= 0
        ):
            raise ValueError(f"image_means must be finite and image_stds positive, got {means} and {stds}")
        object.__setattr__(self, "resamples", resamples)
        object.__setattr__(self, "image_means", means)
        object.__setattr__(self, "image_stds", stds)

    def _normalisation(self) -> str:
        def values(triple: Triple) -> str:
            return "/".join(f"{v:g}" for v in triple)

        return (
            f"DINOv2's half mean {values(self.image_means[0])}, std {values(self.image_stds[0])}; SigLIP's mean "
            f"{values(self.image_means[1])}, std {values(self.image_stds[1])}"
        )

    def _filters(self) -> str:
        first, second = (RESAMPLE_NAMES[r] for r in self.resamples)
        return first if first == second else f"{first} / {second}"


def _towers(name: str, value: Any, kind: type) -> tuple[Any, Any]:
    """Two per-tower triples (DINOv2's, then SigLIP's), as tuples of ``kind``."""
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2:
        raise ValueError(f"{name} must hold two triples (DINOv2's, then SigLIP's), got {value!r}")
    first, second = (_as_tuple(name, v, 3, kind) for v in value)
    return first, second


# ---- openvla: Prismatic's image_resize_strategy --------------------------------------------------


@dataclass(frozen=True)
class FusedImageProcessor(_FusedRule):
    """Prismatic's rule at a fixed size: letterbox (or not), resize, centre crop, each tower's normalisation.

    Every image gives the same grid, ``image_size // patch_size`` per side (16 x 16 at 224 px, patch 14).

    Attributes:
        patch_size: patch side p in pixels (the towers').
        image_size: the side every image is resized (and cropped) to (Prismatic's ``image_sizes``).
        image_resize_strategy: ``resize-naive``, ``resize-crop`` or ``letterbox`` (see the module docstring).
        resamples: each tower's Pillow filter code (3: bicubic, timm's ``interpolation``).
        letterbox_fills: each tower's padding colour with ``letterbox`` (None: each tower's
            ``int(mean * 255)``, Prismatic's training transform; a transformers file: its one colour for both).
        image_means, image_stds: each tower's normalisation of ``x / 255``: DINOv2's, then SigLIP's.
    """

    patch_size: int = 14
    image_size: int = 224
    image_resize_strategy: ResizeStrategy = "resize-naive"
    resamples: tuple[int, int] = (3, 3)
    letterbox_fills: tuple[RGB, RGB] | None = None
    image_means: tuple[Triple, Triple] = TOWER_MEANS
    image_stds: tuple[Triple, Triple] = TOWER_STDS

    def __post_init__(self) -> None:
        self._check_common()
        _check_positive_int("image_size", self.image_size)
        _check_choice("image_resize_strategy", self.image_resize_strategy, ResizeStrategy)
        if self.image_size < self.patch_size:
            raise ValueError(f"image_size {self.image_size} is smaller than one {self.patch_size} px patch")
        fills = self.letterbox_fills
        if fills is None:
            fills = (letterbox_fill(self.image_means[0]), letterbox_fill(self.image_means[1]))
        fills = _towers("letterbox_fills", fills, int)
        if not all(0 <= v <= 255 for v in (*fills[0], *fills[1])):
            raise ValueError(f"letterbox_fills must be RGB values in 0-255, got {self.letterbox_fills!r}")
        object.__setattr__(self, "letterbox_fills", fills)

    @property
    def kind(self) -> str:
        return "openvla"

    @property
    def grid_hw(self) -> tuple[int, int]:
        """(rows, cols) of patches of every image: 16 x 16 at 224 px, patch 14 (27 x 27 at 384)."""
        side = self.image_size // self.patch_size
        return side, side

    @property
    def in_token_limit(self) -> int:
        """The patches every image gives: the pipeline's per-image budget."""
        rows, cols = self.grid_hw
        return rows * cols

    def _geometry(self, tower: int) -> ClassicViTImageProcessor:
        size = self.image_size
        shape: dict[str, Any] = (
            {"size": (size, size)}
            if self.image_resize_strategy == "resize-naive"
            else {"size": None, "shortest_edge": size, "crop_size": (size, size)}
        )
        return ClassicViTImageProcessor(
            rule="timm", patch_size=self.patch_size, resample=self.resamples[tower], crop_offset="round",
            drop_remainder=True, **shape,
        )  # fmt: skip

    def _fill(self, tower: int) -> RGB | None:
        if self.image_resize_strategy != "letterbox":
            return None
        assert self.letterbox_fills is not None  # __post_init__ sets them
        return self.letterbox_fills[tower]

    def plan_image(self, width: int, height: int, *, in_token_limit: int | None = None) -> ImagePlan:
        """The letterbox, resize, crop and grid of a ``width`` x ``height`` image, without pixels
        (``resized_size`` and ``box`` are of the letterboxed image with ``letterbox``).

        ``in_token_limit`` is accepted for the pipeline's interface and changes nothing: every image
        gives :attr:`grid_hw`.
        """
        if width < 1 or height < 1:
            raise ValueError(f"image size must be positive, got {width}x{height}")
        padded = _letterboxed_size(width, height) if self.image_resize_strategy == "letterbox" else (width, height)
        plan = self._geometry(0).plan_image(*padded)
        return ImagePlan((width, height), plan.resized_size, plan.box, plan.grid_hw)

    def describe(self) -> str:
        """One line: the rule, its geometry and both normalisations."""
        size, filters = self.image_size, self._filters()
        if self.image_resize_strategy == "resize-naive":
            steps = f"resize to {size}x{size} ({filters})"
        else:
            steps = f"shorter side to {size} ({filters}), centre crop {size}x{size}"
        if self.image_resize_strategy == "letterbox":
            assert self.letterbox_fills is not None
            first, second = ("/".join(map(str, fill)) for fill in self.letterbox_fills)
            colour = first if first == second else f"DINOv2's {first}, SigLIP's {second}"
            steps = f"padded to square ({colour}), {steps}"
        rows, cols = self.grid_hw
        if rows * self.patch_size != size:
            steps += f", its top-left {cols * self.patch_size}x{rows * self.patch_size} px kept"
        return (
            f"OpenVLA's rule ({self.image_resize_strategy}): {steps}, {self._normalisation()}; {rows}x{cols} "
            f"patches of {self.patch_size} px, 6 channels"
        )


# ---- native: each image at its own aspect ----------------------------------------------------------


@dataclass(frozen=True)
class NativeFusedImageProcessor(_FusedRule):
    """Each image at its own aspect within a patch budget, both towers' normalisations.

    The geometry is :class:`~moonvit.families.vit.processor.NativeViTImageProcessor`'s: scaled down (never
    up) to about ``in_token_limit`` patches, sides rounded to whole patches, one Pillow resize, no padding,
    no crop. See the module docstring for what OpenVLA makes of other grids.

    Attributes:
        patch_size: patch side p in pixels (the towers').
        in_token_limit: the patch budget per image (default: the towers' native 16 x 16 grid).
        patch_limit_on_one_side: most patches along either side (the towers' ``max_grid_side``).
        resamples: each tower's Pillow filter code (3: bicubic).
        image_means, image_stds: each tower's normalisation of ``x / 255``: DINOv2's, then SigLIP's.
    """

    patch_size: int = 14
    in_token_limit: int = 256
    patch_limit_on_one_side: int = 512
    resamples: tuple[int, int] = (3, 3)
    image_means: tuple[Triple, Triple] = TOWER_MEANS
    image_stds: tuple[Triple, Triple] = TOWER_STDS

    def __post_init__(self) -> None:
        self._check_common()
        _check_positive_int("in_token_limit", self.in_token_limit)
        _check_positive_int("patch_limit_on_one_side", self.patch_limit_on_one_side)

    @property
    def kind(self) -> str:
        return "native"

    def _geometry(self, tower: int) -> NativeViTImageProcessor:
        return NativeViTImageProcessor(
            patch_size=self.patch_size, in_token_limit=self.in_token_limit,
            patch_limit_on_one_side=self.patch_limit_on_one_side, resample=self.resamples[tower],
        )  # fmt: skip

    def plan_image(self, width: int, height: int, *, in_token_limit: int | None = None) -> ImagePlan:
        """The resize and grid of a ``width`` x ``height`` image (the classic ViT's native rule), without
        pixels; ``in_token_limit`` replaces the budget for this image."""
        return self._geometry(0).plan_image(width, height, in_token_limit=in_token_limit)

    def describe(self) -> str:
        """One line: the rule, its budget and both normalisations."""
        return (
            f"native rule: up to {self.in_token_limit} patches of {self.patch_size} px an image (sides over "
            f"{self.patch_limit_on_one_side} capped), aspect kept, resized ({self._filters()}) to whole patches, "
            f"{self._normalisation()}; 6 channels"
        )


FusedProcessor = FusedImageProcessor | NativeFusedImageProcessor


# ---- rules by name ---------------------------------------------------------------------------------


def openvla_rule(config: FusedBackboneConfig, base: FusedProcessor | None = None) -> FusedImageProcessor:
    """``openvla`` for the backbone of ``config``: its ``image_resize_strategy`` at its ``image_size``; the
    filters and normalisations of ``base`` (the folder's own rule) where given, else bicubic, timm's
    statistics of each tower and each tower's letterbox colour (Prismatic's training transform)."""
    settings: dict[str, Any] = {}
    if base is not None:
        settings = {"resamples": base.resamples, "image_means": base.image_means, "image_stds": base.image_stds}
    return FusedImageProcessor(
        patch_size=config.patch_size,
        image_size=config.image_size,
        image_resize_strategy=cast(ResizeStrategy, config.image_resize_strategy),
        **settings,
    )


def native_rule(config: FusedBackboneConfig, base: FusedProcessor | None = None) -> NativeFusedImageProcessor:
    """``native`` for the backbone of ``config``: a budget of its native grid (256 patches at 224 px,
    patch 14), its ``max_grid_side``; the filters and normalisations of ``base`` (the folder's own rule)
    where given, else bicubic and timm's statistics."""
    settings: dict[str, Any] = {}
    if base is not None:
        settings = {"resamples": base.resamples, "image_means": base.image_means, "image_stds": base.image_stds}
    return NativeFusedImageProcessor(
        patch_size=config.patch_size,
        in_token_limit=config.grid_side**2,
        patch_limit_on_one_side=config.max_grid_side,
        **settings,
    )


# ---- a folder's processor --------------------------------------------------------------------------

_OWN_TYPES: dict[str, type[FusedProcessor]] = {
    cls.__name__: cls for cls in (FusedImageProcessor, NativeFusedImageProcessor)
}
_PRISMATIC_KEYS = {
    "use_fused_vision_backbone", "image_resize_strategy", "input_sizes", "interpolations", "means", "stds",
    "tvf_resize_params", "tvf_crop_params", "tvf_normalize_params", "tvf_do_letterbox", "tvf_letterbox_fill",
}  # fmt: skip


def from_folder(folder: Path, rule: str | None = None, **overrides: Any) -> ImageProcessor:
    """The processor of an OpenVLA / Prismatic (or own fused-backbone) folder: its own rule (``rule`` None, or
    the own rule's name: its ``preprocessor_config.json``, else ``openvla`` from its ``config.json``), or the
    rule ``rule`` names with the own rule's filters and normalisations (``native``; ``openvla`` at the
    config's strategy for a folder whose file is a native one). ``overrides`` replace fields last. The
    family's loader for :func:`moonvit.media.processor_for`.

    Raises:
        CheckpointError: the folder's config or processor file cannot be read, names another processor
            type, or holds a setting this package does not reproduce (the file and key named).
        ValueError: an unknown rule name, or an invalid override.
    """
    if rule is not None and rule not in OPENVLA_RULES:
        raise ValueError(f"unknown processor rule {rule!r} for {folder}; choose one of {', '.join(OPENVLA_RULES)}")
    config, _ = read_config(folder)
    if not isinstance(config, FusedBackboneConfig):
        raise CheckpointError(f"{folder} is not an OpenVLA fused-backbone checkpoint")
    file = folder / CONFIG_NAME
    own: FusedProcessor = _from_file(file, config) if file.is_file() else openvla_rule(config)
    processor: FusedProcessor = own
    if rule is not None and rule != own.kind:  # the named rule, with the folder's filters and normalisations
        processor = native_rule(config, own) if rule == "native" else openvla_rule(config, own)
    if not overrides:
        return cast(ImageProcessor, processor)
    try:
        return cast(ImageProcessor, dataclasses.replace(processor, **overrides))
    except TypeError as error:  # an unknown field
        raise ValueError(f"{folder}: {type(processor).__name__} has no such setting: {error}") from error


def _from_file(file: Path, config: FusedBackboneConfig) -> FusedProcessor:
    values = read_json(file)
    kind = values.get("image_processor_type")
    try:
        if kind in _OWN_TYPES:
            cls = _OWN_TYPES[kind]
            fields = {f.name for f in dataclasses.fields(cls)}
            warn_unread_keys(file, values, {*fields, "image_processor_type"})
            processor = cls(**{k: v for k, v in values.items() if k in fields})
        elif kind == PRISMATIC_TYPE:
            warn_unread_keys(file, values, _PRISMATIC_KEYS | TRANSFORMERS_BOOKKEEPING)
            processor = _from_prismatic(values, config)
        else:
            raise CheckpointError(
                f"{file}: image_processor_type {kind!r} is not OpenVLA's ({PRISMATIC_TYPE}, or this package's "
                f"{' / '.join(_OWN_TYPES)}); pass a rule by name ({', '.join(OPENVLA_RULES)}) to choose one"
            )
    except CheckpointError:
        raise
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{file}: {error}") from error
    if processor.patch_size != config.patch_size:
        raise CheckpointError(
            f"{file}: patch_size {processor.patch_size}, the backbone's towers take {config.patch_size} px patches"
        )
    return processor


def _from_prismatic(values: dict[str, Any], config: FusedBackboneConfig) -> FusedImageProcessor:
    """transformers' ``PrismaticImageProcessor`` settings as it applies them (the ``tvf_*`` values where the
    file holds them: ``ImageProcessingMixin`` sets them over the ones ``__init__`` derives)."""
    if values.get("use_fused_vision_backbone") is not True:
        raise ValueError(
            f"use_fused_vision_backbone {values.get('use_fused_vision_backbone')!r}: only the fused (DINOv2 + "
            "SigLIP) processor is read"
        )
    strategy = values.get("image_resize_strategy", "letterbox")  # the class's default
    if strategy not in RESIZE_STRATEGIES:
        raise ValueError(f"image_resize_strategy {strategy!r} is not one of {', '.join(RESIZE_STRATEGIES)}")
    sizes = values.get("input_sizes")
    if (
        not isinstance(sizes, list)
        or len(sizes) != 2
        or any(not isinstance(s, list) or len(s) != 3 or s[0] != 3 or s[1] != s[2] for s in sizes)
        or sizes[0] != sizes[1]
    ):
        raise ValueError(f"input_sizes {sizes!r}: two equal square [3, size, size] (one per tower) are read")
    size = sizes[0][1]
    if size != config.image_size:
        raise ValueError(
            f"input_sizes {size} px, but the backbone's towers are {config.image_size} px ones (config.json's "
            "image_sizes)"
        )
    names = values.get("interpolations")
    if not isinstance(names, list) or len(names) != 2 or any(name not in TIMM_INTERPOLATION for name in names):
        raise ValueError(f"interpolations {names!r}: two of timm's names ({', '.join(TIMM_INTERPOLATION)}) are read")
    resamples = [TIMM_INTERPOLATION[name] for name in names]
    file_means = _towers("means", values.get("means"), float)
    file_stds = _towers("stds", values.get("stds"), float)
    means: Any = file_means
    stds: Any = file_stds
    normalize = values.get("tvf_normalize_params")
    if normalize is not None:  # what transformers applies (OpenVLA's release: DINOv2's rounded to bfloat16)
        applied = _params("tvf_normalize_params", normalize)
        means, stds = [p.get("mean") for p in applied], [p.get("std") for p in applied]
    for key, value, expected in (
        ("tvf_resize_params", values.get("tvf_resize_params"), [size, size] if strategy == "resize-naive" else size),
        ("tvf_crop_params", values.get("tvf_crop_params"), [size, size]),
    ):
        if value is None:
            continue
        for i, params in enumerate(_params(key, value)):
            given = params.get("size" if key == "tvf_resize_params" else "output_size")
            if given != expected and not (isinstance(expected, int) and given == [expected]):
                raise ValueError(
                    f"{key}[{i}] size {given!r} does not go with image_resize_strategy {strategy!r} at {size} px "
                    f"(PrismaticImageProcessor writes {expected!r})"
                )
            if key == "tvf_resize_params":
                if params.get("max_size") is not None:
                    raise ValueError(f"{key}[{i}] max_size {params['max_size']!r}: only None is read")
                if params.get("interpolation") not in RESAMPLE_NAMES:
                    raise ValueError(f"{key}[{i}] interpolation {params.get('interpolation')!r} is not a filter code")
                resamples[i] = params["interpolation"]
    boxed = values.get("tvf_do_letterbox", strategy == "letterbox")
    if boxed != (strategy == "letterbox"):
        raise ValueError(f"tvf_do_letterbox {boxed!r} does not go with image_resize_strategy {strategy!r}")
    fills = None
    if strategy == "letterbox":  # one colour for both towers: the file's, else the last tower's mean's
        fill = values.get("tvf_letterbox_fill")
        one = letterbox_fill(file_means[1]) if fill is None else fill
        fills = (one, one)
    return FusedImageProcessor(
        patch_size=config.patch_size,
        image_size=size,
        image_resize_strategy=cast(ResizeStrategy, strategy),
        resamples=(resamples[0], resamples[1]),
        letterbox_fills=fills,
        image_means=_towers("tvf_normalize_params mean", means, float),
        image_stds=_towers("tvf_normalize_params std", stds, float),
    )


def _params(key: str, value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or len(value) != 2 or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"{key} must be a list of two objects (one per tower), got {value!r}")
    return value


register_processor_loader("openvla", from_folder)

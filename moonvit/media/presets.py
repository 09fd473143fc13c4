"""The processors each encoder family expects, and which family each preset belongs to.

A randomly initialised preset is still shaped like one released tower, so it preprocesses like
that tower's release:

- Kimi-VL (``so400m``, ``small``, ``tiny``): 4096 patches an image, a side over 512 patches
  refused; image-only tower.
- Kimi-K2.5 / K2.6 (the ``-3d`` presets): 16384 patches an image, 4096 a video frame, 2 fps.
- Kimi K3 (the ``-v2`` presets): 65536 patches an image, 16384 a frame, 655360 a video, 8 fps.
- NVIDIA LocateAnything-3B (no preset: its tower is ``so400m``; its folders bring the rule): 25600
  patches an image, stretched to multiples of 28 px; image-only tower.

A checkpoint folder brings its own processors (``from_pretrained``); :func:`describe_processors`
names the family rule they match, if any, for a command line's header.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..model.config import PRESETS
from .processor import ImageProcessor, MoonViTImageProcessor
from .video import MoonViTVideoProcessor

__all__ = [
    "FAMILY_RULES",
    "PRESET_FAMILIES",
    "ProcessorRule",
    "describe_processors",
    "family_rule",
    "preset_processors",
    "video_processor_of",
]


@dataclass(frozen=True)
class ProcessorRule:
    """A family's image and video processors.

    Attributes:
        family: the release the rule comes from ("Kimi-VL", "Kimi-K2.5", "Kimi K3", "LocateAnything-3B").
        image: the image processor.
        video: the video processor (for an image-only family: what videos would get, never used).
    """

    family: str
    image: MoonViTImageProcessor
    video: MoonViTVideoProcessor


def _kimi_vl(**image_overrides: Any) -> ProcessorRule:
    image = MoonViTImageProcessor(**image_overrides)
    return ProcessorRule("Kimi-VL", image, MoonViTVideoProcessor.for_images(image))


def _kimi_k25(**image_overrides: Any) -> ProcessorRule:
    image = MoonViTImageProcessor.kimi_k25(**image_overrides)
    return ProcessorRule("Kimi-K2.5", image, MoonViTVideoProcessor.for_images(image))  # 4096 a frame, 2 fps


def _kimi_k3(**image_overrides: Any) -> ProcessorRule:
    return ProcessorRule("Kimi K3", MoonViTImageProcessor.kimi_k3(**image_overrides), MoonViTVideoProcessor.kimi_k3())


def _locateanything(**image_overrides: Any) -> ProcessorRule:
    image = MoonViTImageProcessor.locateanything(**image_overrides)
    return ProcessorRule("LocateAnything-3B", image, MoonViTVideoProcessor.for_images(image))


FAMILY_RULES: dict[str, Callable[..., ProcessorRule]] = {
    "Kimi-VL": _kimi_vl,
    "Kimi-K2.5": _kimi_k25,
    "Kimi K3": _kimi_k3,
    "LocateAnything-3B": _locateanything,
}
"""Each family's processors, built with optional image-processor overrides."""

PRESET_FAMILIES: dict[str, str] = {
    "so400m": "Kimi-VL",
    "small": "Kimi-VL",
    "tiny": "Kimi-VL",
    "so400m-3d": "Kimi-K2.5",
    "small-3d": "Kimi-K2.5",
    "tiny-3d": "Kimi-K2.5",
    "moonvit-v2": "Kimi K3",
    "small-v2": "Kimi K3",
    "tiny-v2": "Kimi K3",
}
"""The family of each preset of :data:`moonvit.model.config.PRESETS` (a test keeps the two in step)."""


def family_rule(family: str, **image_overrides: Any) -> ProcessorRule:
    """A family's processors (see :data:`FAMILY_RULES`); ``image_overrides`` replace image settings
    (``side_limit_mode``, say)."""
    if family not in FAMILY_RULES:
        raise ValueError(f"unknown family {family!r}; choose one of {list(FAMILY_RULES)}")
    return FAMILY_RULES[family](**image_overrides)


def preset_processors(preset: str, **image_overrides: Any) -> ProcessorRule:
    """The processors a preset's tower expects: its family's rule (see the module docstring).

    Raises:
        ValueError: an unknown preset.
    """
    if preset not in PRESETS or preset not in PRESET_FAMILIES:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return family_rule(PRESET_FAMILIES[preset], **image_overrides)


def describe_processors(
    image: ImageProcessor, video: MoonViTVideoProcessor, *, takes_video: bool, family: str | None = None
) -> str:
    """One line naming the processors' rule and its numbers, e.g. ``Kimi K3's rule: images 65536
    patches (sides over 512 resized); videos 8 fps, 16384 patches a frame, 655360 a video``.

    ``family`` names the rule (a preset's); without it, the family whose rule the processors equal
    is named, if any (a checkpoint folder's). Videos are left out for an image-only tower
    (``takes_video`` False). Another family's processor (the classic ViT's) describes itself
    (its ``describe()``).
    """
    if not isinstance(image, MoonViTImageProcessor):
        describe = getattr(image, "describe", None)
        return describe() if callable(describe) else f"{type(image).__name__} {image.to_dict()}"
    if family is None:
        rules = (family_rule(name) for name in FAMILY_RULES)
        family = next((r.family for r in rules if r.image == image and (not takes_video or r.video == video)), None)
    rule = f"{family}'s rule" if family else "custom rule"
    over = "resized" if image.side_limit_mode == "resize" else "refused"
    fit = "stretched" if image.stretch_input else "padded" if image.pad_input else "cropped"
    line = (
        f"{rule}: images {image.in_token_limit} patches, {fit} to {image.patch_size * image.merge_kernel_size[0]} px "
        f"(sides over {image.patch_limit_on_one_side} {over})"
    )
    if takes_video:
        line += f"; videos {video.sample_fps:g} fps, {video.frame_processor.in_token_limit} patches a frame"
        if video.video_patch_limit is not None:
            line += f", {video.video_patch_limit} a video"
    return line


def video_processor_of(
    *, checkpoint: str | os.PathLike | None = None, preset: str | None = None
) -> MoonViTVideoProcessor:
    """The video processor of an encoder's source: a checkpoint folder's own settings
    (:meth:`MoonViTVideoProcessor.from_pretrained`), or a preset's family rule.

    Raises:
        ValueError: neither or both sources given, or an unknown preset.
    """
    if (checkpoint is None) == (preset is None):
        raise ValueError("give exactly one of a checkpoint folder or a preset name")
    if checkpoint is not None:
        return MoonViTVideoProcessor.from_pretrained(checkpoint)
    assert preset is not None
    return preset_processors(preset).video

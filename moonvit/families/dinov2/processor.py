"""DINOv2's image processors, on the classic ViT's machinery (:mod:`moonvit.families.vit.processor`).

Rules, chosen by name (:data:`DINOV2_RULES`, :func:`moonvit.media.processor_for`):

- ``dinov2``: transformers' ``BitImageProcessor`` as the facebook/dinov2-* releases ship it: the
  shorter side resized to 256 (the longer to ``int(256 * long / short)``), bicubic, a centre crop
  of 224 x 224 (16 x 16 patches of 14 px), ``x / 255``, ImageNet's mean and std (a
  :class:`~moonvit.families.vit.processor.ClassicViTImageProcessor`). Fixed, not the tower's
  ``image_size`` (518, the table's pretraining size), as the releases' files say; ``shortest_edge``
  and ``crop_size`` overrides give others;
- ``native``: the classic ViT's native rule
  (:class:`~moonvit.families.vit.processor.NativeViTImageProcessor`: whole patches within a budget
  of 4 times the table's grid, 4 x 37 x 37 patches, aspect kept, never padded) with DINOv2's filter
  and normalisation (bicubic, ImageNet's).

A folder's own rule is its ``preprocessor_config.json``'s (``BitImageProcessor``; a ViT or DeiT
processor file, which some DINOv2 fine-tunes ship; or this package's classes) or its timm
``pretrained_cfg``'s (timm's DINOv2: 518 px, crop_pct 1.0, bicubic, ImageNet's statistics).
Pixel values equal, in float32, those of transformers' PIL-backend processors.
"""

from __future__ import annotations

from typing import Any

from ...media.selection import register_processor_loader
from ..vit.config import ClassicViTConfig
from ..vit.processor import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    VIT_RULES,
    ClassicViTImageProcessor,
    PatchRule,
    RuleSet,
    fixed_file_reader,
    native_rule,
)

__all__ = ["DINOV2_RULES", "dinov2_native_rule", "dinov2_rule"]

DINOV2_RESIZE = 256
DINOV2_CROP = 224


def dinov2_rule(config: ClassicViTConfig) -> tuple[type[PatchRule], dict[str, Any]]:
    """``dinov2``: the shorter side to 256, bicubic, centre crop 224; ImageNet's mean and std."""
    return ClassicViTImageProcessor, {
        "rule": "dinov2", "patch_size": config.patch_size, "size": None, "shortest_edge": DINOV2_RESIZE,
        "crop_size": (DINOV2_CROP, DINOV2_CROP), "resample": 3, "image_mean": IMAGENET_MEAN,
        "image_std": IMAGENET_STD,
    }  # fmt: skip


def dinov2_native_rule(config: ClassicViTConfig) -> tuple[type[PatchRule], dict[str, Any]]:
    """``native``: the classic ViT's native rule with ImageNet's mean and std."""
    cls, settings = native_rule(config)
    return cls, {**settings, "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD}


# transformers' BitImageProcessor's class defaults, which a key the file lacks takes (CLIP's
# statistics; the DINOv2 releases' files give ImageNet's)
_BIT_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 224}, "resample": 3, "do_center_crop": True, "crop_size": {"height": 224, "width": 224},
    "image_mean": (0.48145466, 0.4578275, 0.40821073), "image_std": (0.26862954, 0.26130258, 0.27577711),
}  # fmt: skip

DINOV2_RULES = RuleSet(
    label="DINOv2",
    rules={"dinov2": dinov2_rule, "native": dinov2_native_rule},
    file_types={"BitImageProcessor": fixed_file_reader("dinov2", _BIT_DEFAULTS), **VIT_RULES.file_types},
)
"""DINOv2's rules (``dinov2``, ``native``) and folders."""

register_processor_loader("dinov2", DINOV2_RULES.from_folder)

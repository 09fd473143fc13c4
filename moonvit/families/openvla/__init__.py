"""OpenVLA's (Prismatic's) fused DINOv2 + SigLIP backbone and its projector: one family of the packed engine.

- :mod:`.config`: :class:`FusedBackboneConfig` and the timm towers it names (:func:`timm_tower`);
- :mod:`.formats`: OpenVLA's / Prismatic's folders and this package's own (config keys, tensor names);
- :mod:`.model`: :class:`FusedBackbone` (two :class:`~moonvit.families.vit.ClassicViT` towers on one
  pack, their second-to-last blocks' features side by side) and :class:`FusedProjector`.

Its processor (one image resized once, normalised for each tower, 6 channels per patch) is not built
yet: :func:`moonvit.media.processor_for` refuses the family's folders by name rather than reading them
with another family's rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

from ...media.selection import register_processor_loader
from .. import Family, register_family
from . import formats
from .config import TIMM_TOWERS, FusedBackboneConfig, timm_tower
from .model import FusedBackbone, FusedProjector

__all__ = ["TIMM_TOWERS", "FusedBackbone", "FusedBackboneConfig", "FusedProjector", "timm_tower"]

NAME = "openvla"

register_family(
    Family(
        name=NAME,
        description="OpenVLA / Prismatic's fused DINOv2 + SigLIP backbone and projector: model_type openvla or "
        "prismatic (the HF-ported releases), this package's model_type openvla_backbone",
        config_type=FusedBackboneConfig,
        claims=formats.claims,
        read=formats.read,
        build=FusedBackbone,
        processors=(NAME,),
    )
)


def _no_processor(folder: Path, rule: str | None = None, **overrides: Any) -> NoReturn:
    raise ValueError(
        f"{folder}: OpenVLA's fused backbone has no processor here yet; give the encoder pixel_values (L, 6, p, p): "
        "each image resized to the towers' size (Prismatic's image_resize_strategy), cut into patches in raster "
        "order, each patch's RGB normalised with ImageNet's mean and std (DINOv2's), then with 0.5 / 0.5 (SigLIP's)"
    )


register_processor_loader(NAME, _no_processor)

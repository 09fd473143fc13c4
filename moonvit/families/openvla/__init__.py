"""OpenVLA's (Prismatic's) fused DINOv2 + SigLIP backbone and its projector: one family of the packed engine.

- :mod:`.config`: :class:`FusedBackboneConfig` and the timm towers it names (:func:`timm_tower`);
- :mod:`.formats`: OpenVLA's / Prismatic's folders and this package's own (config keys, tensor names);
- :mod:`.model`: :class:`FusedBackbone` (two :class:`~moonvit.families.vit.ClassicViT` towers on one
  pack, their second-to-last blocks' features side by side) and :class:`FusedProjector`;
- :mod:`.processor`: its image processors (one image, each tower's normalisation, 6 channels per
  patch): ``openvla`` (:class:`FusedImageProcessor`, Prismatic's ``image_resize_strategy``, the default)
  and ``native`` (:class:`NativeFusedImageProcessor`); a folder's ``preprocessor_config.json``
  (transformers' ``PrismaticImageProcessor``) is read as transformers applies it.
"""

from __future__ import annotations

from .. import Family, register_family
from . import formats
from .config import TIMM_TOWERS, FusedBackboneConfig, timm_tower
from .model import FusedBackbone, FusedProjector
from .processor import OPENVLA_RULES, FusedImageProcessor, NativeFusedImageProcessor

__all__ = [
    "TIMM_TOWERS",
    "FusedBackbone",
    "FusedBackboneConfig",
    "FusedImageProcessor",
    "FusedProjector",
    "NativeFusedImageProcessor",
    "timm_tower",
]

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
        processors=OPENVLA_RULES,
        default_rule="openvla",
        tower_name="fused DINOv2 + SigLIP backbone of OpenVLA",
    )
)

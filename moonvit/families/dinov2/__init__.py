"""DINOv2 and DINOv2 with registers: one family of the packed engine, built as configs of the
classic-ViT tower (:class:`~moonvit.families.vit.ClassicViT`: CLS and register tokens, LayerScale,
the giant's SwiGLU MLP, each a field of :class:`~moonvit.families.vit.ClassicViTConfig`).

- :mod:`.config`: the released sizes and presets (:func:`dinov2_config`, :func:`dinov2_preset`);
- :mod:`.formats`: transformers' ``dinov2`` / ``dinov2_with_registers`` folders and timm's
  ``vit_*_patch14[_reg4]_dinov2`` folders (config keys, tensor names);
- :mod:`.processor`: the releases' processor (``dinov2``) and the native-resolution rule (``native``).
"""

from __future__ import annotations

from .. import Family, register_family
from ..vit.config import ClassicViTConfig
from ..vit.model import ClassicViT
from . import formats
from .config import PRESETS, SIZES, dinov2_config, dinov2_preset, swiglu_hidden_size
from .processor import DINOV2_RULES

__all__ = ["DINOV2_RULES", "PRESETS", "SIZES", "dinov2_config", "dinov2_preset", "swiglu_hidden_size"]

register_family(
    Family(
        name="dinov2",
        description="DINOv2 and DINOv2 with registers: transformers' dinov2 / dinov2_with_registers folders, "
        "timm's vit_*_patch14[_reg4]_dinov2 architectures",
        config_type=ClassicViTConfig,
        claims=formats.claims,
        read=formats.read,
        build=ClassicViT,
        processors=DINOV2_RULES.names,
        # native resolution by default (its table resampled per grid, as DINOv2's dense uses run it)
        default_rule="native",
        tower_name="DINOv2 tower",
    )
)

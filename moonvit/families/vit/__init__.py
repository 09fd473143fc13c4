"""The classic ViT and DeiT: one family of the packed engine.

- :mod:`.config`: :class:`ClassicViTConfig` and its presets;
- :mod:`.formats`: transformers', timm's and this package's folders (config keys, tensor names);
- :mod:`.model`: :class:`ClassicViT`, the tower (prefix tokens, the 1D table resampled per grid
  by the checkpoint's own rule, pre-LN blocks with exact GELU, heads);
- :mod:`.processor`: the checkpoints' own processors and the native-resolution rule.
"""

from __future__ import annotations

from .. import Family, register_family
from . import formats
from .config import PRESETS, ClassicViTConfig, classic_vit_config
from .model import ClassicViT
from .processor import RULES, ClassicViTImageProcessor, NativeViTImageProcessor, processor_for_config

__all__ = [
    "PRESETS",
    "RULES",
    "ClassicViT",
    "ClassicViTConfig",
    "ClassicViTImageProcessor",
    "NativeViTImageProcessor",
    "classic_vit_config",
    "processor_for_config",
]

register_family(
    Family(
        name="classic-vit",
        description="classic ViT / DeiT: transformers' vit / deit folders, timm's ViT and DeiT architectures, "
        "this package's model_type classic_vit",
        config_type=ClassicViTConfig,
        claims=formats.claims,
        read=formats.read,
        build=ClassicViT,
        processors=("vit", "deit", "native"),
        # native resolution by default: the 1D table resampled to each image's grid by the checkpoint's rule
        default_rule="native",
        tower_name="classic ViT / DeiT tower",
    )
)

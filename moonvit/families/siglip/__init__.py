"""SigLIP and SigLIP2 (NaFlex): families of the packed engine built as configs of the classic-ViT tower.

A SigLIP tower is :class:`~moonvit.families.vit.ClassicViT` without prefix tokens, with tanh GELU and
the MAP head (``pool "map"``); SigLIP2 NaFlex the same with its own table rule (``"naflex"``). No
tower of their own:

- :mod:`.config`: the fields they share, their sizes and presets (:func:`siglip_config`);
- :mod:`.formats`: transformers' ``siglip`` / ``siglip_vision_model`` and ``siglip2`` /
  ``siglip2_vision_model`` folders, the SigLIP tower inside PaliGemma, Gemma 3 and π0 folders
  (transformers' and LeRobot's), and timm's SigLIP folders (config keys, tensor names);
- :mod:`.processor`: the releases' processors (``siglip``; SigLIP2's ``naflex``) and the
  native-resolution rule (``native``; SigLIP2's is ``naflex``).
"""

from __future__ import annotations

from .. import Family, register_family
from ..vit import ClassicViT, ClassicViTConfig
from . import formats
from .config import PRESETS, SIZES, siglip_config
from .formats import SiglipLayout
from .processor import SIGLIP2_RULES, SIGLIP_RULES, NaFlexImageProcessor

__all__ = ["PRESETS", "SIGLIP2_RULES", "SIGLIP_RULES", "SIZES", "NaFlexImageProcessor", "SiglipLayout", "siglip_config"]

register_family(
    Family(
        name="siglip",
        description="SigLIP: transformers' siglip / siglip_vision_model folders (SiglipModel's vision half), "
        "the SigLIP tower of paligemma / gemma3 / pi0 folders and LeRobot's pi0 / pi05 / pi0_fast policies, "
        "timm's vit_*_siglip_* architectures",
        config_type=ClassicViTConfig,
        claims=formats.claims_siglip,
        read=formats.read_siglip,
        build=ClassicViT,
        processors=SIGLIP_RULES.names,
        # native resolution by default (its table resampled per grid, as interpolate_pos_encoding does);
        # the release's fixed square resize by --image-rule siglip
        default_rule="native",
        tower_name="SigLIP tower",
    )
)
register_family(
    Family(
        name="siglip2",
        description="SigLIP2 NaFlex: transformers' siglip2 / siglip2_vision_model folders (Siglip2Model's vision half)",
        config_type=ClassicViTConfig,
        claims=formats.claims_siglip2,
        read=formats.read_siglip2,
        build=ClassicViT,
        processors=SIGLIP2_RULES.names,
        default_rule="naflex",  # its own rule reads each image near its own size and aspect, within a budget
        tower_name="SigLIP2 NaFlex tower",
    )
)

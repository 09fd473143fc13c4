"""The folders OpenVLA's fused backbone comes in: their ``config.json`` and their tensor names.

- **OpenVLA / Prismatic** (``model_type`` ``"openvla"`` or ``"prismatic"``, the HF-ported releases
  such as ``openvla/openvla-7b``; keys as openvla/openvla's
  ``prismatic/extern/hf/configuration_prismatic.py`` writes them): ``timm_model_ids`` (the two towers,
  DINOv2 then SigLIP; else from ``vision_backbone_id``), ``image_sizes``, ``timm_override_act_layers``
  (none), ``use_fused_vision_backbone`` (true), ``arch_specifier`` (the fused GELU MLP),
  ``image_resize_strategy`` and ``text_config.hidden_size`` (the projector's output). Tensors (as
  ``prismatic/extern/hf/modeling_prismatic.py`` names them; vLLM's ``openvla.py`` reads the same):
  ``vision_backbone.featurizer.*`` and ``vision_backbone.fused_featurizer.*`` in timm's names, except
  LayerScale's ``ls1.gamma`` / ``ls2.gamma`` stored as ``ls1.scale_factor`` / ``ls2.scale_factor``
  (transformers renames parameters named ``gamma`` on load, so Prismatic renamed them), and
  ``projector.fc1`` / ``fc2`` / ``fc3``. The language model's ``language_model.*`` is never read, nor are
  the tensors the backbone does not run: each tower's last block and SigLIP's MAP head (``attn_pool.*``).
  ``timm_model_args`` (not in the releases; this package's, as timm's own ``model_args``) gives each tower
  other sizes.
- **own** (``model_type "openvla_backbone"``): :class:`FusedBackboneConfig`'s fields, the module's names.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...weights.config_keys import warn_unread_keys
from ...weights.formats import TensorLayoutError, TensorSource
from .config import TOWERS, FusedBackboneConfig, timm_tower

RELEASE_TYPES = ("openvla", "prismatic")
"""The ``model_type`` of OpenVLA's (and Prismatic's) HF-ported ``config.json``."""
OWN_TYPE = "openvla_backbone"

# Prismatic's vision_backbone_id -> its towers' timm ids and image sizes (configuration_prismatic.py), for a
# config.json without timm_model_ids; the fused DINOv2 + SigLIP backbones only.
VISION_BACKBONES = {
    "dinosiglip-vit-so-224px": (("vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"), (224, 224)),
    "dinosiglip-vit-so-384px": (("vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_384"), (384, 384)),
}  # fmt: skip
_READ = {
    "timm_model_ids", "image_sizes", "timm_override_act_layers", "use_fused_vision_backbone", "vision_backbone_id",
    "arch_specifier", "image_resize_strategy", "text_config", "timm_model_args",
}  # fmt: skip
# The language model's and the action head's settings: nothing of the backbone.
_IGNORED = {
    "llm_backbone_id", "hf_llm_id", "llm_max_length", "pad_to_multiple_of", "output_projector_states", "norm_stats",
    "n_action_bins", "image_token_index", "vocab_size",
    "num_images_in_input",  # OpenVLA-OFT's images per sample: here each image is one item of the pack
}  # fmt: skip
_CHECKPOINT_PREFIX = "vision_backbone."
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def claims(values: dict[str, Any]) -> bool:
    """Whether a ``config.json`` is OpenVLA's / Prismatic's, or this package's own fused backbone's."""
    return values.get("model_type") in (*RELEASE_TYPES, OWN_TYPE)


def read(values: dict[str, Any], where: Path, names: Collection[str]) -> tuple[FusedBackboneConfig, FusedLayout]:
    """The backbone's config and tensor layout of a folder (see the module docstring)."""
    if values.get("model_type") == OWN_TYPE:
        warn_unread_keys(where, values, FusedBackboneConfig.__dataclass_fields__)
        return FusedBackboneConfig.from_dict(values), FusedLayout("own", "")
    warn_unread_keys(where, values, _READ | _IGNORED)
    config = _release_config(values)
    layout = FusedLayout(
        "openvla",
        (_CHECKPOINT_PREFIX, "projector."),
        depths=tuple(getattr(config, name).num_hidden_layers for name in TOWERS),
        heads=tuple(getattr(config, name).pool == "map" for name in TOWERS),
    )
    if names:
        layout.check_depths(names)
    return config, layout


def _release_config(values: dict[str, Any]) -> FusedBackboneConfig:
    backbone = values.get("vision_backbone_id")
    fused = values.get("use_fused_vision_backbone")
    if fused is None and isinstance(backbone, str):  # as Prismatic's config derives it
        fused = backbone.startswith(("dinoclip", "dinosiglip"))
    if fused is not True:
        raise ValueError(
            f"use_fused_vision_backbone {fused!r} (vision_backbone_id {backbone!r}): only Prismatic's fused "
            "DINOv2 + SigLIP backbone is read"
        )
    ids, sizes = values.get("timm_model_ids"), values.get("image_sizes")
    if ids is None or sizes is None:
        if backbone not in VISION_BACKBONES:
            raise ValueError(
                f"no timm_model_ids / image_sizes, and vision_backbone_id {backbone!r} is not one of "
                f"{', '.join(VISION_BACKBONES)}"
            )
        ids = VISION_BACKBONES[backbone][0] if ids is None else ids
        sizes = VISION_BACKBONES[backbone][1] if sizes is None else sizes
    _pair("timm_model_ids", ids, str)
    _pair("image_sizes", sizes, int)
    acts = values.get("timm_override_act_layers") or [None, None]
    if not isinstance(acts, list) or any(act is not None for act in acts):
        raise ValueError(f"timm_override_act_layers {acts!r}: only timm's own activations (null) are supported")
    arch = values.get("arch_specifier")
    if arch is not None and not str(arch).endswith("fused-gelu-mlp"):
        raise ValueError(f"arch_specifier {arch!r}: only the fused backbone's projector ('...fused-gelu-mlp') is read")
    args = values.get("timm_model_args") or [{}, {}]
    if not isinstance(args, list) or len(args) != 2 or not all(isinstance(a, dict) for a in args):
        raise ValueError(f"timm_model_args must be a list of two objects (one per tower), got {args!r}")
    text = values.get("text_config")
    width = text.get("hidden_size") if isinstance(text, dict) else None
    if not isinstance(width, int) or isinstance(width, bool):
        raise ValueError(f"text_config.hidden_size (the projector's output width) is missing or not an int: {width!r}")
    if sizes[0] != sizes[1]:
        raise ValueError(f"image_sizes {list(sizes)!r}: both towers read the same patches of one resized image")
    towers = [timm_tower(ids[i], sizes[i], args[i]) for i in range(2)]
    return FusedBackboneConfig(
        featurizer=towers[0],
        fused_featurizer=towers[1],
        text_hidden_size=width,
        image_size=sizes[0],
        image_resize_strategy=values.get("image_resize_strategy", "letterbox"),  # Prismatic's default
    )


def _pair(key: str, value: Any, kind: type) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(isinstance(v, kind) for v in value):
        raise ValueError(f"{key} must be two {kind.__name__}s (DINOv2's, then SigLIP's), got {value!r}")


@dataclass(frozen=True)
class FusedLayout:
    """How a folder names the fused backbone's tensors.

    Attributes:
        name: ``openvla`` (the release's names) or ``own`` (the module's).
        prefix: every tensor the loader reads starts with one of these.
        depths: each tower's blocks in the checkpoint (``openvla``: the last one is not read).
        heads: whether each tower's checkpoint has a MAP head (``attn_pool.*``, not read).
    """

    name: str
    prefix: str | tuple[str, ...]
    depths: tuple[int, ...] = ()
    heads: tuple[bool, ...] = ()

    def source(self, model_name: str) -> TensorSource:
        """Where the module's state-dict entry ``model_name`` comes from."""
        if self.name == "own" or model_name.startswith("projector."):
            return TensorSource((model_name,))
        name = re.sub(r"\.(ls[12])\.gamma$", r".\1.scale_factor", model_name)
        return TensorSource((_CHECKPOINT_PREFIX + name,))

    def unused(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` is one the backbone does not run: a tower's last block,
        SigLIP's MAP head."""
        for tower, depth, head in zip(TOWERS, self.depths, self.heads):
            root = f"{_CHECKPOINT_PREFIX}{tower}."
            if name.startswith(f"{root}blocks.{depth - 1}.") or (head and name.startswith(f"{root}attn_pool.")):
                return True
        return False

    def check_depths(self, names: Collection[str]) -> None:
        """Each tower's blocks in ``names`` against its timm id's depth: the last block, never read, is
        counted here, so a checkpoint of another depth is refused rather than read short.

        Raises:
            TensorLayoutError: a tower with another number of blocks (both counts named).
        """
        for tower, depth in zip(TOWERS, self.depths):
            root = f"{_CHECKPOINT_PREFIX}{tower}."
            found = {int(m[1]) for n in names if n.startswith(root) and (m := _BLOCK.match(n[len(root) :]))}
            if found != set(range(depth)):
                raise TensorLayoutError(
                    f"{root}blocks: the checkpoint has {len(found)} blocks"
                    + (f" (numbered {min(found)}..{max(found)})" if found else "")
                    + f", its config.json's timm model has {depth}"
                )

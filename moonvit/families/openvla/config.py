"""Configuration of OpenVLA's fused backbone (:class:`FusedBackboneConfig`) and the timm towers it holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

from ...model.attention import check_attn_name
from ..dinov2 import formats as dinov2_formats
from ..siglip import formats as siglip_formats
from ..vit.config import ClassicViTConfig, PatchTokenConfig

TOWERS = ("featurizer", "fused_featurizer")
"""The two towers, by their names in OpenVLA's checkpoints (``vision_backbone.<name>.*``): DINOv2, then
SigLIP, in the order of the six input channels and of the output's features."""

RESIZE_STRATEGIES = ("resize-naive", "resize-crop", "letterbox")
"""Prismatic's ``image_resize_strategy`` values (for the processor; the tower does not read it)."""

TIMM_TOWERS = ("vit_large_patch14_reg4_dinov2", "vit_so400m_patch14_siglip_224", "vit_so400m_patch14_siglip_384")
"""The timm towers Prismatic's fused backbones name (timm 0.9.10 to 0.9.16), without their pretrained tags.

Each is read as its family reads a timm folder of that architecture (:mod:`moonvit.families.dinov2.formats`,
:mod:`moonvit.families.siglip.formats`): the sizes timm's ``VisionTransformer`` gets from the name, qkv
biases, LayerNorm eps 1e-6 and, for SigLIP so400m/14, the exact (erf) GELU that timm builds it with (not
the tanh GELU of big_vision's and transformers' SigLIP); Prismatic overrides neither tower's activation
(``timm_override_act_layers`` [None, None])."""
TIMM_SIZE_ARGS = ("patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "reg_tokens")
"""The model_args a folder may give over a tower's (``timm_model_args``, as timm's own ``model_args``)."""


def timm_tower(model_id: str, image_size: int, overrides: Mapping[str, Any] | None = None) -> ClassicViTConfig:
    """The tower timm builds for ``timm.create_model(model_id, num_classes=0, img_size=image_size)``.

    ``model_id`` may carry its pretrained tag (``vit_large_patch14_reg4_dinov2.lvd142m``); ``overrides``
    replace the size arguments (:data:`TIMM_SIZE_ARGS`). timm's grid is ``image_size // patch`` per side,
    the rest of the image cut off by the strided convolution (384 px at patch 14: 27 x 27 patches, 378 px
    read). The config records the tower's family (``dinov2``, ``siglip``).

    Raises:
        ValueError: a model id that is not one of :data:`TIMM_TOWERS`, an override of another argument.
    """
    if not isinstance(model_id, str) or model_id.split(".")[0] not in TIMM_TOWERS:
        raise ValueError(f"timm model {model_id!r} is not a tower this package builds ({', '.join(TIMM_TOWERS)})")
    extra = sorted(set(overrides or {}) - set(TIMM_SIZE_ARGS))
    if extra:
        raise ValueError(
            f"timm_model_args for {model_id}: {', '.join(extra)} not read (only {', '.join(TIMM_SIZE_ARGS)})"
        )
    values = {"architecture": model_id, "model_args": {**(overrides or {}), "img_size": image_size}}
    read = dinov2_formats.read if dinov2_formats.claims(values) else siglip_formats.read_siglip
    config, _ = read(values, Path(model_id), ())
    return config


def _dinov2() -> ClassicViTConfig:
    return timm_tower("vit_large_patch14_reg4_dinov2.lvd142m", 224)


def _siglip() -> ClassicViTConfig:
    return timm_tower("vit_so400m_patch14_siglip_224", 224)


@dataclass
class FusedBackboneConfig(PatchTokenConfig):
    """OpenVLA's (Prismatic's ``dinosiglip``) fused vision backbone and its projector.

    The defaults are ``openvla/openvla-7b``'s: DINOv2 ViT-L/14 with 4 registers and SigLIP so400m/14,
    both at 224 px (16 x 16 patches), into Llama-2 7B (4096 wide).

    Attributes:
        featurizer, fused_featurizer: each tower as its checkpoint holds it (every block, SigLIP's MAP
            head); the module runs each up to its second-to-last block, whose output (before the final
            norm, prefix tokens dropped) is the tower's feature: timm's
            ``get_intermediate_layers(n={depth - 2})``, as Prismatic calls it.
        text_hidden_size: the language model's width, the projector's output (None: no projector).
        image_size: the side Prismatic resizes each image to (its ``image_sizes``, for the processor); the
            towers' grid is ``image_size // patch_size`` per side (timm's strided convolution drops the
            rest: 27 x 27 patches of a 384 px image).
        image_resize_strategy: Prismatic's resize before the towers' normalisation (for the processor).
    """

    featurizer: ClassicViTConfig = field(default_factory=_dinov2)
    fused_featurizer: ClassicViTConfig = field(default_factory=_siglip)
    text_hidden_size: int | None = 4096
    image_size: int = 224
    image_resize_strategy: str = "resize-naive"
    attn_implementation: str = "auto"
    model_type: str = field(default="openvla_backbone", init=False)

    def __post_init__(self) -> None:
        for name in TOWERS:
            value = cast(Any, getattr(self, name))
            if isinstance(value, Mapping):  # read from config.json
                value = ClassicViTConfig.from_dict(dict(value))
                setattr(self, name, value)
            if not isinstance(value, ClassicViTConfig):
                raise ValueError(f"{name} must be a classic-ViT tower config, got {type(value).__name__}")
            if value.num_channels != 3:
                raise ValueError(f"{name} takes {value.num_channels} channels; each tower takes RGB (3)")
            if value.num_hidden_layers < 2:
                raise ValueError(
                    f"{name} has {value.num_hidden_layers} block(s): its features are the second-to-last's"
                )
            if value.distillation_token or value.num_classes:
                raise ValueError(f"{name}: a tower of the fused backbone has no distillation token and no head")
        first, second = self.featurizer, self.fused_featurizer
        if first.patch_size != second.patch_size or first.grid_side != second.grid_side:
            raise ValueError(
                "both towers read the same patches: featurizer is patch "
                f"{first.patch_size} at {first.image_size} px, fused_featurizer patch {second.patch_size} at "
                f"{second.image_size} px"
            )
        if not isinstance(self.image_size, int) or self.image_size // first.patch_size != first.grid_side:
            raise ValueError(
                f"image_size {self.image_size!r} does not give the towers' {first.grid_side} x {first.grid_side} "
                f"patches of {first.patch_size} px"
            )
        text = self.text_hidden_size
        if text is not None and (not isinstance(text, int) or isinstance(text, bool) or text < 1):
            raise ValueError(f"text_hidden_size must be a positive int or None (no projector), got {text!r}")
        if self.image_resize_strategy not in RESIZE_STRATEGIES:
            raise ValueError(
                f"image_resize_strategy {self.image_resize_strategy!r} is not one of {', '.join(RESIZE_STRATEGIES)}"
            )
        check_attn_name(self.attn_implementation)

    # ---- the towers as the module runs them ------------------------------------------------
    def feature_tower(self, name: str) -> ClassicViTConfig:
        """The tower ``name`` as the module builds it: its blocks up to the second-to-last (the last one's
        output is never read), no MAP head (SigLIP's is unused), the module's attention backend."""
        tower: ClassicViTConfig = getattr(self, name)
        return dataclasses.replace(
            tower,
            num_hidden_layers=tower.num_hidden_layers - 1,
            pool="token" if tower.class_token else "avg",
            attn_implementation=self.attn_implementation,
        )

    @property
    def slices(self) -> dict[str, slice]:
        """Which columns of the features each tower gives: ``featurizer`` (DINOv2) first, then
        ``fused_featurizer`` (SigLIP); OpenVLA's: [0, 1024) and [1024, 2176)."""
        width = self.featurizer.hidden_size
        return {"featurizer": slice(0, width), "fused_featurizer": slice(width, self.hidden_size)}

    # ---- what the engine reads of every tower's config -------------------------------------
    @property
    def hidden_size(self) -> int:
        """The features' width: the towers' widths added (OpenVLA's 1024 + 1152 = 2176)."""
        return self.featurizer.hidden_size + self.fused_featurizer.hidden_size

    @property
    def num_hidden_layers(self) -> int:
        """The blocks the deeper tower runs before its features are read (26 of SigLIP's 27). Each tower's
        hidden states are its own (``encoder.featurizer(...)``); the fused module gives only the features."""
        return max(self.featurizer.num_hidden_layers, self.fused_featurizer.num_hidden_layers) - 1

    @property
    def num_channels(self) -> int:
        """6: the image normalised for the first tower, then for the second, per patch."""
        return self.featurizer.num_channels + self.fused_featurizer.num_channels

    @property
    def patch_size(self) -> int:
        return self.featurizer.patch_size

    @property
    def grid_side(self) -> int:
        """The towers' native grid per side (16 at 224 px, patch 14)."""
        return self.featurizer.grid_side

    @property
    def max_grid_side(self) -> int:
        return min(self.featurizer.max_grid_side, self.fused_featurizer.max_grid_side)

    @property
    def head_dim(self) -> int:
        return self.featurizer.head_dim

    gives_hidden_states: ClassVar[bool] = False
    """The fused forward gives no hidden states (each tower's are its own: ``encoder.featurizer(...)``)."""

    def describe(self) -> str:
        """The backbone's shape in one line."""
        towers = " + ".join(
            f"{name} ({getattr(self, name).hidden_size} wide, read after {getattr(self, name).num_hidden_layers - 1} "
            f"of its {getattr(self, name).num_hidden_layers} blocks)"
            for name in TOWERS
        )
        width = self.hidden_size
        projector = (
            f", projector {width} -> {4 * width} -> {self.text_hidden_size} -> {self.text_hidden_size}"
            if self.text_hidden_size
            else ""
        )
        return f"fused backbone: {towers}, patch {self.patch_size}, {width} features per patch{projector}"

    def flops(self, seqlens: Sequence[int]) -> float:
        """Matmul FLOPs of the two towers' blocks that run, over items of ``seqlens`` patches (projector aside)."""
        return sum(self.feature_tower(name).flops(seqlens) for name in TOWERS)

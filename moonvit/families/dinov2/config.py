"""DINOv2's sizes as configs of the classic-ViT tower (:class:`~moonvit.families.vit.ClassicViTConfig`).

DINOv2 is a ViT with a CLS token, LayerScale on both residual branches, LayerNorm eps 1e-6 and a
518 px table at patch 14 (37 x 37); the giant size has a SwiGLU MLP; the "with registers" models
add register tokens after the CLS token. No switch of its own: every piece is a field of the
classic ViT's config, read by the modules of :mod:`moonvit.families.vit.model`.
"""

from __future__ import annotations

from typing import Any

from ..vit.config import ClassicViTConfig

# The released sizes: (width, depth, heads); the MLP is 4x the width (giant: SwiGLU of that ratio).
SIZES = {
    "small": (384, 12, 6),
    "base": (768, 12, 12),
    "large": (1024, 24, 16),
    "giant": (1536, 40, 24),
}
SWIGLU_SIZES = frozenset({"giant"})
IMAGE_SIZE = 518
PATCH_SIZE = 14
LAYER_NORM_EPS = 1e-6


def swiglu_hidden_size(mlp_width: int) -> int:
    """The width of each of SwiGLU's two projections for a plain MLP of ``mlp_width``: two thirds of
    it, rounded up to a multiple of 8 (the original code's rule, as transformers' ``Dinov2SwiGLUFFN``
    keeps it: 4096 for the giant's 6144)."""
    return (int(mlp_width * 2 / 3) + 7) // 8 * 8


def dinov2_config(size: str, registers: int = 0, **overrides: Any) -> ClassicViTConfig:
    """A DINOv2 tower of a released size (:data:`SIZES`), with ``registers`` register tokens, as the
    transformers folders build it (:class:`~moonvit.families.vit.ClassicViTConfig`; ``overrides``
    replace its fields).

    The table rule is the reference's: transformers' ``Dinov2Model`` resamples bicubically in float32
    (``transformers-f32``); ``Dinov2WithRegistersModel`` and timm with antialias (``timm``).
    """
    if size not in SIZES:
        raise ValueError(f"unknown DINOv2 size {size!r}; choose one of {', '.join(SIZES)}")
    width, depth, heads = SIZES[size]
    swiglu = size in SWIGLU_SIZES
    fields: dict[str, Any] = dict(
        hidden_size=width,
        num_hidden_layers=depth,
        num_attention_heads=heads,
        intermediate_size=swiglu_hidden_size(4 * width) if swiglu else 4 * width,
        mlp_type="swiglu" if swiglu else "mlp",
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        layer_norm_eps=LAYER_NORM_EPS,
        layer_scale=True,
        layer_scale_init=1e-5,
        num_register_tokens=registers,
        pool="token",
        pos_emb_rule="timm" if registers else "transformers-f32",
        family="dinov2",
    )
    return ClassicViTConfig(**{**fields, **overrides})


PRESETS: dict[str, dict[str, Any]] = {
    f"dinov2-{size}{'-reg4' if registers else ''}": dict(size=size, registers=registers)
    for size in SIZES
    for registers in (0, 4)
}
"""``dinov2-small`` ... ``dinov2-giant``, and each with 4 registers (``dinov2-small-reg4``): the facebook
releases' towers (``facebook/dinov2-small``, ``facebook/dinov2-with-registers-small``, ...)."""


def dinov2_preset(name: str, **overrides: Any) -> ClassicViTConfig:
    """A named preset (:data:`PRESETS`), with overrides of the config's fields."""
    if name not in PRESETS:
        raise ValueError(f"unknown DINOv2 preset {name!r}; choose one of {sorted(PRESETS)}")
    return dinov2_config(**PRESETS[name], **overrides)

"""SigLIP and SigLIP2 towers as :class:`~moonvit.families.vit.config.ClassicViTConfig`\\ s: what they share,
their standard sizes, and named presets.

A SigLIP tower is the classic ViT without prefix tokens: a square learned table (no class row), pre-LN
blocks with tanh GELU and LayerNorm eps 1e-6, the final norm, then the MAP head (``pool "map"``) or,
where a VLM drops it (PaliGemma's ``vision_use_head: false``), nothing (``pool "avg"``: ``pooled`` is
the mean of the patch rows). SigLIP's table follows transformers' rule (bicubic), SigLIP2 NaFlex's its
own (bilinear with antialias, in float32, ``num_patches`` rows: 16 x 16 for 256), timm's folders timm's.
"""

from __future__ import annotations

from typing import Any

from ..vit.config import ClassicViTConfig

SIGLIP_FIELDS: dict[str, Any] = dict(
    class_token=False, pool="map", hidden_act="gelu_tanh", layer_norm_eps=1e-6, qkv_bias=True, num_classes=0
)
"""The :class:`ClassicViTConfig` fields every SigLIP tower shares (timm's folders may override the GELU); each
reader also sets ``family`` (``siglip``, or ``siglip2`` for NaFlex's), the spec the commands ask."""

SIZES: dict[str, tuple[int, int, int, int]] = {
    # name: (width, depth, heads, MLP width); timm's size names, big_vision's shapes
    "base": (768, 12, 12, 3072),
    "large": (1024, 24, 16, 4096),
    "so400m": (1152, 27, 16, 4304),  # timm: mlp_ratio 3.7362 -> int(1152 * 3.7362) = 4304
    "giantopt": (1536, 40, 16, 6144),
}


def sized(size: str) -> dict[str, int]:
    """The width, depth, heads and MLP width of a standard size (:data:`SIZES`) as config fields."""
    if size not in SIZES:
        raise ValueError(f"SigLIP size {size!r} is not one of {', '.join(SIZES)}")
    width, depth, heads, mlp = SIZES[size]
    return dict(hidden_size=width, num_hidden_layers=depth, num_attention_heads=heads, intermediate_size=mlp)


PRESETS: dict[str, dict[str, Any]] = {
    # google/siglip-base-patch16-224, google/siglip-so400m-patch14-384 (SiglipModel's vision half)
    "siglip-base-16-224": dict(sized("base"), patch_size=16, image_size=224),
    # (384 px at patch 14: a 27 x 27 table, 378 px; transformers' convolution drops the last 6 pixels)
    "siglip-so400m-14-384": dict(sized("so400m"), patch_size=14, image_size=378, input_size=384),
    # PaliGemma's (and pi0's) tower: so400m/14 at 224 px without the MAP head
    "paligemma-so400m-14-224": dict(sized("so400m"), patch_size=14, image_size=224, pool="avg"),
    # google/siglip2-so400m-patch16-naflex: num_patches 256, a 16 x 16 table
    "siglip2-so400m-16-naflex": dict(sized("so400m"), patch_size=16, image_size=256, pos_emb_rule="naflex"),
    "siglip2-base-16-naflex": dict(sized("base"), patch_size=16, image_size=256, pos_emb_rule="naflex"),
    # Tests: a 4 x 4 table of 8 px patches
    "siglip-tiny": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, patch_size=8, image_size=32
    ),
}


def siglip_config(name: str, **overrides: Any) -> ClassicViTConfig:
    """The tower config of a named preset (:data:`PRESETS`), with overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown SigLIP preset {name!r}; choose one of {sorted(PRESETS)}")
    preset = PRESETS[name]
    if "image_size" in overrides:  # another table: the release's size was the preset's table's
        preset = {key: value for key, value in preset.items() if key != "input_size"}
    fields = {**SIGLIP_FIELDS, "pos_emb_rule": "transformers", **preset, **overrides}
    fields.setdefault("family", "siglip2" if fields["pos_emb_rule"] == "naflex" else "siglip")
    return ClassicViTConfig(**fields)

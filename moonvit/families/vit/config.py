"""Configuration of the classic ViT and DeiT towers (``ClassicViTConfig``) and its presets."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...files import write_text_atomic
from ...model.attention import check_attn_name
from ...model.config import DictConfig, matmul_flops

POS_EMB_RULES = ("transformers", "transformers-f32", "timm", "jax", "naflex")
"""How a checkpoint's own code resamples its table's patch rows to another grid:

- ``transformers``: ``interpolate_pos_encoding``: bicubic, ``align_corners=False``, no antialias,
  in the table's dtype; the table unchanged at its native square grid.
- ``transformers-f32``: ``Dinov2Model``'s: the same bicubic, computed in float32.
- ``timm``: ``resample_abs_pos_embed``: bicubic with ``antialias=True`` (PIL's cubic kernel,
  a = -0.5, whether the grid grows or shrinks), computed in float32; also transformers'
  ``Dinov2WithRegistersModel``.
- ``jax``: the original code's ``scipy.ndimage.zoom(order=1)``: a linear spline through the
  corner rows (bilinear with ``align_corners=True``), in float32.
- ``naflex``: SigLIP2 NaFlex's ``resize_positional_embeddings``: bilinear with ``antialias=True``,
  ``align_corners=False``, computed in float32 for every grid (the native one included).
"""
POOLS = ("token", "avg", "map")
ACTIVATIONS = ("gelu", "gelu_tanh")
MLP_TYPES = ("mlp", "swiglu")


class PatchTokenConfig(DictConfig):
    """The config base of an image-only tower with no merger, each patch row one token (the classic
    ViT's and OpenVLA's fused backbone's): what the engine reads of it, and its ``config.json``.

    The packed grid's RoPE angles and 2D-table taps, which it computes from ``init_pos_emb_*`` and
    ``rope_theta``, go unused by these towers (their 1D tables resample per grid size). A subclass
    gives ``grid_side``, its native patch grid per side."""

    @property
    def grid_side(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} does not say its grid")

    @property
    def merge_kernel_size(self) -> tuple[int, int]:
        """(1, 1): no merger; each patch row is one output (or LLM) token."""
        return (1, 1)

    @property
    def tokens_per_merge(self) -> int:
        return 1

    @property
    def init_pos_emb_time(self) -> int:
        """0: an image-only tower."""
        return 0

    @property
    def max_frames(self) -> int:
        return 1

    @property
    def init_pos_emb_height(self) -> int:
        return self.grid_side

    @property
    def init_pos_emb_width(self) -> int:
        return self.grid_side

    rope_theta = 10000.0
    pos_emb_interpolation_mode = "bicubic"

    def switches(self) -> dict[str, Any]:
        return {}

    def save(self, folder: str | Path) -> None:
        """Write ``config.json`` into ``folder`` (atomically)."""
        write_text_atomic(Path(folder) / "config.json", json.dumps(self.to_dict(), indent=2) + "\n")


@dataclass
class ClassicViTConfig(PatchTokenConfig):
    """Hyper-parameters of a classic ViT (or DeiT) tower.

    Field names follow transformers' ``ViTConfig`` where it has one. The defaults are ViT-B/16 at
    224 px as transformers builds it (LayerNorm eps 1e-12; timm's folders read 1e-6).

    - ``image_size`` / ``patch_size``: the table's native grid is ``image_size // patch_size`` per
      side (14 x 14 at 224 px); any grid runs, the table resampled by ``pos_emb_rule``;
      ``input_size``: the side the release's images are resized to where its patches do not cover
      it (SigLIP so400m/14 at 384 px: a 27 x 27 table, ``image_size`` 378, the patch convolution
      dropping the last 6 px), which a fixed rule resizes to; None where it is ``image_size``.
    - ``class_token``, ``distillation_token``: the prefix tokens, in that order (DeiT: both).
    - ``pool``: ``"token"``: ``pooled`` is the CLS row after the final norm (the seed's
      ``pre_logits``); ``"avg"``: the mean of the item's patch rows after the final norm (GAP,
      with no CLS token).
    - ``num_classes``: the linear head's classes (0: no head); ``distilled_head``: a second head
      on the distillation token, the logits the mean of the two (DeiT with teacher).
    - ``pooler``: transformers' ``ViTModel`` pooler (dense + tanh on the CLS row), kept where a
      folder has it and returned as ``pooler_output``.

    The same tower runs the ViTs that VLM and VLA stacks load (SigLIP, SigLIP2, DINOv2):

    - ``hidden_act``: ``"gelu"`` (exact, erf) or ``"gelu_tanh"`` (SigLIP's);
    - ``mlp_type``: ``"mlp"`` (fc1, GELU, fc2) or ``"swiglu"`` (DINOv2 giant's: ``fc1`` gives
      [gate | up], each ``intermediate_size`` wide; ``fc2(silu(gate) * up)``);
    - ``layer_scale``: a learned per-channel scale on each residual branch (DINOv2's LayerScale,
      ``ls1.gamma`` / ``ls2.gamma``, initialised to ``layer_scale_init``);
    - ``num_register_tokens``: register tokens after the CLS token (DINOv2 with registers), with
      no table row of their own;
    - ``no_embed_class``: the table has rows for the patches only (timm's DINOv2 with registers);
      else the CLS and distillation tokens have a row each, ahead of the patches';
    - ``pool "map"``: ``pooled`` is the MAP head's output (SigLIP's ``attn_pool``: a learned query
      attending over the item's patch rows after the final norm, then a residual MLP).

    ``family`` names the checkpoint family the tower was read as (``classic-vit``, or another family
    that builds this tower: its reader sets it), so that the commands ask that family's spec
    (:func:`moonvit.families.family_of`) for its default processor rule and its name in messages.
    """

    patch_size: int = 16
    image_size: int = 224
    input_size: int | None = None
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    num_channels: int = 3
    layer_norm_eps: float = 1e-12
    qkv_bias: bool = True
    class_token: bool = True
    distillation_token: bool = False
    pool: str = "token"
    num_classes: int = 0
    distilled_head: bool = False
    pooler: bool = False
    pos_emb_rule: str = "transformers"
    hidden_act: str = "gelu"
    mlp_type: str = "mlp"
    layer_scale: bool = False
    layer_scale_init: float = 1e-5
    num_register_tokens: int = 0
    no_embed_class: bool = False
    max_grid_side: int = 512
    drop_path_rate: float = 0.0
    attn_implementation: str = "auto"
    family: str = "classic-vit"
    model_type: str = field(default="classic_vit", init=False)

    def __post_init__(self) -> None:
        for name in ("patch_size", "image_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.input_size == self.image_size:
            self.input_size = None  # one spelling of "the table's own size"
        if self.input_size is not None and (
            not isinstance(self.input_size, int)
            or isinstance(self.input_size, bool)
            or self.input_size // self.patch_size != self.grid_side
        ):
            raise ValueError(
                f"input_size {self.input_size!r} is not a size in px whose whole {self.patch_size} px patches are the "
                f"table's {self.grid_side} (image_size {self.image_size}): the release's size the table was cut from"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.pos_emb_rule not in POS_EMB_RULES:
            raise ValueError(f"pos_emb_rule {self.pos_emb_rule!r} is not one of {', '.join(POS_EMB_RULES)}")
        if self.pool not in POOLS:
            raise ValueError(f"pool {self.pool!r} is not one of {', '.join(POOLS)}")
        for name, value, choices in (
            ("hidden_act", self.hidden_act, ACTIVATIONS),
            ("mlp_type", self.mlp_type, MLP_TYPES),
        ):
            if value not in choices:
                raise ValueError(f"{name} {value!r} is not one of {', '.join(choices)}")
        if not isinstance(self.num_register_tokens, int) or self.num_register_tokens < 0:
            raise ValueError(f"num_register_tokens must be an int >= 0, got {self.num_register_tokens!r}")
        if self.num_register_tokens and not self.class_token:
            raise ValueError("register tokens come after the class token: class_token must be true")
        if self.num_register_tokens and self.distillation_token:
            raise ValueError("a tower has a distillation token (DeiT) or register tokens (DINOv2), not both")
        if self.pool == "token" and not self.class_token:
            raise ValueError("pool 'token' needs the class token (class_token true), or use pool 'avg'")
        if self.distillation_token and not self.class_token:
            raise ValueError("a distillation token comes after the class token: class_token must be true")
        if self.distilled_head and not (self.distillation_token and self.num_classes):
            raise ValueError("distilled_head needs the distillation token and a head (num_classes > 0)")
        if self.num_classes < 0:
            raise ValueError(f"num_classes must be >= 0 (0: no head), got {self.num_classes}")
        if self.pooler and not self.class_token:
            raise ValueError("the pooler reads the class token: class_token must be true")
        if not 0.0 <= self.drop_path_rate < 1.0:
            raise ValueError(f"drop_path_rate must lie in [0, 1), got {self.drop_path_rate}")
        check_attn_name(self.attn_implementation)

    # ---- what the engine reads of every tower's config (the rest: PatchTokenConfig's) ---------
    @property
    def grid_side(self) -> int:
        """The table's native patch grid per side (14 for 224 px at patch 16)."""
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    norm_type = "layernorm"

    @property
    def num_prefix_tokens(self) -> int:
        """The prefix tokens of each item: CLS, then DeiT's distillation token or the registers."""
        return int(self.class_token) + int(self.distillation_token) + self.num_register_tokens

    @property
    def num_table_prefix_rows(self) -> int:
        """The table's rows ahead of the patches': one per CLS / distillation token (registers have
        none), none with ``no_embed_class``."""
        return 0 if self.no_embed_class else int(self.class_token) + int(self.distillation_token)

    def describe(self) -> str:
        """The tower's shape in one line."""
        tokens = ["CLS"] * self.class_token + ["distillation"] * self.distillation_token
        tokens += [f"{self.num_register_tokens} registers"] * bool(self.num_register_tokens)
        prefix = " + ".join(tokens) or "no prefix"
        pool = {"token": "", "avg": ", mean-pooled", "map": ", MAP head"}[self.pool]
        head = f", head {self.num_classes}" + (" x 2" if self.distilled_head else "") if self.num_classes else ""
        extras = "".join(
            [
                ", SwiGLU" * (self.mlp_type == "swiglu"),
                ", LayerScale" * self.layer_scale,
                ", tanh GELU" * (self.hidden_act == "gelu_tanh"),
            ]
        )
        return (
            f"ViT: {self.num_hidden_layers} blocks x {self.hidden_size} ({self.num_attention_heads} heads, "
            f"MLP {self.intermediate_size}{extras}), patch {self.patch_size}, {prefix}{pool}, 1D table "
            f"{self.grid_side}x{self.grid_side} + {self.num_table_prefix_rows} ({self.pos_emb_rule}){head}"
        )

    def flops(self, seqlens: Sequence[int], depth: int | None = None) -> float:
        """Matmul FLOPs of one forward over items of ``seqlens`` patches each (their prefix tokens added)."""
        layers = self.num_hidden_layers if depth is None else depth
        tokens = [n + self.num_prefix_tokens for n in seqlens]
        embed = 2.0 * sum(seqlens) * self.num_channels * self.patch_size**2 * self.hidden_size
        # SwiGLU's fc1 is two projections of intermediate_size: 1.5 times a plain MLP's of that width
        mlp_width = self.intermediate_size * (3 if self.mlp_type == "swiglu" else 2) // 2
        blocks = matmul_flops(tokens, self.hidden_size, mlp_width, layers, 1, None, 0)
        if self.pool == "map":  # the MAP head: k, v of every patch row, then one query per item
            blocks += 4.0 * sum(seqlens) * self.hidden_size**2
        return embed + blocks


# Transformers' and timm's standard sizes: (width, depth, heads); the MLP is 4x the width.
SIZES = {
    "tiny": (192, 12, 3),
    "small": (384, 12, 6),
    "base": (768, 12, 12),
    "large": (1024, 24, 16),
    "huge": (1280, 32, 16),
}

_TINY: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=64, patch_size=16
)

PRESETS: dict[str, dict[str, Any]] = {
    # google/vit-base-patch16-224 (as transformers builds it).
    "vit-base-16": dict(num_classes=1000),
    # facebook/deit-base-distilled-patch16-224 (transformers' DeiTForImageClassificationWithTeacher).
    "deit-base-distilled-16": dict(distillation_token=True, num_classes=1000, distilled_head=True),
    # CPU experiments (Fashion-MNIST at 28 px: patch 4, a 7 x 7 grid).
    "vit-small-exp": dict(
        hidden_size=192,
        num_hidden_layers=6,
        num_attention_heads=3,
        intermediate_size=768,
        layer_norm_eps=1e-6,
        patch_size=4,
        image_size=28,
    ),
    # Tests: a 4 x 4 table at 64 px, and the same with DeiT's tokens and two heads.
    "vit-tiny": _TINY,
    "deit-tiny": dict(_TINY, distillation_token=True, num_classes=10, distilled_head=True),
}


def classic_vit_config(name: str, **overrides: Any) -> ClassicViTConfig:
    """A named preset (:data:`PRESETS`), with overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown classic-ViT preset {name!r}; choose one of {sorted(PRESETS)}")
    return ClassicViTConfig(**{**PRESETS[name], **overrides})

"""Configuration of the MoonViT encoder and its presets."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..files import write_text_atomic
from .attention import check_attn_name
from .position import ArrayT, resample_taps

C = TypeVar("C", bound="DictConfig")


class DictConfig:
    """``to_dict`` / ``from_dict`` for the config dataclasses (config.json files)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any]) -> C:
        """Build from a dict, ignoring keys that are not fields (checkpoint configs carry extras)."""
        names = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in values.items() if k in names})


def merge_kernel(value: Any) -> tuple[int, int]:
    """A patch merger's (kh, kw) as two positive ints, from a pair (a JSON list, say) or one int k (k x k)."""
    try:
        kh, kw = (value, value) if isinstance(value, int) else (int(k) for k in value)
    except (TypeError, ValueError):
        raise ValueError(f"merge_kernel_size must be two positive ints, got {value!r}") from None
    if kh < 1 or kw < 1:
        raise ValueError(f"merge_kernel_size must be two positive ints, got {value!r}")
    return kh, kw


@dataclass
class MoonViTConfig(DictConfig):
    """Hyper-parameters of a MoonViT encoder.

    Field names follow Kimi-VL's ``vision_config`` so that a config read from a
    checkpoint maps one to one; the defaults are the released model
    (SigLIP-SO400M dimensions).

    ``init_pos_emb_time`` is the number of rows of the fixed sin-cos temporal
    table of Kimi-K2.5 / K2.6's tower (MoonViT3d): 4, the most frames a clip
    may have; 0 (Kimi-VL) means an image-only tower.

    ``drop_path_rate`` is a training option (stochastic depth, drawn per image,
    growing linearly with depth to this rate at the last block); it has no
    effect in eval mode.

    Kimi K3's tower (MoonViT-V2) is the same encoder with other switches, each
    defaulting to the Kimi-VL / K2.5 behaviour:

    - ``qkv_hidden_size``: the attention's inner width (K3: 1536 for a 1024-wide
      tower, head_dim 128); None means ``hidden_size``.
    - ``norm_type``: ``"layernorm"`` or ``"rmsnorm"`` (norm0, norm1, the final norm).
    - ``layer_norm_eps``: the norms' epsilon; None (RMSNorm only, as K3 builds it)
      takes the epsilon of the dtype the norm computes in (torch's RMSNorm default).
    - ``attn_bias`` (wqkv, wo), ``linear_bias`` (the MLP), ``patch_embed_proj_bias``
      (the patch convolution): whether those layers have biases.
    - ``pos_emb_interpolation_mode``: ``"bicubic"`` or ``"bilinear"``, how the
      position table is resampled to each grid (``F.interpolate``, align_corners False).

    A family answers for itself: :meth:`switches` lists the switches it sets,
    :meth:`describe` its shape in one line, :meth:`flops` its matmul count and
    :meth:`position_taps` how its table is resampled, so that programs need not
    read the switches.
    """

    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 0
    num_attention_heads: int = 16
    num_hidden_layers: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    merge_kernel_size: tuple[int, int] = (2, 2)
    num_channels: int = 3
    rope_theta: float = 10000.0
    max_grid_side: int = 512
    layer_norm_eps: float | None = 1e-5
    drop_path_rate: float = 0.0
    attn_implementation: str = "auto"
    qkv_hidden_size: int | None = None
    norm_type: str = "layernorm"
    attn_bias: bool = True
    linear_bias: bool = True
    patch_embed_proj_bias: bool = True
    pos_emb_interpolation_mode: str = "bicubic"
    model_type: str = field(default="moonvit", init=False)

    def __post_init__(self) -> None:
        self.merge_kernel_size = merge_kernel(self.merge_kernel_size)
        for name, allowed in (("norm_type", NORM_TYPES), ("pos_emb_interpolation_mode", INTERPOLATION_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name} {getattr(self, name)!r} is not supported (only {', '.join(map(repr, allowed))})"
                )
        for name in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.layer_norm_eps is None and self.norm_type != "rmsnorm":
            raise ValueError(
                "layer_norm_eps None (the dtype's epsilon) is for norm_type 'rmsnorm'; LayerNorm needs a number"
            )
        if self.qkv_hidden_size is not None and self.qkv_hidden_size < 1:
            raise ValueError(f"qkv_hidden_size must be positive (or None: hidden_size), got {self.qkv_hidden_size}")
        if self.attention_width % self.num_attention_heads:
            width = "hidden_size" if self.qkv_hidden_size is None else "qkv_hidden_size"
            raise ValueError(
                f"{width} {self.attention_width} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.head_dim % 4:
            raise ValueError(f"2D RoPE needs head_dim divisible by 4, got {self.head_dim}")
        if self.init_pos_emb_time < 0:
            raise ValueError(f"init_pos_emb_time must be >= 0 (0: no temporal table), got {self.init_pos_emb_time}")
        if not 0.0 <= self.drop_path_rate < 1.0:
            raise ValueError(f"drop_path_rate must lie in [0, 1), got {self.drop_path_rate}")
        check_attn_name(self.attn_implementation)

    @property
    def attention_width(self) -> int:
        """The attention's inner width: ``qkv_hidden_size``, or ``hidden_size`` where it is not set."""
        return self.hidden_size if self.qkv_hidden_size is None else self.qkv_hidden_size

    @property
    def head_dim(self) -> int:
        return self.attention_width // self.num_attention_heads

    @property
    def max_frames(self) -> int:
        """The most frames a clip may have: the temporal table's rows, or 1 for an image-only tower."""
        return max(self.init_pos_emb_time, 1)

    @property
    def tokens_per_merge(self) -> int:
        """kh * kw, the patches that become one merged token."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    def switches(self) -> dict[str, Any]:
        """The architecture switches (:data:`SWITCHES`) whose value differs from the Kimi-VL / K2.5
        default, by name: empty for Kimi-VL, K2.5 / K2.6 and LocateAnything, K3's for MoonViT-V2.

        ``init_pos_emb_time`` is not one: it is a size (the temporal table's rows, 0 or 4), as the
        spatial table's are, and K2.5 is a default family.
        """
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in SWITCHES}
        return {name: getattr(self, name) for name in SWITCHES if getattr(self, name) != defaults[name]}

    def describe(self) -> str:
        """The tower's shape in one line (a training run compares it on resume); a tower with switches
        adds its attention width, norm, biases and resampling (a different epsilon alone adds nothing)."""
        shape = (
            f"{self.num_hidden_layers} blocks x {self.hidden_size} ({self.num_attention_heads} heads, "
            f"MLP {self.intermediate_size}), patch {self.patch_size}, table "
            f"{self.init_pos_emb_height}x{self.init_pos_emb_width}"
        )
        if set(self.switches()) - {"layer_norm_eps"}:
            shape += (
                f", attention {self.attention_width}, {self.norm_type}, {self._biases()}, "
                f"{self.pos_emb_interpolation_mode}"
            )
        return shape

    def _biases(self) -> str:
        present = [
            name
            for name, on in (
                ("attention", self.attn_bias),
                ("MLP", self.linear_bias),
                ("patch embedding", self.patch_embed_proj_bias),
            )
            if on
        ]
        if len(present) == 3:
            return "biases"
        return f"biases only in {' and '.join(present)}" if present else "no biases"

    def flops(self, seqlens: Sequence[int], depth: int | None = None) -> float:
        """Matmul FLOPs of one forward over items of ``seqlens`` packed rows each (a clip's frames
        together; the kept patches under token dropping), at ``depth`` blocks (default: all).

        Counts the patch embedding, the projections (wqkv D x 3A and wo A x D over the attention
        width A), the MLP and the attention (4 n^2 A per item of n rows). A training step (forward
        and backward) costs about 3x this.
        """
        layers = self.num_hidden_layers if depth is None else depth
        return matmul_flops(
            seqlens,
            self.hidden_size,
            self.intermediate_size,
            layers,
            self.patch_size,
            self.attention_width,
            self.num_channels,
        )

    def position_taps(self, positions: ArrayT, heights: ArrayT, widths: ArrayT) -> tuple[ArrayT, ArrayT]:
        """Taps and weights into this tower's flattened position table for patches at ``positions``
        (L, 2) of grids ``heights`` x ``widths`` (L,), by its own resampling (bicubic or bilinear);
        see :func:`~moonvit.model.position.resample_taps`."""
        return resample_taps(
            positions,
            heights,
            widths,
            self.init_pos_emb_height,
            self.init_pos_emb_width,
            self.pos_emb_interpolation_mode,
        )

    def save(self, folder: str | Path) -> None:
        """Write ``config.json`` into ``folder`` (atomically)."""
        write_text_atomic(Path(folder) / "config.json", json.dumps(self.to_dict(), indent=2) + "\n")


NORM_TYPES = ("layernorm", "rmsnorm")
INTERPOLATION_MODES = ("bicubic", "bilinear")
SWITCHES = (
    "qkv_hidden_size",
    "norm_type",
    "layer_norm_eps",
    "attn_bias",
    "linear_bias",
    "patch_embed_proj_bias",
    "pos_emb_interpolation_mode",
)
"""The fields that set a tower's architecture apart from Kimi-VL / K2.5's (see :meth:`MoonViTConfig.switches`)."""


def matmul_flops(
    seqlens: Sequence[int],
    hidden: int,
    mlp: int,
    depth: int,
    patch: int = 14,
    attention: int | None = None,
    channels: int = 3,
) -> float:
    """Matmul FLOPs of one forward of a tower of these sizes over items of ``seqlens`` rows each
    (:meth:`MoonViTConfig.flops`; ``attention``: the attention's inner width, default ``hidden``)."""
    attn = hidden if attention is None else attention
    patches = sum(seqlens)
    per_block = 2 * patches * (4 * hidden * attn + 2 * hidden * mlp) + sum(4 * n**2 * attn for n in seqlens)
    return 2 * patches * channels * patch * patch * hidden + depth * per_block


# Kimi K3's switches (MoonViT-V2): attention wider than the stream, RMSNorm with the dtype's
# epsilon, no biases, bilinear resampling, and K2.5's 4-frame temporal table.
_V2 = dict(
    norm_type="rmsnorm",
    layer_norm_eps=None,
    attn_bias=False,
    linear_bias=False,
    patch_embed_proj_bias=False,
    pos_emb_interpolation_mode="bilinear",
    init_pos_emb_time=4,
)

PRESETS: dict[str, dict[str, Any]] = {
    # The released Kimi-VL / MoonViT-SO-400M tower.
    "so400m": {},
    # The Kimi-K2.5 / K2.6 tower (MoonViT3d): the same, with a 4-frame temporal table.
    "so400m-3d": dict(init_pos_emb_time=4),
    # CPU demos and experiments.
    "small": dict(num_hidden_layers=6, hidden_size=384, num_attention_heads=6, intermediate_size=1536),
    # Tests: a few hundred thousand parameters.
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128),
    # The same two with K2.5's 4-frame temporal table: quick video checks.
    "small-3d": dict(
        num_hidden_layers=6, hidden_size=384, num_attention_heads=6, intermediate_size=1536, init_pos_emb_time=4
    ),
    "tiny-3d": dict(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, init_pos_emb_time=4
    ),
    # Kimi K3's tower (MoonViT-V2): 27 x 1024, 12 heads over an attention width of 1536 (head_dim 128).
    "moonvit-v2": dict(
        num_hidden_layers=27,
        hidden_size=1024,
        num_attention_heads=12,
        qkv_hidden_size=1536,
        intermediate_size=4096,
        **_V2,
    ),
    # The same switches at small sizes (attention 1.5x the width, as K3): training and tests.
    "small-v2": dict(
        num_hidden_layers=6, hidden_size=384, num_attention_heads=6, qkv_hidden_size=576, intermediate_size=1536, **_V2
    ),
    "tiny-v2": dict(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, qkv_hidden_size=96, intermediate_size=128, **_V2
    ),
}


def preset_config(name: str, **overrides: Any) -> MoonViTConfig:
    """The config of a named preset (see :data:`PRESETS`: ``so400m``, ``moonvit-v2``, ``small``, ``tiny``, ...),
    with optional overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return MoonViTConfig(**{**PRESETS[name], **overrides})

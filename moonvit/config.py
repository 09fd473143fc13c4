"""Configuration of the MoonViT encoder, its presets, and reading Kimi-VL configs."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ATTN_IMPLEMENTATIONS = ("auto", "flash_attention_2", "sdpa", "eager")


class DictConfig:
    """``to_dict`` / ``from_dict`` for the config dataclasses (config.json files)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        """Build from a dict, ignoring keys that are not fields (checkpoint configs carry extras)."""
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        return cls(**{k: v for k, v in values.items() if k in names})


@dataclass
class MoonViTConfig(DictConfig):
    """Hyper-parameters of a MoonViT encoder.

    Field names follow Kimi-VL's ``vision_config`` so that a config read from a
    checkpoint maps one to one; the defaults are the released model
    (SigLIP-SO400M dimensions).
    """

    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    num_attention_heads: int = 16
    num_hidden_layers: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    merge_kernel_size: tuple[int, int] = (2, 2)
    num_channels: int = 3
    rope_theta: float = 10000.0
    max_grid_side: int = 512
    layer_norm_eps: float = 1e-5
    attn_implementation: str = "auto"
    model_type: str = field(default="moonvit", init=False)

    def __post_init__(self) -> None:
        self.merge_kernel_size = tuple(int(k) for k in self.merge_kernel_size)
        if len(self.merge_kernel_size) != 2 or min(self.merge_kernel_size) < 1:
            raise ValueError(f"merge_kernel_size must be two positive ints, got {self.merge_kernel_size}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.head_dim % 4:
            raise ValueError(f"2D RoPE needs head_dim divisible by 4, got {self.head_dim}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {self.attn_implementation!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def save(self, folder: str | Path) -> None:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")


PRESETS: dict[str, dict[str, Any]] = {
    # The released Kimi-VL / MoonViT-SO-400M tower.
    "so400m": {},
    # CPU demos and experiments.
    "small": dict(num_hidden_layers=6, hidden_size=384, num_attention_heads=6, intermediate_size=1536),
    # Tests: a few hundred thousand parameters.
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128),
}


def preset_config(name: str, **overrides: Any) -> MoonViTConfig:
    """The config of a named preset (``so400m``, ``small``, ``tiny``), with optional overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return MoonViTConfig(**{**PRESETS[name], **overrides})

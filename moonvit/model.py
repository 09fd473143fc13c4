"""The MoonViT encoder: native-resolution packed images in, patch features out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .attention import check_attn_implementation, resolve_attn_implementation
from .blocks import Block
from .config import MoonViTConfig, preset_config
from .grid import PackedGrid, build_packed_grid, clear_grid_cache
from .position import LearnablePositionTable


@dataclass
class MoonViTOutput:
    """Encoder outputs for a pack of N images with L patches.

    Attributes:
        last_hidden_state: (L, D) after the final LayerNorm, in input order.
        merged: (L / 4, 4, D) the 2x2 patch merger's groups, image after image,
            merged tokens in raster order, each group (0,0), (0,1), (1,0), (1,1).
        hidden_states: with ``output_hidden_states``, num_hidden_layers + 1 tensors
            of (L, D): the embeddings, then each block's output (before the final norm).
    """

    last_hidden_state: torch.Tensor
    merged: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None


class PatchEmbed(nn.Module):
    """Conv2d(3 -> D, kernel = stride = patch) on pre-cut patches, plus the resampled position table."""

    def __init__(self, config: MoonViTConfig) -> None:
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=p, stride=p)
        self.pos_emb = LearnablePositionTable(
            config.init_pos_emb_height, config.init_pos_emb_width, config.hidden_size
        )

    def forward(self, pixel_values: torch.Tensor, grid: PackedGrid) -> torch.Tensor:
        """(L, 3, p, p) -> (L, D)."""
        # A patch-sized conv is one matmul over the flattened patch; F.linear runs
        # it as such, where conv kernels are much slower for 1x1 outputs.
        weight = self.proj.weight.flatten(1)
        x = F.linear(pixel_values.flatten(1), weight, self.proj.bias)
        pos = self.pos_emb(grid.pos_emb_index, grid.pos_emb_weight, grid.pos_emb_sizes)
        return x + (pos if grid.pos_emb_row is None else pos.index_select(0, grid.pos_emb_row))


class Encoder(nn.Module):
    """The stack of blocks and the final LayerNorm."""

    def __init__(self, config: MoonViTConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(config.hidden_size, config.num_attention_heads, config.intermediate_size, config.layer_norm_eps)
            for _ in range(config.num_hidden_layers)
        )
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.gradient_checkpointing = False

    def forward(
        self, x: torch.Tensor, grid: PackedGrid, attn_implementation: str, output_hidden_states: bool = False
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        hidden_states = [x] if output_hidden_states else None
        for block in self.blocks:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, grid, attn_implementation, use_reentrant=False)
            else:
                x = block(x, grid, attn_implementation)
            if hidden_states is not None:
                hidden_states.append(x)
        return self.final_layernorm(x), None if hidden_states is None else tuple(hidden_states)


class MoonViT(nn.Module):
    """Kimi-VL's MoonViT vision tower.

    Call it as ``encoder(pixel_values, grid_hws)`` with every image of a pack cut
    into patches in raster order and concatenated; attention stays within each
    image and nothing is padded.
    """

    def __init__(self, config: MoonViTConfig) -> None:
        super().__init__()
        check_attn_implementation(config.attn_implementation)
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.encoder = Encoder(config)
        self.apply(_init_weights)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides) -> "MoonViT":
        """A randomly initialised encoder of a named size: ``so400m``, ``small`` or ``tiny``."""
        return cls(preset_config(name, **overrides))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        attn_implementation: str = "auto",
    ) -> "MoonViT":
        """Load from a local folder: a Kimi-VL checkpoint or this project's format.

        Only the vision tower's tensors are read; ``dtype`` defaults to the
        checkpoint's. The model is returned in eval mode.
        """
        from .checkpoint import load_pretrained

        return load_pretrained(cls, path, dtype=dtype, device=device, attn_implementation=attn_implementation)

    def save_pretrained(self, path: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` to the folder ``path``."""
        from .checkpoint import save_pretrained

        save_pretrained(self, path)

    # ---- properties -------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    def set_attn_implementation(self, attn_implementation: str) -> None:
        """Switch the attention backend: auto, flash_attention_2, sdpa or eager."""
        check_attn_implementation(attn_implementation)
        self.config.attn_implementation = attn_implementation

    def gradient_checkpointing_enable(self) -> None:
        self.encoder.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.encoder.gradient_checkpointing = False

    def set_position_cache(self, max_patches: int = 32768) -> None:
        """Cache each grid size's resampled position table, up to ``max_patches`` rows (0: off, the default).

        For inference with fixed weights, e.g. a camera of fixed resolution: it
        saves the per-call resampling. The cache is bypassed while the table
        trains and dropped by ``load_state_dict`` and ``.to()``; after changing
        weights through ``.data`` or a fused optimizer, call :meth:`clear_caches`.
        """
        if max_patches < 0:
            raise ValueError(f"max_patches must be >= 0, got {max_patches}")
        self.patch_embed.pos_emb.clear_cache()
        self.patch_embed.pos_emb.cache_patches = max_patches

    def clear_caches(self) -> None:
        """Forget cached pack metadata and resampled position tables (they rebuild on demand)."""
        clear_grid_cache()
        self.patch_embed.pos_emb.clear_cache()

    # ---- forward ------------------------------------------------------------------
    def prepare_grid(self, grid_hws: torch.Tensor | Sequence[Sequence[int]]) -> PackedGrid:
        """Validate ``grid_hws`` (N, 2) and compute the pack's metadata on the model's device.

        Pass the result as ``grid=`` to skip that work (and its host sync) in forward.
        """
        return build_packed_grid(grid_hws, self.config, self.device)

    def forward(
        self,
        pixel_values: torch.Tensor,
        grid_hws: torch.Tensor | Sequence[Sequence[int]] | None = None,
        *,
        grid: PackedGrid | None = None,
        output_hidden_states: bool = False,
    ) -> MoonViTOutput:
        """Encode a pack of images.

        Args:
            pixel_values: (L, 3, patch, patch) floating, each image's patches in
                raster order, images concatenated; cast to the model's dtype.
            grid_hws: (N, 2) integer patch rows and columns of each image.
            grid: precomputed :meth:`prepare_grid` output, instead of grid_hws.
            output_hidden_states: also return every block's (L, D) output.
        """
        if grid is None:
            if grid_hws is None:
                raise TypeError("forward needs grid_hws (N, 2) or a precomputed grid")
            grid = self.prepare_grid(grid_hws)
        self._check_pixel_values(pixel_values, grid)
        attn_implementation = resolve_attn_implementation(self.config.attn_implementation, self.device, self.dtype)

        x = self.patch_embed(pixel_values.to(self.dtype), grid)
        x, hidden_states = self.encoder(x, grid, attn_implementation, output_hidden_states)
        kh, kw = self.config.merge_kernel_size
        # index_select: several times faster than advanced indexing for a row gather on CPU.
        merged = x.index_select(0, grid.merge_index).unflatten(0, (-1, kh * kw))
        return MoonViTOutput(last_hidden_state=x, merged=merged, hidden_states=hidden_states)

    def _check_pixel_values(self, pixel_values: torch.Tensor, grid: PackedGrid) -> None:
        p, c = self.config.patch_size, self.config.num_channels
        if not isinstance(pixel_values, torch.Tensor):
            raise TypeError(f"pixel_values must be a tensor, got {type(pixel_values).__name__}")
        if not pixel_values.dtype.is_floating_point:
            raise TypeError(
                f"pixel_values must be floating (normalised pixels), got {pixel_values.dtype}; "
                "run the images through MoonViTImageProcessor"
            )
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (c, p, p):
            raise ValueError(f"pixel_values must have shape (L, {c}, {p}, {p}), got {tuple(pixel_values.shape)}")
        if pixel_values.shape[0] != grid.num_patches:
            raise ValueError(
                f"pixel_values holds {pixel_values.shape[0]} patches but the grids add up to "
                f"sum(h * w) = {grid.num_patches}"
            )
        if pixel_values.device != self.device:
            raise ValueError(f"pixel_values is on {pixel_values.device}, the model on {self.device}")


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        nn.init.trunc_normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)

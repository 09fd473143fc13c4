"""What every packed tower class shares: its config and pack cache, the grid and pixel checks, the own save.

:class:`~moonvit.model.encoder.MoonViT`, the classic ViT (:class:`~moonvit.families.vit.ClassicViT`) and
OpenVLA's fused backbone (:class:`~moonvit.families.openvla.FusedBackbone`) differ in their blocks and
outputs, not in how a pack's grid is built and cached, how ``pixel_values`` is checked against it, how
the attention backend is switched or how the tower writes its own folder: those live here once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .attention import check_attn_implementation
from .grid import GridCache, GridInput, PackedGrid, build_packed_grid, check_pixel_shape


class PackedTower(nn.Module):
    """A tower of the packed engine, built from its config (see :class:`~moonvit.model.interface.VisionEncoder`).

    A subclass builds its modules after ``super().__init__(config)`` and answers :attr:`dtype` and
    :attr:`device` (where its weights live); it may extend :meth:`set_attn_implementation` and
    :meth:`clear_caches` for what it holds itself.
    """

    config: Any  # the subclass's config class: an EncoderConfig with attn_implementation and save()

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_attn_implementation(config.attn_implementation)
        self.config = config
        self.grid_cache = GridCache()

    @property
    def dtype(self) -> torch.dtype:
        raise NotImplementedError(f"{type(self).__name__} does not say its dtype")

    @property
    def device(self) -> torch.device:
        raise NotImplementedError(f"{type(self).__name__} does not say its device")

    def save_pretrained(self, path: str | Path) -> None:
        """Write ``config.json`` (this package's fields) and ``model.safetensors`` (the module's names)."""
        from ..weights.checkpoint import save_own

        save_own(self, path)

    def set_attn_implementation(self, attn_implementation: str) -> None:
        """Switch the attention backend: ``auto`` or a registered one (flash_attention_2, openvino, sdpa,
        flex, eager)."""
        check_attn_implementation(attn_implementation)
        self.config.attn_implementation = attn_implementation

    def clear_caches(self) -> None:
        """Forget the cached pack metadata (it rebuilds on demand)."""
        self.grid_cache.clear()

    def prepare_grid(self, grid_thws: GridInput, keep: Sequence[torch.Tensor] | None = None) -> PackedGrid:
        """Validate the pack's grids and compute its metadata on the model's device.

        Args:
            grid_thws: (N, 2) rows (h, w), or (N, 3) rows (t, h, w).
            keep: training only: per item, the sorted indices of the patches fed
                (token dropping, MAE); see :func:`~moonvit.model.grid.build_packed_grid`.

        Pass the result as ``grid=`` to skip that work (and its host sync) in
        forward. Packs without ``keep`` come from a small per-model cache: treat
        the tensors as read-only.
        """
        if keep is not None:
            return build_packed_grid(grid_thws, self.config, self.device, keep=keep)
        return self.grid_cache.get(grid_thws, self.config, self.device)

    def _pack_grid(self, grid_thws: GridInput | None, grid: PackedGrid | None) -> PackedGrid:
        """The forward's grid: ``grid`` as given, else :meth:`prepare_grid` of ``grid_thws``."""
        if grid is not None:
            return grid
        if grid_thws is None:
            raise TypeError("forward needs grid_thws (N, 3) or (N, 2), or a precomputed grid")
        return self.prepare_grid(grid_thws)

    def _check_pixel_values(self, pixel_values: torch.Tensor, grid: PackedGrid) -> None:
        """``pixel_values`` a floating (L, C, p, p) tensor of the grid's L patches, on the model's device."""
        if not isinstance(pixel_values, torch.Tensor):
            raise TypeError(f"pixel_values must be a tensor, got {type(pixel_values).__name__}")
        check_pixel_shape(
            tuple(pixel_values.shape),
            pixel_values.dtype.is_floating_point,
            pixel_values.dtype,
            self.config,
            grid.num_patches,
            grid.max_frames,
            grid.dropped,
        )
        if pixel_values.device != self.device:
            raise ValueError(f"pixel_values is on {pixel_values.device}, the model on {self.device}")

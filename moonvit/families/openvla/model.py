"""OpenVLA's fused DINOv2 + SigLIP backbone as a packed tower, with its projector.

Prismatic (openvla/openvla's ``prismatic/extern/hf/modeling_prismatic.py``) runs two timm ViTs on the
same image, each normalised its own way, and reads each at its second-to-last block: timm's
``get_intermediate_layers(n={depth - 2})``, the output of block ``depth - 2`` (counting from 0), before
the final norm, the prefix tokens (DINOv2's CLS and 4 registers) dropped. The two (N, 256, D) features are
concatenated on channels (1024 + 1152 = 2176) and projected by a three-linear GELU MLP to the language
model's width, one token per patch.

Here both towers are :class:`~moonvit.families.vit.ClassicViT` s on one pack: the same grid, each its own
3 of the 6 input channels, each built with the blocks it runs (its last block is never read, SigLIP's MAP
head never used; neither is built).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn

from ...model.encoder import MoonViTOutput
from ...model.grid import GridInput, PackedGrid, validate_grid_thws
from ...model.linear import linear
from ...model.tower import PackedTower
from ..vit.model import ClassicViT
from .config import TOWERS, FusedBackboneConfig


class FusedProjector(nn.Module):
    """Prismatic's fused GELU MLP: ``fc3(gelu(fc2(gelu(fc1(x)))))``, fc1 D -> 4D, fc2 4D -> T, fc3 T -> T,
    exact (erf) GELU (OpenVLA's: 2176 -> 8704 -> 4096 -> 4096)."""

    def __init__(self, vision_dim: int, text_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vision_dim, 4 * vision_dim)
        self.fc2 = nn.Linear(4 * vision_dim, text_dim)
        self.fc3 = nn.Linear(text_dim, text_dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., T), in the projector's dtype."""
        rows = features.reshape(-1, features.shape[-1]).to(self.fc1.weight.dtype)
        x = linear(self.fc2, linear(self.fc1, rows, gelu="none"), gelu="none")
        return linear(self.fc3, x).reshape(*features.shape[:-1], -1)


class FusedBackbone(PackedTower):
    """OpenVLA's (Prismatic's ``dinosiglip``) fused vision backbone, by its :class:`FusedBackboneConfig`.

    Call it as every tower: ``encoder(pixel_values, grid_thws)``, pixel_values (L, 6, p, p) being each
    image's patches in raster order, images concatenated, each patch's 6 channels the DINOv2-normalised
    RGB then the SigLIP-normalised RGB (as OpenVLA's processor stacks them). Any grid runs, each tower's
    table resampled by timm's rule; 16 x 16 is the checkpoint's own (224 px).

    Outputs (:class:`~moonvit.model.encoder.MoonViTOutput`): ``last_hidden_state`` (L, 2176) the two
    towers' features side by side, aligned with ``pixel_values`` (:attr:`slices` says which columns are
    which tower's: DINOv2's [0, 1024), SigLIP's [1024, 2176)); ``merged`` (L, 1, 2176) the same rows
    (each patch one LLM token). :meth:`project` maps features to the language model's tokens.

    Submodules, named as OpenVLA's checkpoints name them: ``featurizer`` (DINOv2), ``fused_featurizer``
    (SigLIP), ``projector``.
    """

    config: FusedBackboneConfig

    def __init__(self, config: FusedBackboneConfig) -> None:
        super().__init__(config)
        self.featurizer = ClassicViT(config.feature_tower("featurizer"))
        self.fused_featurizer = ClassicViT(config.feature_tower("fused_featurizer"))
        text = config.text_hidden_size
        self.projector = None if text is None else FusedProjector(config.hidden_size, text)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        attn_implementation: str = "auto",
    ) -> FusedBackbone:
        """Load an OpenVLA / Prismatic or own fused-backbone folder (the one loader's): only the vision
        backbone's and the projector's tensors are read."""
        from ...weights.checkpoint import load_tower

        return load_tower(cls, path, "OpenVLA's fused backbone", dtype, device, attn_implementation)

    # ---- properties ---------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.featurizer.dtype

    @property
    def device(self) -> torch.device:
        return self.featurizer.device

    @property
    def slices(self) -> dict[str, slice]:
        """The feature columns of each tower: ``featurizer`` (DINOv2), then ``fused_featurizer`` (SigLIP)."""
        return self.config.slices

    def towers(self) -> tuple[ClassicViT, ClassicViT]:
        """(DINOv2, SigLIP): the towers as they run, each to the block its features are read at."""
        return self.featurizer, self.fused_featurizer

    def set_attn_implementation(self, attn_implementation: str) -> None:
        super().set_attn_implementation(attn_implementation)
        for tower in self.towers():
            tower.set_attn_implementation(attn_implementation)

    def gradient_checkpointing_enable(self) -> None:
        for tower in self.towers():
            tower.gradient_checkpointing_enable()

    def gradient_checkpointing_disable(self) -> None:
        for tower in self.towers():
            tower.gradient_checkpointing_disable()

    def clear_caches(self) -> None:
        """Forget the cached pack metadata and resampled tables (they rebuild on demand)."""
        super().clear_caches()
        for tower in self.towers():
            tower.clear_caches()

    def flops(self, grid_thws: GridInput) -> float:
        """Matmul FLOPs of the towers on a pack (the projector aside)."""
        return self.config.flops([t * h * w for t, h, w in validate_grid_thws(grid_thws, self.config)])

    # ---- forward ------------------------------------------------------------------------
    def forward(
        self,
        pixel_values: torch.Tensor,
        grid_thws: GridInput | None = None,
        *,
        grid: PackedGrid | None = None,
        output_hidden_states: bool = False,
        hidden_state_indices: Sequence[int] | None = None,
    ) -> MoonViTOutput:
        """Encode a pack of images.

        Args:
            pixel_values: (L, 6, p, p) floating: per patch the DINOv2-normalised RGB, then the
                SigLIP-normalised RGB; each image's patches in raster order, images concatenated.
            grid_thws: (N, 2) rows (h, w) or (N, 3) rows (1, h, w).
            grid: precomputed :meth:`prepare_grid` output, instead of ``grid_thws``.
            output_hidden_states / hidden_state_indices: not given by the fused backbone (each tower's
                hidden states are its own: ``encoder.featurizer(pixels[:, :3], grid=...)``).
        """
        if output_hidden_states or hidden_state_indices is not None:
            raise ValueError(
                "the fused backbone gives the towers' second-to-last-block features only; for a tower's "
                "hidden states call it alone (encoder.featurizer / encoder.fused_featurizer, its 3 channels)"
            )
        grid = self._pack_grid(grid_thws, grid)
        if not isinstance(pixel_values, torch.Tensor):
            raise TypeError(f"pixel_values must be a tensor, got {type(pixel_values).__name__}")
        channels = self.config.num_channels
        if pixel_values.ndim == 4 and pixel_values.shape[1] != channels:
            raise ValueError(
                f"the fused backbone takes {channels} channels per patch (the DINOv2-normalised RGB, then the "
                f"SigLIP-normalised RGB), got pixel_values of shape {tuple(pixel_values.shape)}"
            )
        self._check_pixel_values(pixel_values, grid)
        features = []
        start = 0
        for name, tower in zip(TOWERS, self.towers()):
            width = tower.config.num_channels
            out = tower(pixel_values[:, start : start + width], grid=grid, hidden_state_indices=[-1])
            assert out.hidden_states is not None, name
            features.append(out.hidden_states[0])  # its last block run: the checkpoint's second-to-last
            start += width
        fused = torch.cat(features, dim=-1)
        return MoonViTOutput(last_hidden_state=fused, merged=None if grid.dropped else fused.unsqueeze(1))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The language model's tokens of ``features`` (..., 2176) (``out.last_hidden_state``, or
        ``out.merged``): (..., text_hidden_size), in the projector's dtype.

        Raises:
            ValueError: no projector (``text_hidden_size`` None), or features of another width.
        """
        if self.projector is None:
            raise ValueError("this fused backbone has no projector (its config's text_hidden_size is None)")
        if not isinstance(features, torch.Tensor) or not features.dtype.is_floating_point:
            raise TypeError(f"project takes floating features, got {getattr(features, 'dtype', type(features))}")
        if features.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"project takes the backbone's features (..., {self.config.hidden_size}), got {tuple(features.shape)}"
            )
        if features.device != self.device:
            raise ValueError(f"features are on {features.device}, the projector on {self.device}")
        return self.projector(features)

"""The MoonViT encoder: native-resolution packed images in, patch features out."""

from __future__ import annotations

import operator
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .attention import (
    attention_for_call,
    bind_attention,
    query_scale,
    resolve_attn_implementation,
)
from .blocks import Block, make_norm
from .config import MoonViTConfig, preset_config
from .grid import GridInput, PackedGrid, validate_grid_thws
from .position import LearnablePositionTable
from .rope import scale_query
from .tower import PackedTower

if TYPE_CHECKING:
    from .projector import MoonViTProjector


@dataclass
class MoonViTOutput:
    """Encoder outputs for a pack of N items with L packed rows.

    Attributes:
        last_hidden_state: (L, D) after the final LayerNorm, in input order.
        merged: (S / 4, 4, D) the 2x2 patch merger's groups (S = sum of h * w),
            item after item, merged tokens in raster order, each group (0,0),
            (0,1), (1,0), (1,1); a clip's frames are averaged first. None when
            patches were dropped (a training grid with ``keep``).
        hidden_states: with ``output_hidden_states``, num_hidden_layers + 1 tensors
            of (L, D): the embeddings, then each block's output (before the final
            norm); with ``hidden_state_indices``, only those entries, in the order asked.
            (:func:`moonvit.model.features.intermediates` reads them, normed or not.)

    Towers with prefix tokens (the classic ViT, DeiT) also fill, with N the pack's items:

    Attributes:
        prefix_tokens: (N, n_prefix, D) each item's prefix rows after the final norm, CLS first
            (then DeiT's distillation token).
        pooled: (N, D) one vector per item: the CLS row after the final norm (a GAP tower: the
            mean of its patch rows).
        logits: (N, classes) where the checkpoint has a head (DeiT with teacher: the mean of its
            two heads).
        head_logits: (N, 2, classes) DeiT's CLS and distillation heads, apart (training).
        pooler_output: (N, D) transformers' ViTModel pooler, where the folder has one.
        hidden_prefix_tokens: with hidden states asked, each kept hidden state's (N, n_prefix, D)
            prefix rows (before the final norm), beside ``hidden_states``' patch rows.

    The MoonViT towers leave them None.
    """

    last_hidden_state: torch.Tensor
    merged: torch.Tensor | None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    prefix_tokens: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    head_logits: torch.Tensor | None = None
    pooler_output: torch.Tensor | None = None
    hidden_prefix_tokens: tuple[torch.Tensor, ...] | None = None


class PatchEmbed(nn.Module):
    """Conv2d(3 -> D, kernel = stride = patch) on pre-cut patches, plus the resampled position
    table and, for frame f of a clip of t > 1 frames, row f of the fixed temporal table."""

    def __init__(self, config: MoonViTConfig) -> None:
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=p, stride=p, bias=config.patch_embed_proj_bias
        )
        self.pos_emb = LearnablePositionTable(config.init_pos_emb_height, config.init_pos_emb_width, config.hidden_size)
        self.time_rows = config.init_pos_emb_time

    def forward(self, pixel_values: torch.Tensor, grid: PackedGrid) -> torch.Tensor:
        """(L, 3, p, p) -> (L, D)."""
        # A patch-sized conv is one matmul over the flattened patch; F.linear runs
        # it as such, where conv kernels are much slower for 1x1 outputs.
        weight = self.proj.weight.flatten(1)
        x = F.linear(pixel_values.flatten(1), weight, self.proj.bias)
        pos = self.pos_emb(grid.pos_emb_index, grid.pos_emb_weight, grid.pos_emb_sizes)
        if grid.pos_emb_row is not None:
            pos = pos.index_select(0, grid.pos_emb_row)
        if grid.time_index is not None:
            # Computed, never loaded, on the table's own device and dtype (so no buffer can be
            # left behind on another device or on meta); row 0 is the zero row of t = 1 items.
            table = temporal_table(self.time_rows, pos.shape[1], pos.device, pos.dtype)
            pos = pos + table.index_select(0, grid.time_index)
        return x + pos


def temporal_table(rows: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(rows + 1, dim) fixed temporal embedding with a leading zero row.

    Row f + 1 is frame f's ``[sin(f * w) | cos(f * w)]`` (halves concatenated, sin
    first) with ``w_i = 10000 ** (-i / (dim / 2))``, i < dim / 2; computed in float64
    and rounded once to ``dtype``.
    """
    half = dim // 2
    omega = 10000.0 ** (-torch.arange(half, dtype=torch.float64, device=device) / half)
    angles = torch.arange(rows, dtype=torch.float64, device=device)[:, None] * omega
    table = torch.cat([angles.sin(), angles.cos()], dim=1)
    return torch.cat([table.new_zeros(1, dim), table]).to(dtype)


class Encoder(nn.Module):
    """The stack of blocks and the final norm (LayerNorm, or RMSNorm for K3; named as Kimi names it)."""

    def __init__(self, config: MoonViTConfig) -> None:
        super().__init__()
        depth = config.num_hidden_layers
        # Stochastic depth grows linearly from 0 at the first block to the rate at the last.
        rates = [config.drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.ModuleList(Block.from_config(config, drop_path=rate) for rate in rates)
        self.final_layernorm = make_norm(config.hidden_size, config.norm_type, config.layer_norm_eps)
        self.head_dim = config.head_dim
        self.gradient_checkpointing = False

    def forward(
        self,
        x: torch.Tensor,
        grid: PackedGrid,
        attn_implementation: str,
        keep_hidden: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run the blocks; returns the normed output and the hidden states whose indices
        (0 = embeddings, i = block i's output) are in ``keep_hidden``."""
        hidden = {0: x} if 0 in keep_hidden else {}
        # An inference-only backend (OpenVINO's) steps aside for sdpa in a forward autograd records.
        attn_implementation = attention_for_call(attn_implementation, x, *self.parameters())
        # A backend that would round q * scale to bf16 itself (OpenVINO) gets q scaled in its rotation.
        scale = query_scale(attn_implementation, grid, self.head_dim)
        attend = bind_attention(attn_implementation, grid, prescaled=scale is not None)
        rotation = grid.rope_rotation if scale is None else scale_query(grid.rope_rotation, scale)
        for i, block in enumerate(self.blocks, start=1):
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, rotation, attend, grid, use_reentrant=False)
            else:
                x = block(x, rotation, attend, grid)
            if i in keep_hidden:
                hidden[i] = x
        return self.final_layernorm(x), hidden


class MoonViT(PackedTower):
    """The MoonViT vision tower of Kimi-VL, Kimi-K2.5 / K2.6 (clips) and Kimi K3 (MoonViT-V2), by its config.

    Call it as ``encoder(pixel_values, grid_thws)`` with every image of a pack cut
    into patches in raster order and concatenated; attention stays within each
    image and nothing is padded.
    """

    config: MoonViTConfig

    def __init__(self, config: MoonViTConfig) -> None:
        super().__init__(config)
        self.patch_embed = PatchEmbed(config)
        self.encoder = Encoder(config)
        self.apply(_init_weights)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> MoonViT:
        """A randomly initialised encoder of a named preset (``so400m``, ``so400m-3d``, ``moonvit-v2``, ``small``,
        ``tiny``, ...; see :data:`~moonvit.model.config.PRESETS`)."""
        return cls(preset_config(name, **overrides))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        attn_implementation: str = "auto",
    ) -> MoonViT:
        """Load from a local folder or hub id: any family's checkpoint (Kimi-VL, Kimi-K2.5 / K2.6, Kimi K3,
        LocateAnything-3B, this project's format, and the registered families of :mod:`moonvit.families`).

        A registered family's folder (transformers' or timm's ViT / DeiT) gives that family's tower
        (:class:`~moonvit.families.vit.ClassicViT`), which takes the same calls and returns the same
        output contract (:class:`~moonvit.model.interface.VisionEncoder`). Only the vision tower's tensors
        are read; ``dtype`` defaults to the checkpoint's. The model is returned in eval mode.
        """
        from ..weights.checkpoint import load_pretrained

        # A registered family's tower is not a MoonViT, but serves every caller as one (VisionEncoder).
        model = load_pretrained(cls, path, dtype=dtype, device=device, attn_implementation=attn_implementation)
        return cast(MoonViT, model)

    def save_pretrained(
        self, path: str | Path, *, layout: str = "own", projector: MoonViTProjector | None = None
    ) -> None:
        """Write the encoder (and ``projector``) to the folder ``path``.

        ``layout="own"``: this package's ``config.json`` and ``model.safetensors`` (and the projector's
        ``projector_config.json`` and ``projector.safetensors``). ``layout="release"``: its release's
        layout (Kimi-VL, Kimi-K2.5 / K2.6, Kimi K3, or LocateAnything-3B with an ``mlp1`` projector):
        the release's ``config.json`` and tensor names, the projector's among them, which
        :meth:`from_pretrained` and :meth:`MoonViTProjector.from_pretrained` read back exactly (see
        :mod:`moonvit.weights.release`). The processor's settings are its own ``save_pretrained``'s.
        """
        from ..weights.checkpoint import save_pretrained

        save_pretrained(self, path, layout, projector)

    # ---- properties -------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    @property
    def final_norm(self) -> nn.Module:
        """The norm after the last block (LayerNorm, or K3's RMSNorm): what ``last_hidden_state`` has
        been through and the hidden states have not."""
        return self.encoder.final_layernorm

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
        """Forget this model's cached pack metadata and resampled position tables (they rebuild on demand)."""
        super().clear_caches()
        self.patch_embed.pos_emb.clear_cache()

    # ---- what the tower answers for itself ------------------------------------------------
    def flops(self, grid_thws: GridInput) -> float:
        """Matmul FLOPs of one forward over a pack of these (N, 2) (h, w) or (N, 3) (t, h, w) grids
        (:meth:`MoonViTConfig.flops <moonvit.model.config.MoonViTConfig.flops>`)."""
        return self.config.flops([t * h * w for t, h, w in validate_grid_thws(grid_thws, self.config)])

    def position_table(self, rows: int, cols: int) -> torch.Tensor:
        """(rows, cols, D) in the table's dtype and device: the position table as the forward adds it
        to an image of a rows x cols patch grid (resampled by the tower's own mode); differentiable."""
        if rows < 1 or cols < 1:
            raise ValueError(f"position_table needs a grid of at least 1x1, got {rows}x{cols}")
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        positions = torch.stack([r.flatten(), c.flatten()], dim=1)
        count = rows * cols
        taps, weights = self.config.position_taps(positions, torch.full((count,), rows), torch.full((count,), cols))
        table = self.patch_embed.pos_emb
        return table(taps.to(self.device), weights.to(self.device)).reshape(rows, cols, -1)

    # ---- forward ------------------------------------------------------------------
    def forward(
        self,
        pixel_values: torch.Tensor,
        grid_thws: GridInput | None = None,
        *,
        grid: PackedGrid | None = None,
        output_hidden_states: bool = False,
        hidden_state_indices: Sequence[int] | None = None,
        **deprecated: Any,
    ) -> MoonViTOutput:
        """Encode a pack of images (and clips).

        Args:
            pixel_values: (L, 3, patch, patch) floating, each item's patches in
                raster order (frame after frame for a clip), items concatenated;
                cast to the model's dtype.
            grid_thws: (N, 3) integer rows (t, h, w): frames, patch rows and columns of each
                item, or (N, 2) rows (h, w) of images. The old keyword ``grid_hws=`` is still
                accepted, with a DeprecationWarning.
            grid: precomputed :meth:`prepare_grid` output, instead of grid_thws.
            output_hidden_states: also return every block's (L, D) output.
            hidden_state_indices: return only these entries of the hidden states
                (0 = embeddings, i = block i's output, negative from the end), e.g.
                ``(-4, -3, -2, -1)`` for the last four blocks; the others are not kept.
        """
        grid = self._pack_grid(_renamed_grid(grid_thws, deprecated), grid)
        self._check_pixel_values(pixel_values, grid)
        if grid.max_frames > self.config.max_frames:
            raise ValueError(
                f"the grid holds clips of {grid.max_frames} frames, over the {self.config.max_frames} "
                "this encoder takes (init_pos_emb_time)"
            )
        selected = hidden_indices(self.config.num_hidden_layers + 1, output_hidden_states, hidden_state_indices)
        attn_implementation = resolve_attn_implementation(self.config.attn_implementation, self.device, self.dtype)

        x = self.patch_embed(pixel_values.to(self.dtype), grid)
        x, hidden = self.encoder(x, grid, attn_implementation, selected)
        hidden_states = tuple(hidden[i] for i in selected) if selected else None
        return MoonViTOutput(last_hidden_state=x, merged=self.merge(x, grid), hidden_states=hidden_states)

    def merge(self, x: torch.Tensor, grid: PackedGrid) -> torch.Tensor | None:
        """The 2x2 merger: (L, D) -> (S / 4, 4, D), frames of a clip averaged first; None for dropped patches."""
        group = self.config.tokens_per_merge
        if grid.merge_index is not None:
            # index_select: several times faster than advanced indexing for a row gather on CPU.
            return x.index_select(0, grid.merge_index).unflatten(0, (-1, group))
        if grid.pool_index is None or grid.pool_weight is None:
            return None
        # Mean over a clip's frames, accumulated in float32 (float64 stays) and rounded once.
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        weighted = x.to(compute_dtype) * grid.pool_weight.to(compute_dtype).unsqueeze(1)
        pooled = x.new_zeros(grid.num_slots, x.shape[1], dtype=compute_dtype).index_add_(0, grid.pool_index, weighted)
        return pooled.to(x.dtype).unflatten(0, (-1, group))


def hidden_indices(
    count: int, output_hidden_states: bool, indices: Sequence[int] | None, what: str = "hidden_state_indices"
) -> tuple[int, ...]:
    """The hidden states a forward keeps, of ``count`` (the embeddings and each block): all with
    ``output_hidden_states``, else ``indices`` resolved (negative from the end), else none;
    ``what`` names the argument in the error of an index out of range or not an int."""
    if indices is None:
        return tuple(range(count)) if output_hidden_states else ()
    resolved = []
    for given in indices:
        if isinstance(given, bool):
            raise TypeError(f"{what}: {given!r} is not an int")
        try:
            index = operator.index(given)  # an int, NumPy's or a 0-d integer tensor
        except TypeError:
            raise TypeError(f"{what}: {given!r} is not an int") from None
        if not -count <= index < count:
            raise ValueError(
                f"{what}: {index} is out of range for {count} hidden states "
                f"(the embeddings and {count - 1} blocks: {-count} .. {count - 1})"
            )
        resolved.append(index % count)
    return tuple(resolved)


def _renamed_grid(grid_thws: GridInput | None, deprecated: dict[str, Any]) -> GridInput | None:
    """``grid_thws``, or the old keyword ``grid_hws`` (with a DeprecationWarning); nothing else."""
    old = deprecated.pop("grid_hws", None)
    if deprecated:
        raise TypeError(f"forward() got an unexpected keyword argument {next(iter(deprecated))!r}")
    if old is None:
        return grid_thws
    if grid_thws is not None:
        raise TypeError("forward() got both grid_thws and its old name grid_hws; pass grid_thws only")
    warnings.warn(
        "MoonViT.forward(grid_hws=...) is renamed grid_thws=...; the old keyword will go",
        DeprecationWarning,
        stacklevel=_caller_level(),
    )
    return old


def _caller_level() -> int:
    """The stacklevel of the first frame outside this file and torch.nn (the caller of ``model(...)``)."""
    frame: FrameType | None = sys._getframe(2)  # forward: stacklevel 2 of the warning in _renamed_grid
    level = 2
    while frame is not None and (frame.f_code.co_filename == __file__ or _TORCH_NN in frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


_TORCH_NN = str(Path(nn.__file__).parent)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.RMSNorm):
        nn.init.ones_(module.weight)

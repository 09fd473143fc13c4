"""The classic ViT and DeiT as a packed tower: prefix tokens, a learned 1D table, pre-LN blocks.

Each item of a pack is its prefix tokens (CLS, then DeiT's distillation token) followed by its
patches in raster order; attention stays within the item and nothing is padded. The table's patch
rows are resampled to each item's grid by the checkpoint's own rule
(:data:`~moonvit.families.vit.config.POS_EMB_RULES`), once per grid size.

Module names are timm's (``cls_token``, ``pos_embed``, ``patch_embed.proj``, ``blocks.N.attn.qkv``,
``norm``, ``head``), so that timm's folders need no renaming.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ...model.attention import BoundAttention, attention_for_call, bind_attention, resolve_attn_implementation
from ...model.blocks import drop_path_per_item
from ...model.chunking import map_row_chunks
from ...model.encoder import MoonViTOutput, hidden_indices
from ...model.grid import GridInput, PackedGrid, PrefixedPack, prefixed_pack, validate_grid_thws
from ...model.linear import computes_in_float32, linear
from ...model.position import table_cache_key
from ...model.tower import PackedTower
from .config import ClassicViTConfig

MLP_CHUNK_BYTES = 16 * 2**20
_CACHED_SIZES = 64  # resampled tables kept per tower (a few MB each at ViT-B)


def resample_table(table: torch.Tensor, rows: int, cols: int, rule: str) -> torch.Tensor:
    """The (G, G, D) patch part of a 1D table resampled to a ``rows`` x ``cols`` grid: (rows * cols, D),
    in the table's dtype, by ``rule`` (see :data:`~moonvit.families.vit.config.POS_EMB_RULES`)."""
    side, dim = table.shape[0], table.shape[-1]
    if (rows, cols) == (table.shape[0], table.shape[1]) and side == table.shape[1] and rule != "naflex":
        return table.reshape(rows * cols, dim)
    # (1, D, G, G) in channels-last memory, as timm's and transformers' reshape + permute hand it over:
    # torch's antialiased CPU kernel (2.13) gives other, wrong, values for a one-column grid (3x1, 6x1)
    # from an NCHW-contiguous input; the channels-last path gives PIL's (and timm's) values.
    grid = table.unsqueeze(0).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
    wide = torch.promote_types(grid.dtype, torch.float32)  # float32, or float64 kept
    if rule == "transformers":
        out = F.interpolate(grid, size=(rows, cols), mode="bicubic", align_corners=False)
    elif rule == "transformers-f32":
        out = F.interpolate(grid.float(), size=(rows, cols), mode="bicubic", align_corners=False)
    elif rule == "timm":
        out = F.interpolate(grid.to(wide), size=(rows, cols), mode="bicubic", antialias=True, align_corners=False)
    elif rule == "jax":
        out = F.interpolate(grid.to(wide), size=(rows, cols), mode="bilinear", align_corners=True)
    elif rule == "naflex":
        out = F.interpolate(grid.float(), size=(rows, cols), mode="bilinear", antialias=True, align_corners=False)
    else:
        raise ValueError(f"unknown table rule {rule!r}")
    return out.to(table.dtype).squeeze(0).permute(1, 2, 0).reshape(rows * cols, dim)


class PatchEmbed(nn.Module):
    """Conv2d(C -> D, kernel = stride = patch) on pre-cut (L, C, p, p) patches, run as one matmul."""

    def __init__(self, config: ClassicViTConfig) -> None:
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=p, stride=p)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(L, C, p, p) -> (L, D)."""
        return F.linear(pixel_values.flatten(1), self.proj.weight.flatten(1), self.proj.bias)


class Attention(nn.Module):
    """Multi-head self-attention within each item: qkv (D -> 3D, [q | k | v]), no rotary embedding, proj."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attend: BoundAttention, residual: torch.Tensor | None = None) -> torch.Tensor:
        """(T, D) -> (T, D) (+ ``residual``)."""
        qkv = linear(self.qkv, x).unflatten(-1, (3, self.num_heads, -1))
        return linear(self.proj, attend(qkv[:, 0], qkv[:, 1], qkv[:, 2]).flatten(1), residual=residual)


class Mlp(nn.Module):
    """fc2(act(fc1(x))) (+ a residual), over row chunks: the GELU (exact or tanh) MLP, or SwiGLU
    (``fc1`` gives [gate | up], ``fc2(silu(gate) * up)``; DINOv2 giant's)."""

    def __init__(self, dim: int, hidden_dim: int, act: str = "gelu", kind: str = "mlp") -> None:
        super().__init__()
        self.kind = kind
        self.approximate = "tanh" if act == "gelu_tanh" else "none"
        self.fc1 = nn.Linear(dim, hidden_dim * (2 if kind == "swiglu" else 1))
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        row_bytes = self.fc1.out_features * (4 if computes_in_float32(x) else x.element_size())
        if residual is None:
            return map_row_chunks(self._mlp, x, row_bytes=row_bytes, budget=MLP_CHUNK_BYTES)
        return map_row_chunks(self._mlp, x, residual, row_bytes=row_bytes, budget=MLP_CHUNK_BYTES)

    def _mlp(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.kind == "swiglu":
            gate, up = linear(self.fc1, x).chunk(2, dim=-1)
            return linear(self.fc2, F.silu(gate) * up, residual=residual)
        return linear(self.fc2, linear(self.fc1, x, gelu=self.approximate), residual=residual)


class LayerScale(nn.Module):
    """x * gamma, a learned per-channel scale on a residual branch (DINOv2's; timm's ``ls1.gamma``)."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma.to(x.dtype)


class ViTBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)) (pre-LN; each branch LayerScaled where the config
    says), on the pack's (T, D) token rows."""

    def __init__(self, config: ClassicViTConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.layer_norm_eps
        self.drop_path = drop_path
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, config.num_attention_heads, config.qkv_bias)
        self.ls1 = LayerScale(dim, config.layer_scale_init) if config.layer_scale else None
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, config.intermediate_size, config.hidden_act, config.mlp_type)
        self.ls2 = LayerScale(dim, config.layer_scale_init) if config.layer_scale else None

    def forward(self, x: torch.Tensor, attend: BoundAttention, tokens: PackedGrid | None = None) -> torch.Tensor:
        """(T, D) token rows; ``tokens``: the token sequence's grid, for per-item stochastic depth in training."""
        if self.ls1 is not None and self.ls2 is not None:
            x = x + self._dropped(self.ls1(self.attn(self.norm1(x), attend)), tokens)
            return x + self._dropped(self.ls2(self.mlp(self.norm2(x))), tokens)
        if self.training and self.drop_path > 0:
            x = x + self._dropped(self.attn(self.norm1(x), attend), tokens)
            return x + self._dropped(self.mlp(self.norm2(x)), tokens)
        x = self.attn(self.norm1(x), attend, residual=x)
        return self.mlp(self.norm2(x), residual=x)

    def _dropped(self, branch: torch.Tensor, tokens: PackedGrid | None) -> torch.Tensor:
        """A residual branch with stochastic depth (per item, in training)."""
        if not (self.training and self.drop_path > 0):
            return branch
        if tokens is None:
            raise ValueError("stochastic depth draws per image: pass the token grid")
        return drop_path_per_item(branch, tokens, self.drop_path)


class AttentionPool(nn.Module):
    """The MAP head (SigLIP's; timm's ``AttentionPoolLatent``, one latent query): per item, a learned
    query attends over the item's (patch) rows, then ``x + mlp(norm(x))``.

    ``qkv`` holds the query's rows and the keys' and values' ([q | k | v], (3D, D)): transformers'
    ``SiglipMultiheadAttentionPoolingHead`` stores them so (``attention.in_proj``; its ``probe`` is
    ``latent``, its ``out_proj`` is ``proj``), timm as ``q`` and ``kv``.
    """

    def __init__(self, config: ClassicViTConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.mlp = Mlp(dim, config.intermediate_size, config.hidden_act)

    def forward(self, rows: torch.Tensor, item_index: torch.Tensor, items: int) -> torch.Tensor:
        """(L, D) rows of ``items`` items, ``item_index`` (L,) int64 each row's item -> (N, D).

        The query is the same for every item, so each head's scores are one dot product per row and
        the softmax runs per item over its own rows (no padding, no mask), accumulated in float32 or wider.
        """
        heads, dim = self.num_heads, rows.shape[-1]
        weight, bias = self.qkv.weight.to(rows.dtype), self.qkv.bias.to(rows.dtype)
        query = F.linear(self.latent.reshape(1, dim).to(rows.dtype), weight[:dim], bias[:dim]).view(heads, -1)
        key, value = F.linear(rows, weight[dim:], bias[dim:]).view(-1, 2, heads, dim // heads).unbind(1)
        wide = torch.promote_types(rows.dtype, torch.float32)
        scores = (key.to(wide) * query.to(wide)).sum(-1) * (dim // heads) ** -0.5  # (L, H)
        index = item_index.unsqueeze(1).expand_as(scores)
        peak = scores.new_full((items, heads), -torch.inf).scatter_reduce(0, index, scores, "amax")
        weights = (scores - peak.index_select(0, item_index)).exp()
        total = weights.new_zeros(items, heads).index_add_(0, item_index, weights)
        weighted = value.to(wide) * weights.unsqueeze(-1)
        pooled = weighted.new_zeros(items, heads, dim // heads).index_add_(0, item_index, weighted)
        x = self.proj((pooled / total.unsqueeze(-1)).flatten(1).to(rows.dtype))
        return x + self.mlp(self.norm(x))


class Pooler(nn.Module):
    """transformers' ViTModel pooler: tanh(dense(CLS row))."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dense = nn.Linear(dim, dim)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls))


class ClassicViT(PackedTower):
    """The classic ViT (and DeiT) tower of the packed engine, by its :class:`ClassicViTConfig`.

    Call it as every tower: ``encoder(pixel_values, grid_thws)``, pixel_values (L, C, p, p) being each
    image's patches in raster order, images concatenated. Outputs (:class:`MoonViTOutput`):
    ``last_hidden_state`` (L, D) the patch rows after the final norm, aligned with ``pixel_values``;
    ``merged`` (L, 1, D) the same rows (no merger: each patch one token); ``prefix_tokens``
    (N, n_prefix, D), CLS first; ``pooled`` (N, D) (the CLS row, or the mean of the patch rows for a
    GAP tower); ``logits`` (N, classes) where there is a head (DeiT with teacher: the mean of its two
    heads, each in ``head_logits`` (N, 2, classes)).
    """

    config: ClassicViTConfig

    def __init__(self, config: ClassicViTConfig) -> None:
        super().__init__(config)
        dim, side = config.hidden_size, config.grid_side
        self.patch_embed = PatchEmbed(config)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if config.class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, dim)) if config.distillation_token else None
        registers = config.num_register_tokens
        self.reg_token = nn.Parameter(torch.zeros(1, registers, dim)) if registers else None
        self.pos_embed = nn.Parameter(torch.zeros(1, config.num_table_prefix_rows + side * side, dim))
        depth = config.num_hidden_layers
        rates = [config.drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.ModuleList(ViTBlock(config, rate) for rate in rates)
        self.norm = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.attn_pool = AttentionPool(config) if config.pool == "map" else None
        self.pooler = Pooler(dim) if config.pooler else None
        self.head = nn.Linear(dim, config.num_classes) if config.num_classes else None
        self.head_dist = nn.Linear(dim, config.num_classes) if config.distilled_head else None
        self.gradient_checkpointing = False
        self._tables: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self._tables_key: tuple | None = None
        self._lock = threading.Lock()
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, LayerScale):
                nn.init.constant_(module.gamma, self.config.layer_scale_init)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.dist_token, self.reg_token):
            if token is not None:
                nn.init.trunc_normal_(token, std=0.02)
        if self.attn_pool is not None:
            nn.init.trunc_normal_(self.attn_pool.latent, std=self.config.hidden_size**-0.5)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ClassicViT:
        """A randomly initialised tower of a named preset (:data:`~moonvit.families.vit.config.PRESETS`)."""
        from .config import classic_vit_config

        return cls(classic_vit_config(name, **overrides))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        attn_implementation: str = "auto",
    ) -> ClassicViT:
        """Load a transformers, timm or own classic-ViT / DeiT folder (the one loader's)."""
        from ...weights.checkpoint import load_tower

        return load_tower(cls, path, "a classic ViT", dtype, device, attn_implementation)

    # ---- properties ---------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    @property
    def final_norm(self) -> nn.Module:
        """The norm after the last block (timm's ``norm``): what ``last_hidden_state``, ``prefix_tokens``
        and ``pooled`` have been through and the hidden states have not."""
        return self.norm

    def gradient_checkpointing_enable(self) -> None:
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = False

    def clear_caches(self) -> None:
        """Forget the cached pack metadata and resampled tables (they rebuild on demand)."""
        super().clear_caches()
        with self._lock:
            self._tables.clear()
            self._tables_key = None

    def flops(self, grid_thws: GridInput) -> float:
        return self.config.flops([t * h * w for t, h, w in validate_grid_thws(grid_thws, self.config)])

    # ---- the table ----------------------------------------------------------------------
    def position_table(self, rows: int, cols: int) -> torch.Tensor:
        """(rows, cols, D): the table's patch part as the forward adds it to a rows x cols grid."""
        if rows < 1 or cols < 1:
            raise ValueError(f"position_table needs a grid of at least 1x1, got {rows}x{cols}")
        return self._patch_table(rows, cols).reshape(rows, cols, -1)

    def resize_position_table(self, image_size: int) -> None:
        """Resample the table once to ``image_size`` px (by the tower's rule) and make that its native grid:
        the seed's higher-resolution fine-tune (224 -> 384), saved so that it loads back at the new size."""
        if image_size % self.config.patch_size:
            raise ValueError(f"image_size {image_size} is not a multiple of the patch size {self.config.patch_size}")
        side = image_size // self.config.patch_size
        prefix = self.pos_embed[:, : self.config.num_table_prefix_rows]
        with torch.no_grad():
            patches = self._patch_table(side, side).unsqueeze(0)
            self.pos_embed = nn.Parameter(torch.cat([prefix, patches], dim=1).detach().clone())
        self.config.image_size, self.config.input_size = image_size, None  # the new table covers its size
        self.clear_caches()

    def _patch_table(self, rows: int, cols: int) -> torch.Tensor:
        side = self.config.grid_side
        table = self.pos_embed[0, self.config.num_table_prefix_rows :].reshape(side, side, -1)
        return resample_table(table, rows, cols, self.config.pos_emb_rule)

    def _positions(self, grid: PackedGrid) -> torch.Tensor:
        """(L, D) the table rows of every patch of the pack: each of the pack's distinct grid sizes
        resampled once (and kept, for fixed weights, per size), each row reading its entry."""
        key = table_cache_key(self.pos_embed)
        parts = []
        for rows, cols in grid.pos_emb_sizes:
            table = None
            if key is not None:
                with self._lock:
                    if self._tables_key != key:
                        self._tables.clear()
                        self._tables_key = key
                    table = self._tables.get((rows, cols))
            if table is None:
                table = self._patch_table(rows, cols)
                if key is not None:
                    with self._lock:
                        if self._tables_key == key:
                            self._tables[(rows, cols)] = table
                            while len(self._tables) > _CACHED_SIZES:
                                self._tables.popitem(last=False)
            parts.append(table)
        positions = parts[0] if len(parts) == 1 else torch.cat(parts)
        return positions if grid.pos_emb_row is None else positions.index_select(0, grid.pos_emb_row)

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
            pixel_values: (L, C, p, p) floating, each image's patches in raster order, images concatenated.
            grid_thws: (N, 2) rows (h, w) or (N, 3) rows (1, h, w).
            grid: precomputed :meth:`prepare_grid` output, instead of ``grid_thws``.
            output_hidden_states / hidden_state_indices: the hidden states (0 = embeddings, i = block
                i's output, before the final norm): ``hidden_states`` (L, D) patch rows, as for every
                tower, and ``hidden_prefix_tokens`` (N, n_prefix, D) each item's prefix rows.
        """
        grid = self._pack_grid(grid_thws, grid)
        self._check_pixel_values(pixel_values, grid)
        selected = hidden_indices(self.config.num_hidden_layers + 1, output_hidden_states, hidden_state_indices)
        count = self.config.num_prefix_tokens
        pack = prefixed_pack(grid, count)

        x = self.patch_embed(pixel_values.to(self.dtype))
        x = x + self._positions(grid)
        tokens = self._with_prefix(x, grid.num_images, pack)

        hidden = {0: tokens} if 0 in selected else {}
        attn_implementation = resolve_attn_implementation(self.config.attn_implementation, self.device, self.dtype)
        attn_implementation = attention_for_call(attn_implementation, tokens, *self.parameters())
        attend = bind_attention(attn_implementation, pack.grid)
        for i, block in enumerate(self.blocks, start=1):
            if self.gradient_checkpointing and torch.is_grad_enabled():
                tokens = checkpoint(block, tokens, attend, pack.grid, use_reentrant=False)
            else:
                tokens = block(tokens, attend, pack.grid)
            if i in selected:
                hidden[i] = tokens  # every token row: split into patch and prefix rows in _outputs
        tokens = self.norm(tokens)
        return self._outputs(tokens, pack, grid, tuple(hidden[i] for i in selected) if selected else None)

    def _with_prefix(self, x: torch.Tensor, items: int, pack: PrefixedPack) -> torch.Tensor:
        """(L, D) patch rows -> (N * n_prefix + L, D) token rows, each item's prefix tokens first
        (CLS, the distillation token or the registers), the table's prefix rows added to those that have one."""
        if self.config.num_prefix_tokens == 0:
            return x
        return torch.cat([self.prefix_embeddings().to(x.dtype).repeat(items, 1), x]).index_select(0, pack.order)

    def prefix_embeddings(self) -> torch.Tensor:
        """(n_prefix, D) in the weights' dtype: the prefix tokens every item starts with (CLS, then the
        distillation token or the registers), each with its table row where the table has one."""
        embedded: list[torch.Tensor] = [t for t in (self.cls_token, self.dist_token) if t is not None]
        if not embedded:  # no prefix tokens (a GAP or MAP tower)
            return self.pos_embed.new_zeros(0, self.config.hidden_size)
        prefix = torch.cat(embedded, dim=1)[0]
        rows = self.config.num_table_prefix_rows
        if rows:
            prefix = prefix + self.pos_embed[0, :rows]
        if self.reg_token is not None:  # after the CLS token, with no table row (DINOv2 with registers)
            prefix = torch.cat([prefix[:1], self.reg_token[0], prefix[1:]])
        return prefix

    def _split(self, tokens: torch.Tensor, pack: PrefixedPack, items: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, D) token rows -> (L, D) the patch rows, in ``pixel_values``' order, and (N, n_prefix, D) each
        item's prefix rows."""
        count = self.config.num_prefix_tokens
        patches = tokens if count == 0 else tokens.index_select(0, pack.patch_rows)
        return patches, tokens.index_select(0, pack.prefix_rows).view(items, count, tokens.shape[-1])

    def _outputs(
        self,
        tokens: torch.Tensor,
        pack: PrefixedPack,
        grid: PackedGrid,
        hidden: tuple[torch.Tensor, ...] | None,
    ) -> MoonViTOutput:
        items = grid.num_images
        patches, prefix = self._split(tokens, pack, items)
        hidden_states = hidden_prefix = None
        if hidden is not None:
            hidden_states, hidden_prefix = (tuple(rows) for rows in zip(*(self._split(h, pack, items) for h in hidden)))
        if self.config.pool == "token":
            pooled = prefix[:, 0]
        elif self.attn_pool is not None:
            pooled = self.attn_pool(patches, grid.item_index, items)
        else:
            pooled = _item_means(patches, grid)
        head_logits = logits = None
        if self.head is not None:
            if self.head_dist is not None:
                head_logits = torch.stack([self.head(prefix[:, 0]), self.head_dist(prefix[:, 1])], dim=1)
                logits = head_logits.mean(dim=1)
            else:
                logits = self.head(pooled)
        return MoonViTOutput(
            last_hidden_state=patches,
            merged=None if grid.dropped else patches.unsqueeze(1),
            hidden_states=hidden_states,
            prefix_tokens=prefix,
            pooled=pooled,
            logits=logits,
            head_logits=head_logits,
            pooler_output=None if self.pooler is None else self.pooler(prefix[:, 0]),
            hidden_prefix_tokens=hidden_prefix,
        )


def _item_means(rows: torch.Tensor, grid: PackedGrid) -> torch.Tensor:
    """(N, D) the mean of each item's rows of ``rows`` (L, D), accumulated in float32 or wider."""
    wide = rows.to(torch.promote_types(rows.dtype, torch.float32))
    sums = wide.new_zeros(grid.num_images, rows.shape[1]).index_add_(0, grid.item_index, wide)
    counts = torch.tensor(grid.seqlens, dtype=wide.dtype, device=rows.device).unsqueeze(1)
    return (sums / counts).to(rows.dtype)

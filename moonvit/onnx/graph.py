"""The encoder's forward as the ONNX graph computes it: the model's own modules and
parameters, with the pack's layout taken as tensors (:mod:`moonvit.onnx.inputs`).

The blocks are the model's own ``Block`` modules, called as the encoder calls them; under
export they take the plain layers, the real RoPE rotation and one MLP call. Three parts
differ in form, not in arithmetic, from the eager model, so that one graph with symbolic
sizes serves every pack:

- the position table is resampled by K weighted row gathers (16 bicubic, 4 bilinear: what
  the model's ``embedding_bag`` does), each over the (U, D) rows, never a (U, K, D) copy;
- attention (the function the blocks are given) runs over the items as one batch padded to
  the longest item, with
  padded keys masked out: no pack-wide (L, L) mask, and memory of
  ``items * heads * longest**2`` scores per block;
- the 2x2 merger (and a clip's mean over its frames) is a weighted gather.

RoPE is the real-valued rotation (:func:`~moonvit.model.rope.rotate_real`), with the
frequencies torch computes for the model held as a buffer, so the graph's angles are
the model's to the bit.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model.encoder import MoonViT, temporal_table
from ..model.rope import rope_frequencies


class OnnxEncoder(nn.Module):
    """A MoonViT (and optionally its projector) whose forward takes :func:`~moonvit.onnx.onnx_inputs`.

    It holds the model's modules, not copies: export it in eval mode, with the
    dtype it should have.
    """

    rope_freqs: torch.Tensor
    time_table: torch.Tensor | None

    def __init__(self, encoder: MoonViT, projector: nn.Module | None = None) -> None:
        super().__init__()
        config = encoder.config
        self.encoder = encoder
        self.projector = projector
        self.register_buffer("rope_freqs", rope_frequencies(config.head_dim, config.rope_theta), persistent=False)
        # Computed by torch as the model computes it, and held as a constant of the graph.
        time_table = None
        if config.init_pos_emb_time:
            time_table = temporal_table(config.init_pos_emb_time, config.hidden_size, encoder.device, encoder.dtype)
        self.register_buffer("time_table", time_table, persistent=False)

    def forward(
        self,
        pixel_values: torch.Tensor,
        positions: torch.Tensor,
        pos_emb_index: torch.Tensor,
        pos_emb_weight: torch.Tensor,
        pos_emb_row: torch.Tensor,
        attention_rows: torch.Tensor,
        attention_slots: torch.Tensor,
        merge_index: torch.Tensor,
        merge_weight: torch.Tensor,
        time_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Encode one pack; shapes as in :mod:`moonvit.onnx.inputs`.

        Returns:
            last_hidden_state (L, D), merged (S / 4, 4, D) and, with a projector,
            projected (S / 4, text_hidden_size), in the model's dtype.
        """
        x = self.embed(pixel_values, pos_emb_index, pos_emb_weight, pos_emb_row, time_index)
        rotation = self.rope_rotation(positions)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return padded_attention(q, k, v, attention_rows, attention_slots)

        # The model's own blocks: under export they take the plain layers, the real RoPE rotation
        # and one MLP call (no row chunks), and this padded attention in place of the backend's.
        for block in self.encoder.encoder.blocks:
            x = block(x, rotation, attend)
        x = self.encoder.encoder.final_layernorm(x)
        merged = merge(x, merge_index, merge_weight)
        if self.projector is None:
            return x, merged
        return x, merged, self.projector(merged)

    def embed(
        self,
        pixel_values: torch.Tensor,
        pos_emb_index: torch.Tensor,
        pos_emb_weight: torch.Tensor,
        pos_emb_row: torch.Tensor,
        time_index: torch.Tensor | None,
    ) -> torch.Tensor:
        """The model's PatchEmbed: (L, 3, p, p) -> (L, D), the position table resampled in float32."""
        patch_embed = self.encoder.patch_embed
        dtype = self.encoder.dtype
        x = F.linear(pixel_values.to(dtype).flatten(1), patch_embed.proj.weight.flatten(1), patch_embed.proj.bias)
        compute_dtype = torch.promote_types(dtype, torch.float32)
        table = patch_embed.pos_emb.weight.flatten(0, 1).to(compute_dtype)
        weights = pos_emb_weight.to(compute_dtype)
        # embedding_bag's weighted sum, tap after tap in its order, over (U, D) rows.
        pos = table.index_select(0, pos_emb_index[:, 0]) * weights[:, 0:1]
        for tap in range(1, pos_emb_index.shape[1]):
            pos = pos + table.index_select(0, pos_emb_index[:, tap]) * weights[:, tap : tap + 1]
        pos = pos.to(dtype).index_select(0, pos_emb_row)
        if self.time_table is not None and time_index is not None:
            pos = pos + self.time_table.index_select(0, time_index)
        return x + pos

    def rope_rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """(L, 2) (row, col) -> (L, head_dim // 2, 2) (cos, sin), as :func:`~moonvit.model.rope.rope_rotation`."""
        rows = positions[:, 0:1].float() * self.rope_freqs
        cols = positions[:, 1:2].float() * self.rope_freqs
        angles = torch.stack([cols, rows], dim=-1).flatten(1)
        return torch.stack([angles.cos(), angles.sin()], dim=-1)


def padded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Attention within each item, the items batched and padded to the longest.

    Args:
        q, k, v: (L, heads, head_dim) packed rows.
        rows: (N, M) int64 packed rows of each item, -1 past its end.
        slots: (L,) int64 place ``i * M + j`` of each packed row in the batch.

    Returns:
        (L, heads, head_dim) in q's dtype: softmax(q k^T / sqrt(d)) v over each item's
        own keys, the softmax in float32 (as the model's eager reference).
    """
    items, longest = rows.shape
    gather = rows.clamp(min=0).flatten()

    def batch(t: torch.Tensor) -> torch.Tensor:  # (L, H, d) -> (N, H, M, d)
        return t.index_select(0, gather).unflatten(0, (items, longest)).transpose(1, 2)

    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(batch(q), batch(k).transpose(-1, -2)).to(compute_dtype) * q.shape[-1] ** -0.5
    scores = scores.masked_fill((rows < 0)[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1).to(v.dtype), batch(v))
    return out.transpose(1, 2).flatten(0, 1).index_select(0, slots)


def merge(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The 2x2 merger as a weighted gather: (L, D) -> (S / 4, 4, D), a clip's frames averaged in float32.

    Args:
        index, weight: (S / 4, 4, T) rows of each slot's frames and their weights (1 / t, or 0).
    """
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    frames = x.index_select(0, index.flatten()).unflatten(0, index.shape).to(compute_dtype)
    return (frames * weight.to(compute_dtype).unsqueeze(-1)).sum(2).to(x.dtype)

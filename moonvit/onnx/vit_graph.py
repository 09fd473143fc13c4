"""The classic ViT / DeiT forward as the ONNX graph computes it: the tower's own modules and
parameters, with the pack's layout taken as tensors (:mod:`moonvit.onnx.vit_inputs`).

The blocks (tanh or exact GELU, SwiGLU, LayerScale as the config says), the final norm, the MAP
head, the heads, the pooler and the prefix tokens (CLS, DeiT's distillation token or DINOv2's
registers, :meth:`~moonvit.families.vit.model.ClassicViT.prefix_embeddings`) are the tower's own,
called as :class:`~moonvit.families.vit.model.ClassicViT` calls them: the MAP head's per-item
softmax is its segment ops over the L patch rows (a running max and sums scattered by item:
``ScatterElements`` / ``ScatterND``, exact and linear in L), each row's item read off its padded
slot. Three parts differ in form, not in arithmetic, from the eager tower, so that one graph with
symbolic sizes serves every pack:

- the table's patch rows are resampled by one matmul, ``(U, G * G)`` weights (the outer
  product of each entry's per-axis weights, computed with NumPy from the grid sizes) times the
  ``(G * G, D)`` table, in float32; the eager tower calls ``F.interpolate`` per grid size with
  the same weights;
- the token rows are every item's prefix tokens, then all patch rows (the eager tower
  interleaves them item by item); attention gathers each item's rows, prefix first, into one
  batch padded to the item with the most tokens, padded keys masked out
  (:func:`~moonvit.onnx.graph.padded_attention`, as in MoonViT's graph);
- a GAP tower's mean over each item's patch rows is a masked sum over that padded layout.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..families.vit.config import ClassicViTConfig
from ..families.vit.model import ClassicViT
from .graph import padded_attention


class OnnxClassicViT(nn.Module):
    """A :class:`ClassicViT` whose forward takes :func:`~moonvit.onnx.vit_inputs.vit_onnx_inputs`.

    It holds the tower's modules, not copies: export it in eval mode, in the dtype it should have.
    """

    def __init__(self, tower: ClassicViT) -> None:
        super().__init__()
        self.tower = tower

    def forward(
        self,
        pixel_values: torch.Tensor,
        pos_emb_weight_h: torch.Tensor,
        pos_emb_weight_w: torch.Tensor,
        pos_emb_row: torch.Tensor,
        attention_rows: torch.Tensor,
        attention_slots: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """Encode one pack; shapes as in :mod:`moonvit.onnx.vit_inputs`.

        Returns:
            In the tower's dtype, in the order of :func:`~moonvit.onnx.vit_output_names`:
            ``last_hidden_state`` (L, D); ``prefix_tokens`` (N, n_prefix, D) where the tower has
            prefix tokens; ``pooled`` (N, D); ``logits`` (N, C) with a head; ``head_logits``
            (N, 2, C) with DeiT's two heads; ``pooler_output`` (N, D) with a pooler.
        """
        tower, config = self.tower, self.tower.config
        count = config.num_prefix_tokens
        items, longest = attention_rows.shape
        x = tower.patch_embed(pixel_values.to(tower.dtype))
        x = x + self.positions(pos_emb_weight_h, pos_emb_weight_w).index_select(0, pos_emb_row)
        tokens, slots = x, attention_slots
        if count:
            prefix = tower.prefix_embeddings().to(x.dtype)
            tokens = torch.cat([prefix.unsqueeze(0).expand(items, -1, -1).flatten(0, 1), x])
            # Item i's k-th prefix token sits at i * M + k of the padded batch.
            item = torch.arange(items, device=x.device)[:, None]
            prefix_slots = item * longest + torch.arange(count, device=x.device)
            slots = torch.cat([prefix_slots.flatten(), attention_slots])

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return padded_attention(q, k, v, attention_rows, slots)

        # The tower's own blocks (their token grid is read only by training's drop path; the graph is
        # exported in eval mode).
        for block in tower.blocks:
            tokens = block(tokens, attend)
        tokens = tower.norm(tokens)
        return self.outputs(tokens, attention_rows, attention_slots)

    def positions(self, weight_h: torch.Tensor, weight_w: torch.Tensor) -> torch.Tensor:
        """(U, G) x (U, G) per-axis weights -> (U, D) resampled table rows, computed in float32."""
        tower = self.tower
        compute_dtype = torch.promote_types(tower.dtype, torch.float32)
        table = tower.pos_embed[0, tower.config.num_table_prefix_rows :].to(compute_dtype)  # (G * G, D)
        weights = (weight_h.to(compute_dtype)[:, :, None] * weight_w.to(compute_dtype)[:, None, :]).flatten(1)
        return torch.matmul(weights, table).to(tower.dtype)

    def outputs(
        self, tokens: torch.Tensor, attention_rows: torch.Tensor, attention_slots: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The tower's outputs from its (N * n_prefix + L, D) normed token rows, as ``ClassicViT`` makes them."""
        tower, config = self.tower, self.tower.config
        count = config.num_prefix_tokens
        items, longest = attention_rows.shape
        patches = tokens[items * count :]
        prefix = tokens[: items * count].unflatten(0, (items, count))
        if config.pool == "token":
            pooled = prefix[:, 0]
        elif tower.attn_pool is not None:
            # The tower's own MAP head: each item's softmax over its own patch rows, by segment (scatter) ops
            # over the L rows; a patch row's item is its padded slot's row, i * M + j -> i.
            pooled = tower.attn_pool(patches, torch.div(attention_slots, longest, rounding_mode="trunc"), items)
        else:
            pooled = item_means(tokens, attention_rows[:, count:])
        named = {"last_hidden_state": patches, "prefix_tokens": prefix, "pooled": pooled}
        if tower.head is not None:
            if tower.head_dist is not None:
                named["head_logits"] = torch.stack([tower.head(prefix[:, 0]), tower.head_dist(prefix[:, 1])], dim=1)
                named["logits"] = named["head_logits"].mean(dim=1)
            else:
                named["logits"] = tower.head(pooled)
        if tower.pooler is not None:
            named["pooler_output"] = tower.pooler(prefix[:, 0])
        return tuple(named[name] for name in vit_output_names(config))


def vit_output_names(config: ClassicViTConfig) -> tuple[str, ...]:
    """The outputs of a graph exported from a tower of ``config``, in order: ``last_hidden_state``;
    ``prefix_tokens`` where it has prefix tokens; ``pooled``; ``logits`` with a head; ``head_logits``
    with DeiT's two heads; ``pooler_output`` with a pooler."""
    names = ["last_hidden_state"]
    if config.num_prefix_tokens:
        names.append("prefix_tokens")
    names.append("pooled")
    if config.num_classes:
        names.append("logits")
    if config.distilled_head:
        names.append("head_logits")
    if config.pooler:
        names.append("pooler_output")
    return tuple(names)


def item_means(tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(N, D) the mean of each item's rows of ``tokens``, accumulated in float32 or wider.

    Args:
        tokens: (T, D) token rows.
        rows: (N, K) int64 rows of each item, -1 past its end.
    """
    compute_dtype = torch.promote_types(tokens.dtype, torch.float32)
    valid = (rows >= 0).to(compute_dtype)
    gathered = tokens.index_select(0, rows.clamp(min=0).flatten()).unflatten(0, rows.shape).to(compute_dtype)
    sums = (gathered * valid.unsqueeze(-1)).sum(1)
    return (sums / valid.sum(1, keepdim=True)).to(tokens.dtype)

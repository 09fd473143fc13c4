"""The pre-norm transformer block of MoonViT (Kimi-VL, K2.5 and K3's MoonViT-V2).

Module and parameter names mirror Kimi-VL's checkpoints
(``norm0``, ``wqkv``, ``wo``, ``norm1``, ``mlp.fc0``, ``mlp.fc1``). K3's block is the same
module with an attention wider than the stream, RMSNorm and no biases (:meth:`Block.from_config`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .attention import BoundAttention
from .chunking import map_row_chunks
from .config import MoonViTConfig
from .grid import PackedGrid
from .linear import computes_in_float32, has_forward_hooks, linear
from .rope import apply_rope, apply_rope_

# The MLP runs over row chunks whose (rows, hidden) activation stays under
# this many bytes (see moonvit.chunking).
MLP_CHUNK_BYTES = 16 * 2**20


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` that also takes inputs of another dtype than its weight (bf16 activations under
    autocast, fp32 master weights in training): computed in the weight's dtype and cast back, where
    torch's kernel would warn and take a slow path. Same dtypes: torch's own call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            return super().forward(x.to(self.weight.dtype)).to(x.dtype)
        return super().forward(x)


def make_norm(dim: int, norm_type: str = "layernorm", eps: float | None = 1e-5) -> nn.Module:
    """The tower's norm: ``LayerNorm(dim, eps)``, or ``RMSNorm(dim, eps)`` (weight only; eps None takes the
    epsilon of the dtype it computes in, torch's default, as Kimi K3 builds it)."""
    if norm_type == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    if norm_type == "layernorm" and eps is not None:
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"norm_type {norm_type!r} with eps {eps!r} is not a norm of the tower (layernorm, rmsnorm)")


class MLP(nn.Module):
    """fc1(gelu_tanh(fc0(x))) (+ a residual); rows are independent, so large packs run in chunks of rows."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = True) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden_dim, bias=bias)
        self.fc1 = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """(L, D) -> (L, D); with ``residual`` (L, D), ``residual + mlp(x)`` (added in fc1's epilogue on CPU)."""
        row_bytes = self.fc0.out_features * (4 if computes_in_float32(x) else x.element_size())
        if residual is None:
            return map_row_chunks(self._mlp, x, row_bytes=row_bytes, budget=MLP_CHUNK_BYTES)
        return map_row_chunks(self._mlp, x, residual, row_bytes=row_bytes, budget=MLP_CHUNK_BYTES)

    def _mlp(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return linear(self.fc1, linear(self.fc0, x, gelu="tanh"), residual=residual)


def drop_path_per_item(branch: torch.Tensor, grid: PackedGrid, rate: float) -> torch.Tensor:
    """Stochastic depth with one draw per item of the pack: each image's (or clip's)
    rows of ``branch`` (L, D) are all zeroed with probability ``rate``, or all kept and
    scaled by 1 / (1 - rate). Per image, not per row or per pack, as for a batch of
    separate images."""
    keep = torch.rand(grid.num_images, device=branch.device) >= rate
    scale = keep.to(branch.dtype) / (1.0 - rate)
    return branch * scale.index_select(0, grid.item_index).unsqueeze(1)


class Block(nn.Module):
    """x + wo(attn(norm0(x))), then x + mlp(norm1(x)), on packed (L, D) rows.

    Args:
        dim: D, the width of the residual stream.
        num_heads: attention heads.
        mlp_dim: the MLP's hidden width.
        eps: the norms' epsilon (None: the dtype's, for RMSNorm).
        drop_path: > 0 adds per-image stochastic depth to both branches in training mode.
        attn_dim: the attention's inner width A (q, k, v are (heads, A / heads) each; Kimi K3:
            1536 for D = 1024); None: D.
        norm_type: ``"layernorm"`` or ``"rmsnorm"``.
        attn_bias, mlp_bias: whether wqkv / wo and the MLP's linears have biases.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_dim: int,
        eps: float | None,
        drop_path: float = 0.0,
        *,
        attn_dim: int | None = None,
        norm_type: str = "layernorm",
        attn_bias: bool = True,
        mlp_bias: bool = True,
    ) -> None:
        super().__init__()
        attn_dim = dim if attn_dim is None else attn_dim
        self.num_heads = num_heads
        self.drop_path = drop_path
        self.norm0 = make_norm(dim, norm_type, eps)
        self.wqkv = nn.Linear(dim, 3 * attn_dim, bias=attn_bias)
        self.wo = nn.Linear(attn_dim, dim, bias=attn_bias)
        self.norm1 = make_norm(dim, norm_type, eps)
        self.mlp = MLP(dim, mlp_dim, bias=mlp_bias)

    @classmethod
    def from_config(cls, config: MoonViTConfig, drop_path: float = 0.0) -> Block:
        """A block of the tower ``config`` describes."""
        return cls(
            config.hidden_size,
            config.num_attention_heads,
            config.intermediate_size,
            config.layer_norm_eps,
            drop_path,
            attn_dim=config.attention_width,
            norm_type=config.norm_type,
            attn_bias=config.attn_bias,
            mlp_bias=config.linear_bias,
        )

    def attention(
        self,
        x: torch.Tensor,
        rotation: torch.Tensor,
        attend: BoundAttention,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Multi-head self-attention within each image of the pack, (L, D) -> (L, D) (+ ``residual``)."""
        # wqkv's output (L, 3A) is laid out [q | k | v], each (heads, A / heads); q and k are rotated
        # in one pass, in the buffer itself in inference (no rotated copy), and read from it as views.
        # A hook on wqkv may keep that buffer (a feature capture stores its output as it is): then q
        # and k are rotated into a copy, with the same bits, and what the hook saw stays wqkv's output.
        qkv = linear(self.wqkv, x).unflatten(-1, (3, self.num_heads, -1))
        rotate = apply_rope if has_forward_hooks(self.wqkv) else apply_rope_
        qk = rotate(qkv[:, :2], rotation)
        return linear(self.wo, attend(qk[:, 0], qk[:, 1], qkv[:, 2]).flatten(1), residual=residual)

    def forward(
        self, x: torch.Tensor, rotation: torch.Tensor, attend: BoundAttention, grid: PackedGrid | None = None
    ) -> torch.Tensor:
        """One block over a pack's packed rows.

        Args:
            x: (L, D) rows.
            rotation: (L, head_dim // 2, 2) RoPE (cos, sin) of each row (``grid.rope_rotation``), or
                (L, 2, 1, head_dim // 2, 2), q's rotation scaled beside k's
                (:func:`~moonvit.model.rope.scale_query`, for a backend that takes q scaled).
            attend: ``attend(q, k, v)`` on (L, heads, head_dim), attention within each item, bound
                to the pack (:func:`~moonvit.model.attention.bind_attention`; the ONNX graph binds
                its padded attention): the encoder, the trainer and the export run this one module.
            grid: the pack, for per-image stochastic depth in training (unused otherwise).
        """
        if self.training and self.drop_path > 0:
            if grid is None:
                raise ValueError("stochastic depth draws per image: pass the pack's grid")
            x = x + drop_path_per_item(self.attention(self.norm0(x), rotation, attend), grid, self.drop_path)
            return x + drop_path_per_item(self.mlp(self.norm1(x)), grid, self.drop_path)
        x = self.attention(self.norm0(x), rotation, attend, residual=x)
        return self.mlp(self.norm1(x), residual=x)

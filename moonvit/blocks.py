"""The pre-LN transformer block of MoonViT.

Module and parameter names mirror Kimi-VL's checkpoints
(``norm0``, ``wqkv``, ``wo``, ``norm1``, ``mlp.fc0``, ``mlp.fc1``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import ATTENTION_FUNCTIONS
from .grid import PackedGrid
from .rope import apply_rope

# On CPU the MLP runs over row chunks whose (rows, hidden) activation stays
# under this many bytes: glibc recycles small buffers, while large ones are
# fresh pages from the OS each call, which costs 10-20% of a block. (CUDA's
# caching allocator has no such cliff; there one large matmul is best.)
MLP_CHUNK_BYTES = 16 * 2**20


class MLP(nn.Module):
    """fc1(gelu_tanh(fc0(x))); rows are independent, so large packs run in chunks of rows."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden_dim)
        self.fc1 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = max(1, MLP_CHUNK_BYTES // (self.fc0.out_features * x.element_size()))
        if x.device.type != "cpu" or len(x) <= rows:
            return self._mlp(x)
        return torch.cat([self._mlp(chunk) for chunk in x.split(rows)])

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class Block(nn.Module):
    """x + wo(attn(norm0(x))), then x + mlp(norm1(x)), on packed (L, D) rows."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm0 = nn.LayerNorm(dim, eps=eps)
        self.wqkv = nn.Linear(dim, 3 * dim)
        self.wo = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, mlp_dim)

    def attention(self, x: torch.Tensor, grid: PackedGrid, attn_implementation: str) -> torch.Tensor:
        """Multi-head self-attention within each image of the pack, (L, D) -> (L, D)."""
        # wqkv's output is laid out [q | k | v], each (heads, head_dim).
        q, k, v = self.wqkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(1)
        q, k = apply_rope(q, grid.rope_rotation), apply_rope(k, grid.rope_rotation)
        out = ATTENTION_FUNCTIONS[attn_implementation](q, k, v, grid)
        return self.wo(out.flatten(1))

    def forward(self, x: torch.Tensor, grid: PackedGrid, attn_implementation: str) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), grid, attn_implementation)
        return x + self.mlp(self.norm1(x))

"""A straightforward Kimi K3 vision tower (MoonViT-V2), the peer of the K3 rows of bench_cpu.py.

Written as the serving ports run K3 on a CPU: the linear layers and norms over all packed rows
at once (``nn.Linear``, ``nn.RMSNorm``), the position table resampled per item with
``F.interpolate`` (bilinear; the table as it is on a 64 x 64 grid), RoPE as a complex multiply,
attention one ``F.scaled_dot_product_attention`` call per item (per segment of the packed rows),
the 2x2 merger with the frames' mean per item. Everything the grids determine is computed once per
call. It takes this package's weights by name; it is a program's peer, not part of the library.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from moonvit import MoonViT


class K3Baseline(nn.Module):
    """``K3Baseline(model)(pixel_values, grid_thws)`` -> merged (S / 4, 4, D), on ``model``'s weights."""

    def __init__(self, model: MoonViT) -> None:
        super().__init__()
        c = model.config
        if c.norm_type != "rmsnorm" or c.pos_emb_interpolation_mode != "bilinear":
            raise ValueError("K3Baseline takes a MoonViT-V2 tower (RMSNorm, bilinear position table)")
        self.heads, self.head_dim, self.patch = c.num_attention_heads, c.head_dim, c.patch_size
        self.theta, self.time_rows = c.rope_theta, c.init_pos_emb_time
        self.proj = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, c.patch_size, bias=False)
        self.table = nn.Parameter(model.patch_embed.pos_emb.weight.detach().clone())
        self.blocks = nn.ModuleList()
        for source in model.encoder.blocks:
            block = nn.Module()
            block.norm0 = nn.RMSNorm(c.hidden_size, eps=None)
            block.wqkv = nn.Linear(c.hidden_size, 3 * c.attention_width, bias=False)
            block.wo = nn.Linear(c.attention_width, c.hidden_size, bias=False)
            block.norm1 = nn.RMSNorm(c.hidden_size, eps=None)
            block.fc0 = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
            block.fc1 = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
            ours = source.state_dict()
            block.load_state_dict({k.replace("mlp.", ""): v for k, v in ours.items()})
            self.blocks.append(block)
        self.final_norm = nn.RMSNorm(c.hidden_size, eps=None)
        self.final_norm.load_state_dict(model.encoder.final_layernorm.state_dict())
        self.proj.load_state_dict(model.patch_embed.proj.state_dict())
        self.to(model.dtype)

    def prepare(self, grid_thws: torch.Tensor, dtype: torch.dtype) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Per call: the segment lengths, each row's position embedding (L, D) and RoPE turn (L, 1, P) complex."""
        d = self.head_dim
        freqs = 1.0 / self.theta ** (torch.arange(0, d, 4)[: d // 4].float() / d)
        pos, rotation, lengths = [], [], []
        for t, h, w in grid_thws.tolist():
            if (h, w) == tuple(self.table.shape[:2]):
                rows = self.table.reshape(h * w, -1)
            else:
                resized = F.interpolate(self.table.permute(2, 0, 1)[None].float(), size=(h, w), mode="bilinear")
                rows = resized[0].permute(1, 2, 0).reshape(h * w, -1).to(dtype)
            rows = rows.repeat(t, 1)
            if t > 1:
                rows = rows + _temporal(t, rows.shape[1], dtype).repeat_interleave(h * w, dim=0)
            pos.append(rows)
            y, x = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
            angles = torch.stack([torch.outer(x.flatten(), freqs), torch.outer(y.flatten(), freqs)], -1)
            rotation.append(torch.polar(torch.ones(h * w, d // 2), angles.reshape(h * w, d // 2)).repeat(t, 1))
            lengths.append(t * h * w)
        return lengths, torch.cat(pos), torch.cat(rotation)[:, None, :]

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        lengths, pos, rotation = self.prepare(grid_thws, pixel_values.dtype)
        x = self.proj(pixel_values).flatten(1) + pos
        for block in self.blocks:
            qkv = block.wqkv(block.norm0(x)).unflatten(-1, (3, self.heads, self.head_dim))
            q, k = (_rotate(qkv[:, i], rotation) for i in range(2))
            v = qkv[:, 2]
            out = [
                F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (qs, ks, vs)))[0].transpose(0, 1)
                for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths))
            ]
            x = x + block.wo(torch.cat(out).flatten(1))
            x = x + block.fc1(F.gelu(block.fc0(block.norm1(x)), approximate="tanh"))
        x = self.final_norm(x)
        merged = []
        for rows, (t, h, w) in zip(x.split(lengths), grid_thws.tolist()):
            mean = rows.reshape(t, h * w, -1).float().mean(0).to(x.dtype)
            merged.append(mean.reshape(h // 2, 2, w // 2, 2, -1).permute(0, 2, 1, 3, 4).reshape(-1, 4, x.shape[1]))
        return torch.cat(merged)


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def _temporal(frames: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    half = dim // 2
    omega = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(frames, dtype=torch.float64)[:, None] * omega
    return torch.cat([angles.sin(), angles.cos()], dim=1).to(dtype)

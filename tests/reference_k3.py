"""An independent, deliberately plain Kimi K3 vision tower ("MoonViT-V2") and projector, as test oracle.

Written from the description of K3's tower and its ``patchmergerv2`` projector, one item (image or
clip) at a time: Conv2d patches, the position table through ``F.interpolate(mode="bilinear")``
(used as is on an exactly table-sized grid), the fixed sin-cos temporal rows, complex-number 2D RoPE
over head_dim = attention width / heads, RMSNorm written out with the eps of the dtype it computes
in, explicit softmax over all frames of a clip, no biases anywhere, the 2x2 merger with the
frames' mean, then the projector (no pre-norm, Linear, exact GELU, Linear, RMSNorm). It shares no
code with the package: it reads parameters by name and the sizes from a dict.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` in float32 (float64 stays), eps None: that dtype's epsilon."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    eps = torch.finfo(compute).eps if eps is None else eps
    y = x.to(compute)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(compute)).to(x.dtype)


def temporal_rows(frames: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """(frames, dim): frame f's ``[sin(f w) | cos(f w)]``, w_i = 10000^(-i / (dim / 2))."""
    half = dim // 2
    omega = 1.0 / 10000.0 ** (torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(frames, dtype=torch.float64)[:, None] * omega[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1).to(dtype)


def reference_k3_forward(
    state: dict[str, torch.Tensor], sizes: dict, pixel_values: torch.Tensor, grid_thws
) -> tuple[torch.Tensor, torch.Tensor]:
    """(last_hidden_state (L, D), merged (S / 4, 4, D)) in pixel_values' dtype.

    ``sizes``: hidden, heads, attention (the attention width), layers, patch, rope_theta.
    """
    D, H, A = sizes["hidden"], sizes["heads"], sizes["attention"]
    d = A // H
    freqs = 1.0 / (sizes["rope_theta"] ** (torch.arange(0, d, 4)[: d // 4].float() / d))
    table = state["patch_embed.pos_emb.weight"]
    outputs, merged = [], []
    start = 0
    for t, h, w in [tuple(int(v) for v in row) for row in grid_thws]:
        n = t * h * w
        patches = pixel_values[start : start + n]
        start += n
        x = F.conv2d(patches, state["patch_embed.proj.weight"], None, stride=sizes["patch"]).reshape(n, D)
        if (h, w) == tuple(table.shape[:2]):
            pos = table.reshape(h * w, D)
        else:
            pos = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=False)
            pos = pos[0].permute(1, 2, 0).reshape(h * w, D)
        pos = pos.to(x.dtype).repeat(t, 1)
        if t > 1:
            pos = pos + temporal_rows(t, D, x.dtype).repeat_interleave(h * w, dim=0)
        x = x + pos

        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        rows, cols = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
        angles = torch.stack([torch.outer(cols.flatten(), freqs), torch.outer(rows.flatten(), freqs)], -1)
        angles = angles.reshape(h * w, d // 2).to(compute)
        rotation = torch.polar(torch.ones_like(angles), angles).repeat(t, 1)  # every frame: its frame's angles

        def rope(y: torch.Tensor) -> torch.Tensor:
            pairs = torch.view_as_complex(y.to(compute).reshape(n, H, d // 2, 2).contiguous())
            return torch.view_as_real(pairs * rotation[:, None, :]).reshape(n, H, d).to(y.dtype)

        for i in range(sizes["layers"]):
            p = f"encoder.blocks.{i}."
            y = rms_norm(x, state[p + "norm0.weight"], None)
            q, k, v = (y @ state[p + "wqkv.weight"].T).reshape(n, 3, H, d).unbind(1)
            q, k = rope(q), rope(k)
            heads = []
            for j in range(H):  # one head at a time: an n x n score matrix, not H of them
                scores = (q[:, j] @ k[:, j].T).to(compute) / math.sqrt(d)
                heads.append(scores.softmax(-1).to(v.dtype) @ v[:, j])
            attention = torch.stack(heads, dim=1).reshape(n, A)
            x = x + attention @ state[p + "wo.weight"].T
            y = rms_norm(x, state[p + "norm1.weight"], None)
            y = F.gelu(y @ state[p + "mlp.fc0.weight"].T, approximate="tanh")
            x = x + y @ state[p + "mlp.fc1.weight"].T
        x = rms_norm(x, state["encoder.final_layernorm.weight"], None)
        outputs.append(x)
        mean = x.reshape(t, h * w, D).to(compute).mean(0).to(x.dtype).reshape(h // 2, 2, w // 2, 2, D)
        merged.append(mean.permute(0, 2, 1, 3, 4).reshape(-1, 4, D))
    return torch.cat(outputs), torch.cat(merged)


def reference_k3_projector(state: dict[str, torch.Tensor], merged: torch.Tensor, eps: float) -> torch.Tensor:
    """``patchmergerv2``: (N, 4, D) -> (N, text width), no pre-norm, no biases, post RMSNorm."""
    x = merged.reshape(len(merged), -1)
    x = F.gelu(x @ state["linear_1.weight"].T)
    x = x @ state["linear_2.weight"].T
    return rms_norm(x, state["post_norm.weight"], eps)

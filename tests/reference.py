"""An independent, deliberately plain MoonViT forward used as a test oracle.

Written straight from the published description: one image at a time,
F.interpolate for the position table, complex-number RoPE, explicit softmax.
It shares no code with the package except reading parameters by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_forward(
    state: dict[str, torch.Tensor], config, pixel_values: torch.Tensor, grid_hws
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (last_hidden_state (L, D), merged (L/4, 4, D)) in pixel_values' dtype."""
    D, H = config.hidden_size, config.num_attention_heads
    d = D // H
    eps = config.layer_norm_eps
    kh, kw = config.merge_kernel_size
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, d, 4)[: d // 4].float() / d))
    outputs, merged = [], []
    start = 0
    for h, w in [tuple(map(int, g)) for g in grid_hws]:
        patches = pixel_values[start : start + h * w]
        start += h * w
        x = F.conv2d(
            patches, state["patch_embed.proj.weight"], state["patch_embed.proj.bias"], stride=config.patch_size
        )
        x = x.reshape(h * w, D)
        table = state["patch_embed.pos_emb.weight"].permute(2, 0, 1).unsqueeze(0)
        pos = F.interpolate(table, size=(h, w), mode="bicubic", align_corners=False)
        x = x + pos.squeeze(0).permute(1, 2, 0).reshape(h * w, D)

        rows, cols = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
        angle_col = torch.outer(cols.flatten(), freqs)
        angle_row = torch.outer(rows.flatten(), freqs)
        angles = torch.stack([angle_col, angle_row], dim=-1).reshape(h * w, d // 2)
        rotation = torch.polar(torch.ones_like(angles), angles)  # complex64

        def rope(t):
            as_complex = torch.view_as_complex(t.float().reshape(h * w, H, d // 2, 2).contiguous())
            return torch.view_as_real(as_complex * rotation[:, None, :]).reshape(h * w, H, d).to(t.dtype)

        for i in range(config.num_hidden_layers):
            p = f"encoder.blocks.{i}."
            y = F.layer_norm(x, (D,), state[p + "norm0.weight"], state[p + "norm0.bias"], eps)
            qkv = y @ state[p + "wqkv.weight"].T + state[p + "wqkv.bias"]
            q, k, v = qkv.reshape(h * w, 3, H, d).unbind(1)
            q, k = rope(q), rope(k)
            scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(h * w, D)
            x = x + attn @ state[p + "wo.weight"].T + state[p + "wo.bias"]
            y = F.layer_norm(x, (D,), state[p + "norm1.weight"], state[p + "norm1.bias"], eps)
            y = y @ state[p + "mlp.fc0.weight"].T + state[p + "mlp.fc0.bias"]
            y = F.gelu(y, approximate="tanh")
            x = x + y @ state[p + "mlp.fc1.weight"].T + state[p + "mlp.fc1.bias"]
        x = F.layer_norm(x, (D,), state["encoder.final_layernorm.weight"], state["encoder.final_layernorm.bias"], eps)
        outputs.append(x)
        grouped = x.reshape(h // kh, kh, w // kw, kw, D).permute(0, 2, 1, 3, 4).reshape(-1, kh * kw, D)
        merged.append(grouped)
    return torch.cat(outputs), torch.cat(merged)

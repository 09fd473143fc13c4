"""A plain LocateAnything-3B vision path (tower, merger, ``mlp1``) written from its description.

It reads the release's own tensor names (``vision_model.*``, ``mlp1.{0,1,3}.*``), so it also checks
the loader's mapping; it shares no code with the package. One image at a time; the position table
resampled with ``F.interpolate`` (bicubic, align_corners False); RoPE as a real-valued rotation of
adjacent channel pairs (pair 2i: the column angle of frequency i, pair 2i + 1: the row angle), done
in float32 and cast back; attention as an explicit softmax over the image's own patches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-5  # every LayerNorm of the tower and of mlp1 (fixed in the remote code)
THETA = 10000.0


def _rotate(t: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Rotate (S, heads, d) by each patch's (row, col): channel pair j = (2j, 2j + 1)."""
    d = t.shape[-1]
    freqs = THETA ** -(torch.arange(0, d, 4, dtype=torch.float32)[: d // 4] / d)  # (d / 4,)
    angles = torch.stack([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1).reshape(-1, 1, d // 2)
    x = t.float().reshape(*t.shape[:-1], d // 2, 2)
    real, imag = x[..., 0], x[..., 1]
    cos, sin = angles.cos(), angles.sin()
    out = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return out.reshape(t.shape).to(t.dtype)


def reference_locateanything(
    state: dict[str, torch.Tensor], heads: int, pixel_values: torch.Tensor, grid_hws
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The vision path of a LocateAnything release.

    Args:
        state: the release's tensors (``vision_model.*`` and ``mlp1.*``).
        heads: attention heads.
        pixel_values: (L, 3, p, p) each image's patches in raster order, images concatenated.
        grid_hws: N (rows, cols) pairs, each even.

    Returns:
        last_hidden_state (L, D); merged (L / 4, 4 D), each 2 x 2 group's patches joined in
        row-major order, as the release's ``patch_merger`` returns them; projected (L / 4, T).
    """
    v = {name.removeprefix("vision_model."): t for name, t in state.items() if name.startswith("vision_model.")}
    weight = v["patch_embed.proj.weight"]
    dim, patch = weight.shape[0], weight.shape[-1]
    d = dim // heads
    depth = len({name.split(".")[2] for name in v if name.startswith("encoder.blocks.")})
    lasts, groups = [], []
    start = 0
    for h, w in [tuple(int(n) for n in g) for g in grid_hws]:
        n = h * w
        x = F.conv2d(pixel_values[start : start + n], weight, v["patch_embed.proj.bias"], stride=patch).reshape(n, dim)
        start += n
        table = v["patch_embed.pos_emb.weight"].permute(2, 0, 1)[None]  # (1, D, 64, 64)
        x = x + F.interpolate(table, size=(h, w), mode="bicubic", align_corners=False)[0].permute(1, 2, 0).reshape(
            n, dim
        )
        rows = torch.arange(h, dtype=torch.float32).repeat_interleave(w)
        cols = torch.arange(w, dtype=torch.float32).repeat(h)
        for i in range(depth):
            b = {
                name.removeprefix(f"encoder.blocks.{i}."): t
                for name, t in v.items()
                if name.startswith(f"encoder.blocks.{i}.")
            }
            y = F.layer_norm(x, (dim,), b["norm0.weight"], b["norm0.bias"], EPS)
            q, k, val = (y @ b["wqkv.weight"].T + b["wqkv.bias"]).reshape(n, 3, heads, d).unbind(1)
            q, k = _rotate(q, rows, cols), _rotate(k, rows, cols)
            weights = (q.permute(1, 0, 2) @ k.permute(1, 2, 0) / d**0.5).softmax(-1)  # (heads, n, n)
            attended = (weights @ val.permute(1, 0, 2)).permute(1, 0, 2).reshape(n, dim)
            x = x + attended @ b["wo.weight"].T + b["wo.bias"]
            y = F.layer_norm(x, (dim,), b["norm1.weight"], b["norm1.bias"], EPS)
            y = F.gelu(y @ b["mlp.fc0.weight"].T + b["mlp.fc0.bias"], approximate="tanh")
            x = x + y @ b["mlp.fc1.weight"].T + b["mlp.fc1.bias"]
        x = F.layer_norm(x, (dim,), v["encoder.final_layernorm.weight"], v["encoder.final_layernorm.bias"], EPS)
        lasts.append(x)
        groups.append(x.reshape(h // 2, 2, w // 2, 2, dim).permute(0, 2, 1, 3, 4).reshape(-1, 4 * dim))
    merged = torch.cat(groups)
    y = F.layer_norm(merged, (4 * dim,), state["mlp1.0.weight"], state["mlp1.0.bias"], EPS)
    y = F.gelu(y @ state["mlp1.1.weight"].T + state["mlp1.1.bias"])
    projected = y @ state["mlp1.3.weight"].T + state["mlp1.3.bias"]
    return torch.cat(lasts), merged, projected

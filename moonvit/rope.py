"""2D rotary position embedding of MoonViT.

Each head's channels are read as head_dim / 2 complex numbers from adjacent
pairs (channel 2j real, 2j + 1 imaginary). With per-axis frequencies
``theta ** (-k / head_dim)`` for k = 0, 4, ..., head_dim - 4, complex pair 2i is
rotated by ``col * freq_i`` and pair 2i + 1 by ``row * freq_i``: column first,
as the released weights were trained (an upstream docstring says otherwise).
"""

from __future__ import annotations

import torch


def rope_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """(head_dim // 4,) float32 per-axis frequencies."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every complex pair's angle.

    Args:
        positions: (L, 2) integer (row, col) of each patch inside its image.

    Returns:
        cos, sin: (L, head_dim // 2) float32, pairs in (col, row) interleaved order.
    """
    freqs = rope_frequencies(head_dim, theta)
    rows = positions[:, 0:1].float() * freqs
    cols = positions[:, 1:2].float() * freqs
    angles = torch.stack([cols, rows], dim=-1).flatten(1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate q or k.

    Args:
        x: (L, heads, head_dim) in any float dtype.
        cos, sin: (L, head_dim // 2) from :func:`rope_angles`.

    Returns:
        (L, heads, head_dim) in x's dtype, rotated in float32 (float64 stays float64).
    """
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    pairs = x.to(compute_dtype).unflatten(-1, (-1, 2))
    real, imag = pairs.unbind(-1)
    cos = cos.to(compute_dtype).unsqueeze(1)
    sin = sin.to(compute_dtype).unsqueeze(1)
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)

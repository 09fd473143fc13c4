"""2D rotary position embedding of MoonViT.

Each head's channels are read as head_dim / 2 complex numbers from adjacent
pairs (channel 2j real, 2j + 1 imaginary). With per-axis frequencies
``theta ** (-k / head_dim)`` for k = 0, 4, ..., head_dim - 4, complex pair 2i is
rotated by ``col * freq_i`` and pair 2i + 1 by ``row * freq_i``: column first,
as the released weights were trained (an upstream docstring says otherwise).
"""

from __future__ import annotations

import math

import torch

from .chunking import map_row_chunks


def rope_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """(head_dim // 4,) float32 per-axis frequencies."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)


def rope_rotation(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """The unit complex number that rotates each channel pair.

    Args:
        positions: (L, 2) integer (row, col) of each patch inside its image.

    Returns:
        (L, head_dim // 2) complex64, pairs in (col, row) interleaved order: pair
        2i is ``exp(1j * col * freq_i)``, pair 2i + 1 is ``exp(1j * row * freq_i)``.
    """
    freqs = rope_frequencies(head_dim, theta)
    rows = positions[:, 0:1].float() * freqs
    cols = positions[:, 1:2].float() * freqs
    angles = torch.stack([cols, rows], dim=-1).flatten(1)
    return torch.polar(torch.ones_like(angles), angles)


# Rows are rotated in chunks whose float32 copy stays under this many bytes
# (see moonvit.chunking).
CHUNK_BYTES = 8 * 2**20


def apply_rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotate q or k.

    Args:
        x: (L, ..., head_dim) in any float dtype, e.g. q as (L, heads, head_dim).
        rotation: (L, head_dim // 2) from :func:`rope_rotation`.

    Returns:
        x's shape and dtype, rotated in float32 (float64 stays float64). One complex
        multiply does in one pass what the real form does in six.
    """
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    row_bytes = math.prod(x.shape[1:]) * compute_dtype.itemsize
    return map_row_chunks(
        lambda xs, rs: _rotate(xs, rs, compute_dtype), x, rotation, row_bytes=row_bytes, budget=CHUNK_BYTES
    )


def _rotate(x: torch.Tensor, rotation: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    pairs = torch.view_as_complex(x.to(compute_dtype).unflatten(-1, (-1, 2)))
    rotation = rotation.to(pairs.dtype).view(rotation.shape[0], *([1] * (x.ndim - 2)), -1)
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)

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
from .tracing import is_traced, recorded_or_traced


def rope_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """(head_dim // 4,) float32 per-axis frequencies."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)


def rope_rotation(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """The rotation of each channel pair, as real numbers.

    Args:
        positions: (L, 2) integer (row, col) of each patch inside its image.

    Returns:
        (L, head_dim // 2, 2) float32 (cos, sin) of each pair's angle, pairs in (col, row)
        interleaved order: pair 2i turns by ``col * freq_i``, pair 2i + 1 by ``row * freq_i``.
        Real, so the grid holds no complex tensor (compilers and exporters take it);
        ``torch.view_as_complex`` of it is the unit complex rotation.
    """
    freqs = rope_frequencies(head_dim, theta)
    rows = positions[:, 0:1].float() * freqs
    cols = positions[:, 1:2].float() * freqs
    angles = torch.stack([cols, rows], dim=-1).flatten(1)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


# Rows are rotated in chunks whose float32 copy stays under this many bytes
# (see moonvit.chunking).
CHUNK_BYTES = 8 * 2**20


def apply_rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotate q or k (or both, stacked).

    Args:
        x: (L, ..., head_dim) in any float dtype, e.g. q as (L, heads, head_dim), or q and k
            as (L, 2, heads, head_dim).
        rotation: (L, head_dim // 2, 2) from :func:`rope_rotation`, or for q and k stacked
            (L, 2, 1, head_dim // 2, 2) from :func:`scale_query`.

    Returns:
        x's shape and dtype, rotated in float32 (float64 stays float64). Eager, one complex
        multiply does in one pass what the real form does in several (measured about twice as
        fast on CPU); under ``torch.compile`` and ONNX export the real form runs (the same
        arithmetic: ``(a + ib)(c + is)``), since neither takes complex tensors.
    """
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    if is_traced():
        return rotate_real(x, rotation, compute_dtype)
    row_bytes = math.prod(x.shape[1:]) * compute_dtype.itemsize
    return map_row_chunks(
        lambda xs, rs: _rotate_complex(xs, rs, compute_dtype), x, rotation, row_bytes=row_bytes, budget=CHUNK_BYTES
    )


# In place, rows are rotated in chunks whose float32 copy stays under this many bytes: small enough
# to stay in cache between the widening, the multiply and the write back. Measured on a 2-core Zen 4
# (16 heads x 72, q and k): 0.55-0.80 ms per 1,000 rows at 4 MiB against 0.83-1.38 at 2 or 16 MiB,
# and 3.5 ms unchunked at 4,096 rows and more.
IN_PLACE_CHUNK_BYTES = 4 * 2**20


def apply_rope_(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` in place where it can be: ``x`` (e.g. the q and k of a block's qkv buffer,
    (L, 2, heads, head_dim), a view) is overwritten by its rotation and returned, the same bits as
    :func:`apply_rope` gives, without allocating the rotated copy. Where autograd records ``x`` or a
    graph is being traced (``torch.compile``, ONNX export), ``x`` is left as it is and
    :func:`apply_rope`'s rotated copy returned.
    """
    if recorded_or_traced(x):
        return apply_rope(x, rotation)
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    turn = torch.view_as_complex(_broadcast(rotation, x, compute_dtype))
    rows = max(1, len(x))
    if x.device.type == "cpu":
        rows = max(1, min(rows, IN_PLACE_CHUNK_BYTES // max(1, math.prod(x.shape[1:]) * compute_dtype.itemsize)))
    # one float32 chunk, reused: three kernels per chunk (widen, multiply, write back), its memory hot
    scratch = torch.empty((rows, *x.shape[1:]), dtype=compute_dtype, device=x.device)
    pairs = torch.view_as_complex(scratch.unflatten(-1, (-1, 2)))
    for start in range(0, len(x), rows):
        part = x[start : start + rows]
        chunk = scratch[: len(part)]
        chunk.copy_(part)
        pairs[: len(part)].mul_(turn[start : start + rows])
        part.copy_(chunk)
    return x


def scale_query(rotation: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q's rotation times a per-row factor beside k's own, for q and k stacked as (L, 2, heads, head_dim).

    Args:
        rotation: (L, P, 2) from :func:`rope_rotation`.
        scale: (L,) float32, each row's factor of q (1.0 keeps a row's bits).

    Returns:
        (L, 2, 1, P, 2) float32: q's (cos, sin) scaled, then k's. :func:`apply_rope` and
        :func:`apply_rope_` take it in place of ``rotation``: q comes out multiplied by its factor,
        computed in float32 with the rotation and rounded once.
    """
    return torch.stack([rotation * scale[:, None, None], rotation], dim=1).unsqueeze(2)


def _broadcast(rotation: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(L, P, 2) -> (L, 1, ..., 1, P, 2) in ``dtype``, to broadcast over x's middle dimensions; a rotation
    shaped for x already (:func:`scale_query`'s) is only converted."""
    if rotation.ndim == x.ndim + 1:
        return rotation.to(dtype)
    return rotation.to(dtype).view(rotation.shape[0], *([1] * (x.ndim - 2)), *rotation.shape[1:])


def _rotate_complex(x: torch.Tensor, rotation: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    pairs = torch.view_as_complex(x.to(compute_dtype).unflatten(-1, (-1, 2)))
    turn = torch.view_as_complex(_broadcast(rotation, x, compute_dtype))
    return torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)


def rotate_real(x: torch.Tensor, rotation: torch.Tensor, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The same rotation without complex numbers: pair (a, b) by (cos, sin) -> (a cos - b sin, a sin + b cos)."""
    a, b = x.to(compute_dtype).unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = _broadcast(rotation, x, compute_dtype).unbind(-1)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)

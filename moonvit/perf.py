"""What an MFU figure needs: the encoder's FLOP count, the machine's matmul peak, a synchronised timer.

Shared by the trainer's progress line and the benchmarks, so that both report the same MFU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .model.config import MoonViTConfig

__all__ = ["config_flops", "encoder_flops", "matmul_peak", "seconds"]


def encoder_flops(
    seqlens: Sequence[int], hidden: int, mlp: int, depth: int, patch: int = 14, attention: int | None = None
) -> float:
    """Matmul FLOPs of one forward over items of ``seqlens`` packed rows each: patch embedding,
    projections, MLP and attention (each item attends over its own rows).

    ``attention`` is the attention's inner width A (Kimi K3: 1536 beside a 1024 stream; default:
    ``hidden``): wqkv is D x 3A, wo A x D, and the scores and their product with v 4 n^2 A.
    A training step (forward and backward) costs about 3x this.
    """
    attn = hidden if attention is None else attention
    patches = sum(seqlens)
    per_block = 2 * patches * (4 * hidden * attn + 2 * hidden * mlp) + sum(4 * n**2 * attn for n in seqlens)
    return 2 * patches * 3 * patch * patch * hidden + depth * per_block


def config_flops(seqlens: Sequence[int], config: MoonViTConfig, depth: int | None = None) -> float:
    """:func:`encoder_flops` of a tower ``config`` describes (at ``depth`` blocks, default its own)."""
    layers = config.num_hidden_layers if depth is None else depth
    return encoder_flops(
        seqlens, config.hidden_size, config.intermediate_size, layers, config.patch_size, config.attention_width
    )


def seconds(fn: Callable[[], object], device: torch.device | None = None) -> float:
    """Wall time of one call of ``fn`` (synchronising CUDA around it)."""
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def matmul_peak(dtype: torch.dtype, n: int = 4096, repeats: int = 3, device: str | torch.device = "cpu") -> float:
    """Best FLOP/s of an n x n x n matmul in ``dtype`` on ``device``."""
    device = torch.device(device)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    a @ b
    best = min(seconds(lambda: a @ b, device) for _ in range(repeats))
    return 2 * n**3 / best

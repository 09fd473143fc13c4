"""What an MFU figure needs: the encoder's FLOP count, the machine's matmul peak, a synchronised timer.

Shared by the trainer's progress line and the benchmarks, so that both report the same MFU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .model.config import MoonViTConfig, matmul_flops

__all__ = ["config_flops", "encoder_flops", "matmul_peak", "seconds"]


def encoder_flops(
    seqlens: Sequence[int], hidden: int, mlp: int, depth: int, patch: int = 14, attention: int | None = None
) -> float:
    """Matmul FLOPs of one forward over items of ``seqlens`` packed rows each, for a tower given by its
    sizes (``attention``: the attention's inner width, default ``hidden``); with a config at hand,
    use :meth:`MoonViTConfig.flops <moonvit.model.config.MoonViTConfig.flops>`, which counts these.
    A training step (forward and backward) costs about 3x this.
    """
    return matmul_flops(seqlens, hidden, mlp, depth, patch, attention)


def config_flops(seqlens: Sequence[int], config: MoonViTConfig, depth: int | None = None) -> float:
    """The tower's own count, ``config.flops(seqlens, depth)`` (at ``depth`` blocks, default its own)."""
    return config.flops(seqlens, depth)


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


def matmul_peak(
    dtype: torch.dtype,
    n: int = 4096,
    repeats: int = 3,
    device: str | torch.device = "cpu",
    warmup: int = 3,
    warmup_seconds: float = 0.5,
) -> float:
    """Best FLOP/s of an n x n x n matmul in ``dtype`` on ``device``, measured warm.

    The same GEMM first runs untimed, ``warmup`` times and for at least ``warmup_seconds``: its first
    calls are slow while the library picks and prepares its kernel and the threads and caches settle
    (on an Intel CPU with AMX, bf16 4096^3 measured cold read 664 GFLOP/s, against 1.7-2.4 TFLOP/s
    after a few calls, which inflated every MFU divided by it). Then the best of ``repeats`` timed
    calls, each into the same preallocated output (no allocation timed).
    """
    device = torch.device(device)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    out = torch.empty(n, n, dtype=dtype, device=device)

    def gemm() -> None:
        torch.matmul(a, b, out=out)

    calls, warm = 0, 0.0
    while calls < warmup or warm < warmup_seconds:
        warm += seconds(gemm, device)
        calls += 1
    best = min(seconds(gemm, device) for _ in range(repeats))
    return 2 * n**3 / best

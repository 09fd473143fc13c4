"""The block's GEMMs alone against the same GEMMs inside the forward, in TFLOP/s.

    python benchmarks/gemm_rates.py --depth 4 --threads 2 --out benchmarks/results/gemm_rates.md

For each linear of a block of the so400m-3d tower (its shapes from the preset's config: wqkv, wo and
the MLP's fc0 / fc1) and each ``--rows``, in bf16:

- ``F.linear alone``: ``F.linear(x, weight, bias)`` on random (rows, in) input, warm (a few calls first),
  the median of ``--reps`` calls;
- ``block call alone``: the block's own call (``moonvit.model.blocks.linear`` with the same fused GELU or
  residual add), timed the same way;
- ``in forward``: the same call inside a real forward over one image of ``rows`` patches (``--depth``
  blocks, random weights, position cache on, as profile_ops.py builds it): the median over every
  block and ``--reps`` forwards of the call's wall time. Each call is timed by wrapping the name the
  block looks up (as profile_ops.py labels it; no hooks, no profiler), and the wrapper is restored
  afterwards.

The ratios are in forward / F.linear alone and in forward / block call alone: below 1, the GEMM runs
slower in the forward than alone (weights streamed from memory between blocks, the input just written
by another op); the second compares the same call, epilogue included.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from common import host_line, write_report
from profile_ops import build

import moonvit.model.blocks as blocks_module
from moonvit import MoonViT
from moonvit.cli import add_threads_argument, apply_threads, output_file, positive_int
from moonvit.model.attention import attention_names
from moonvit.model.blocks import Block
from moonvit.model.linear import cpu_bf16_matmul

WARMUP = 3
"""Untimed calls before each timed series."""


EPILOGUES: dict[str, dict[str, bool]] = {
    "wqkv": {},
    "wo": {"residual": True},
    "fc0": {"gelu": "tanh"},
    "fc1": {"residual": True},
}
"""The block's linears, in its order, each with the epilogue the block fuses into it."""


def linears(block: Block) -> dict[str, nn.Linear]:
    """``block``'s linears by name."""
    return {"wqkv": block.wqkv, "wo": block.wo, "fc0": block.mlp.fc0, "fc1": block.mlp.fc1}


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def alone(layer: nn.Linear, epilogue: dict[str, bool], rows: int, reps: int) -> tuple[float, float]:
    """Seconds per call of ``F.linear`` and of the block's call on (rows, in) input, warm, in inference
    mode as the forward runs."""
    x = torch.randn(rows, layer.in_features).to(layer.weight.dtype)
    residual = torch.randn(rows, layer.out_features).to(layer.weight.dtype) if epilogue.get("residual") else None
    gelu = epilogue.get("gelu")
    with torch.inference_mode():
        plain = median_seconds(lambda: F.linear(x, layer.weight, layer.bias), reps)
        fused = median_seconds(lambda: blocks_module.linear(layer, x, gelu=gelu, residual=residual), reps)
    return plain, fused


@contextmanager
def timed_linears(names: dict[int, str], times: dict[str, list[float]]) -> Iterator[None]:
    """Each call of the block's ``linear`` on a layer in ``names`` (by ``id``) timed into
    ``times[name]``, for the length of the ``with``; the name is put back afterwards."""
    saved = blocks_module.linear

    def call(layer: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = saved(layer, x, **kwargs)
        times[names[id(layer)]].append(time.perf_counter() - start)
        return out

    blocks_module.linear = call
    try:
        yield
    finally:
        blocks_module.linear = saved


def in_forward(model: MoonViT, rows: int, reps: int) -> dict[str, float]:
    """Median seconds per call of each block linear inside forwards over one image of ``rows`` patches."""
    side = max(h for h in range(2, math.isqrt(rows) + 1, 2) if rows % h == 0)  # the squarest even grid
    grids = torch.tensor([[1, side, rows // side]])
    p = model.config.patch_size
    pixels = torch.randn(rows, model.config.num_channels, p, p).to(model.dtype)
    grid = model.prepare_grid(grids)
    names = {id(layer): name for block in model.encoder.blocks for name, layer in linears(cast(Block, block)).items()}
    times: dict[str, list[float]] = defaultdict(list)
    with torch.inference_mode():
        model(pixels, grid=grid)  # warm-up
        with timed_linears(names, times):
            for _ in range(reps):
                model(pixels, grid=grid)
    return {name: statistics.median(values) for name, values in times.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/gemm_rates.py", description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=positive_int, default=4, help="blocks in the forward (default: 4)")
    add_threads_argument(parser)
    parser.add_argument(
        "--rows", nargs="+", type=positive_int, default=[256, 1024, 4096],
        help="row counts (patches of one image; multiples of 4), default: 256 1024 4096 (1024: 448x448, 4096: 896x896)",
    )  # fmt: skip
    parser.add_argument("--reps", type=positive_int, default=10, help="timed calls, and forwards, each (default: 10)")
    backends = [name for name in attention_names() if name != "auto"]
    parser.add_argument("--attn", choices=backends, default="sdpa", help="attention backend (default: sdpa)")
    parser.add_argument("--out", type=output_file, help="also write the table (markdown) here")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if odd := [rows for rows in args.rows if rows % 4]:
        parser.error(f"argument --rows: {odd}: multiples of 4 (an image of an even grid) are needed")
    args.threads = apply_threads(args.threads)
    model = build(args.depth, torch.bfloat16, args.attn)
    lines = [
        f"host: {host_line()}",
        f"torch {torch.__version__}, {args.threads} threads, bf16 linears on {cpu_bf16_matmul()} kernels, "
        f"so400m-3d at depth {args.depth}, attention {args.attn}, {args.reps} reps",
        "",
        "| linear | in -> out | rows | F.linear alone TFLOP/s | block call alone TFLOP/s | in forward TFLOP/s "
        "| in forward / F.linear alone | in forward / block call alone |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for rows in args.rows:
        forward = in_forward(model, rows, args.reps)
        for name, layer in linears(cast(Block, model.encoder.blocks[0])).items():
            flop = 2 * rows * layer.in_features * layer.out_features
            plain, fused = alone(layer, EPILOGUES[name], rows, args.reps)
            rate = [flop / s / 1e12 for s in (plain, fused, forward[name])]
            lines.append(
                f"| {name} | {layer.in_features} -> {layer.out_features} | {rows} | {rate[0]:.3f} | {rate[1]:.3f} "
                f"| {rate[2]:.3f} | {rate[2] / rate[0]:.2f} | {rate[2] / rate[1]:.2f} |"
            )
            print(lines[-1], flush=True)
    write_report(args.out, "gemm_rates.py", argv, lines)


if __name__ == "__main__":
    main()

"""Does torch.compile pay for itself? Eager against compiled, same weights and packs.

    python benchmarks/bench_compile.py --depth 4 --threads 2

For each pack of ``bench_cpu.py`` (bf16, real width), prints the compile time
of ``torch.compile(model, fullgraph=True, dynamic=False)`` with a precomputed
grid, the median eager and compiled forward times (runs interleaved), their
ratio, and how many forwards it takes for the compile time to pay back.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import PACKS

from moonvit import MoonViT, preset_config
from moonvit.cli import add_threads_argument, apply_threads, positive_int


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_compile.py", description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=positive_int, default=4, help="blocks of the so400m tower (default: 4)")
    add_threads_argument(parser)
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs per pack (default: 5)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.threads = apply_threads(args.threads)
    torch.manual_seed(0)
    config = preset_config("so400m", num_hidden_layers=args.depth, attn_implementation="sdpa")
    model = MoonViT(config).to(torch.bfloat16).eval()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)

    print(f"torch {torch.__version__}, {args.threads} threads, depth {args.depth}, bf16\n")
    print("| pack | compile s | eager ms | compiled ms | compiled / eager | forwards to pay back |")
    print("|---|---|---|---|---|---|")
    for name, grid_list in PACKS.items():
        grid = model.prepare_grid(grid_list)
        pixels = torch.randn(grid.num_patches, 3, 14, 14).to(torch.bfloat16)
        with torch.inference_mode():
            start = time.perf_counter()
            compiled(pixels, grid=grid)
            compile_s = time.perf_counter() - start
            model(pixels, grid=grid)
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            for _ in range(args.repeats):
                for label, fn in (("eager", model), ("compiled", compiled)):
                    start = time.perf_counter()
                    fn(pixels, grid=grid)
                    times[label].append(time.perf_counter() - start)
        eager, comp = (statistics.median(times[k]) for k in ("eager", "compiled"))
        saving = eager - comp
        payback = f"{compile_s / saving:.0f}" if saving > 0 else "never"
        print(
            f"| {name} | {compile_s:.1f} | {eager * 1e3:.0f} | {comp * 1e3:.0f} | {comp / eager:.2f} | {payback} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

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
from common import PACKS, as_thw, host_line, write_report

from moonvit import MoonViT, preset_config
from moonvit.cli import add_threads_argument, apply_threads, output_file, positive_int

VARIANTS = {
    "compiled": {},
    # Inductor's freezing folds the weights into the graph as constants, so that oneDNN can
    # pre-pack them and fuse bias, GELU and residual adds into the matmuls.
    "compiled, freezing": {"freezing": True},
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_compile.py", description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=positive_int, default=4, help="blocks of the so400m tower (default: 4)")
    add_threads_argument(parser)
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs per pack (default: 5)")
    parser.add_argument(
        "--packs", nargs="+", choices=list(PACKS), default=list(PACKS)[:4], metavar="PACK",
        help="packs to time (default: the four image packs)",
    )  # fmt: skip
    parser.add_argument("--out", type=output_file, help="also write the table here")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.threads = apply_threads(args.threads)
    torch.manual_seed(0)
    config = preset_config("so400m-3d", num_hidden_layers=args.depth, attn_implementation="sdpa")
    model = MoonViT(config).to(torch.bfloat16).eval()

    lines = [f"host: {host_line()}", f"torch {torch.__version__}, {args.threads} threads, depth {args.depth}, bf16", ""]
    lines += ["| pack | variant | compile s | eager ms | compiled ms | compiled / eager | forwards to pay back |"]
    lines += ["|---|---|---|---|---|---|---|"]
    print("\n".join(lines))
    for name in args.packs:
        grid = model.prepare_grid(as_thw(PACKS[name]))
        pixels = torch.randn(grid.num_patches, 3, 14, 14).to(torch.bfloat16)
        for variant, options in VARIANTS.items():
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True, dynamic=False, options=options)
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
            lines.append(
                f"| {name} | {variant} | {compile_s:.1f} | {eager * 1e3:.0f} | {comp * 1e3:.0f} | {comp / eager:.2f} "
                f"| {payback} |"
            )
            print(lines[-1], flush=True)
    write_report(args.out, "bench_compile.py", argv, lines)


if __name__ == "__main__":
    main()

"""Side-by-side speed of this encoder and transformers' Kimi_K25VisionModel, and of Kimi K3's tower
and a straightforward implementation of it (k3_baseline.py).

One process, the contenders interleaved on the same weights and packs:

    python benchmarks/bench_cpu.py --depth 4 --threads 2 --out benchmarks/results/bench_cpu.md

prints the machine's matmul peak (fp32, bf16; measured warm) and ``auto``'s CPU attention choice
for this host (moonvit.model.openvino_sdpa.cpu_attention_choice), then per pack and dtype:
patches/s at --depth and scaled to 27 blocks, images/s, MFU (matmul FLOPs incl. attention over the measured
peak, scaled from --depth to the full 27 blocks by the per-block time), the
ratio to transformers, the fixed per-call cost (depth 0; this encoder runs
with its opt-in position cache on, and is also timed with its grid and
position caches cleared before every call, as for a pack never seen before)
and the peak memory a forward adds (Linux). Before the tower tables, each attention
backend (sdpa, flex, and both with head_dim 72 zero-padded to 80 and 96) is timed on
each pack's whole attention call, in GFLOP/s, beside the matmul peak. After them, the bf16
tower with its linears on bf16 kernels and widened to float32 (moonvit.model.linear), side by side,
and, where llama-cpp-python is installed, llama.cpp's encoder on the same tower's mmproj files
(benchmarks/llamacpp_check.py).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from common import (
    PACKS,
    add_attn_rows_argument,
    as_thw,
    bf16_or_fp32,
    host_line,
    matmul_peak,
    mib,
    model_flops,
    peak_extra_bytes,
    seconds,
    write_report,
)
from k3_baseline import K3Baseline

from moonvit import MoonViT, preset_config
from moonvit.cli import DTYPES, add_threads_argument, apply_threads, output_file, positive_int
from moonvit.model import flex
from moonvit.model.attention import AttentionFn, get_attention, resolve_attn_implementation
from moonvit.model.flex import flex_unavailable
from moonvit.model.grid import PackedGrid, build_packed_grid
from moonvit.model.linear import cpu_bf16_matmul, cpu_has_bf16_arithmetic, set_cpu_bf16_matmul
from moonvit.model.openvino_sdpa import OPENVINO_MIN_PATCHES, cpu_attention_choice, cpu_host, openvino_declined
from moonvit.weights.transformers import to_transformers


def build(depth: int, dtype: torch.dtype, attns: Sequence[str] = ("sdpa",)) -> dict[str, Callable]:
    """Forward callables on the same random weights: one model, its attention backend set per call.

    ``ours <attn>`` for each of ``attns`` (``ours``: the first) has the opt-in position cache on
    (fixed weights, as in a deployed encoder), ``ours_default`` runs as constructed (grid cache
    only), ``ours_new_grid`` clears every cache first (both with the first backend), ``peer`` is
    transformers'.
    """
    torch.manual_seed(0)
    config = preset_config("so400m-3d", num_hidden_layers=depth, attn_implementation=attns[0])
    model = MoonViT(config).to(dtype).eval()
    peer = to_transformers(model)
    model.set_position_cache()
    table = model.patch_embed.pos_emb

    def on(attn: str) -> Callable:
        def ours(pixels, grids):
            model.set_attn_implementation(attn)
            return model(pixels, grids).merged

        return ours

    def ours_default(pixels, grids):
        budget, table.cache_patches = table.cache_patches, 0
        try:
            return on(attns[0])(pixels, grids)
        finally:
            table.cache_patches = budget

    def ours_new_grid(pixels, grids):
        model.clear_caches()
        return on(attns[0])(pixels, grids)

    def theirs(pixels, grids):
        return peer(pixels, grids).pooler_output

    return {
        "ours": on(attns[0]),
        **{f"ours {attn}": on(attn) for attn in attns},
        "peer": theirs,
        "ours_default": ours_default,
        "ours_new_grid": ours_new_grid,
    }


def time_interleaved(contenders: dict[str, Callable], pixels, grids, repeats: int) -> dict[str, float]:
    """Median seconds per call of each contender, runs alternating between them."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with torch.inference_mode():
        for fn in contenders.values():
            fn(pixels, grids)  # warm-up
        for _ in range(repeats):
            for name, fn in contenders.items():
                times[name].append(seconds(lambda: fn(pixels, grids)))
    return {name: statistics.median(values) for name, values in times.items()}


MEMORY_PACKS = {
    "8 x 16x16": [(16, 16)] * 8,
    "32 x 16x16": [(16, 16)] * 32,
    "128 x 16x16": [(16, 16)] * 128,
    "4-frame 1080p chunk": [(4, 48, 86)],
}


def memory_scaling(contenders: dict[str, Callable]) -> list[str]:
    """Peak memory of packs of growing size, and of one 16k-patch video segment: linear in
    patches when nothing is (L, L)."""
    lines = [
        "| pack | patches | "
        + " | ".join(f"{name} peak MiB" for name in contenders)
        + " | one (L, L) bf16 score matrix, MiB |",
        "|---|---|" + "---|" * len(contenders) + "---|",
    ]
    print("\n".join(lines))
    for name, grid_list in MEMORY_PACKS.items():
        grids = as_thw(grid_list)
        patches = int(grids.prod(dim=1).sum())
        pixels = torch.randn(patches, 3, 14, 14).to(torch.bfloat16)
        with torch.inference_mode():
            for fn in contenders.values():
                fn(pixels, grids)
            peaks = [mib(peak_extra_bytes(lambda: fn(pixels, grids))) for fn in contenders.values()]
        square = patches**2 * 2 / 2**20
        lines.append(f"| {name} | {patches} | " + " | ".join(peaks) + f" | {square:.0f} |")
        print(lines[-1], flush=True)
    return lines


MATMUL_OPS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "mkldnn::_linear_pointwise")
COPY_OPS = ("aten::copy_", "aten::cat", "aten::index_select", "aten::clone", "aten::index", "aten::index_put_")


def profile_shares(fn: Callable, pixels: torch.Tensor, grids: torch.Tensor) -> dict[str, float]:
    """Share of one forward's operator self time: matmuls (fused epilogues included), attention,
    copies (dtype conversions, concatenations, gathers) and the remaining elementwise work."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        fn(pixels, grids)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(pixels, grids)
    shares = {"matmul": 0.0, "attention": 0.0, "copies": 0.0, "elementwise": 0.0}
    for event in prof.key_averages():
        if event.key.startswith(MATMUL_OPS):
            kind = "matmul"
        elif "scaled_dot_product" in event.key or "flash_attention" in event.key:
            kind = "attention"
        elif event.key in COPY_OPS:
            kind = "copies"
        else:
            kind = "elementwise"
        shares[kind] += event.self_cpu_time_total
    total = sum(shares.values()) or 1.0
    return {kind: value / total for kind, value in shares.items()}


PADDED_HEAD_DIMS = (80, 96)
"""head_dims the attention table also pads 72 to: AMX takes bf16 K in multiples of 32 (zeros change nothing)."""


def zero_padded(fn: AttentionFn, width: int) -> AttentionFn:
    """``fn`` on q, k, v padded with zeros to ``width`` channels per head (q rescaled so the softmax
    scale stays 1 / sqrt(head_dim)); the extra output channels are dropped."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: PackedGrid) -> torch.Tensor:
        head_dim = q.shape[-1]
        pad = (0, width - head_dim)
        q, k, v = F.pad(q * (width / head_dim) ** 0.5, pad), F.pad(k, pad), F.pad(v, pad)
        return fn(q, k, v, grid)[..., :head_dim]

    return attend


def attention_table(args: argparse.Namespace, dtype_key: str, heads: int, head_dim: int) -> list[str]:
    """GFLOP/s (useful FLOPs, 4 * sum(L_i^2) * heads * head_dim) of each attention backend on each pack's
    attention call as the encoder makes it, interleaved; head_dim 72 also zero-padded to 80 and 96."""
    dtype = DTYPES[dtype_key]
    contenders: dict[str, AttentionFn] = {}
    for backend in ("sdpa", "flex"):
        if backend == "flex" and flex_unavailable(torch.device("cpu"), dtype) is not None:
            continue
        contenders[backend] = get_attention(backend)
        for width in PADDED_HEAD_DIMS if head_dim == 72 else ():
            contenders[f"{backend} {head_dim}->{width}"] = zero_padded(get_attention(backend), width)
    config = preset_config("so400m-3d")
    lines = [
        f"Attention GFLOP/s ({dtype_key}, {heads} heads, head_dim {head_dim}; the whole pack's attention call, "
        "flex compiled beforehand):",
        "",
        "| pack | " + " | ".join(contenders) + " |",
        "|---|" + "---|" * len(contenders),
    ]
    print("\n".join(lines))
    for pack_name in args.packs:
        grid = build_packed_grid(as_thw(PACKS[pack_name]), config)
        q, k, v = (torch.randn(grid.num_patches, heads, head_dim).to(dtype) for _ in range(3))
        flops = 4 * heads * head_dim * sum(n * n for n in grid.seqlens)
        timed = time_interleaved({name: lambda q, g, fn=fn: fn(q, k, v, g) for name, fn in contenders.items()},
                                 q, grid, args.repeats)  # fmt: skip
        lines.append(f"| {pack_name} | " + " | ".join(f"{flops / timed[n] / 1e9:.0f}" for n in contenders) + " |")
        print(lines[-1], flush=True)
    widths = {head_dim, *(PADDED_HEAD_DIMS if head_dim == 72 else ())}
    compiles = [
        f"{key[3]}: {s:.1f} s" for key, s in flex.first_call_seconds().items() if key[1] == dtype and key[3] in widths
    ]
    if compiles:
        lines += ["", "flex's first call per head_dim (compile included; later pack sizes reuse it): "
                  + ", ".join(compiles)]  # fmt: skip
        print("\n".join(lines[-2:]))
    print()
    return [*lines, ""]


def in_bf16_mode(fn: Callable, mode: str) -> Callable:
    """``fn`` with the encoder's CPU bf16 linears in ``mode`` (``bf16`` kernels or widened to ``float32``)."""

    def call(pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        previous = set_cpu_bf16_matmul(mode)
        try:
            return fn(pixels, grids)
        finally:
            set_cpu_bf16_matmul(previous)

    return call


def bf16_linear_rows(args: argparse.Namespace) -> list[str]:
    """The bf16 K2.5 tower with its linears on bf16 kernels against widened to float32 (one rounding
    to bf16 either way), interleaved on the same weights and packs, and the two outputs' difference."""
    auto = cpu_bf16_matmul()
    hardware = "has" if cpu_has_bf16_arithmetic() else "has no"
    lines = [
        "",
        f"bf16 linears on bf16 kernels against widened to float32 (this CPU {hardware} bf16 arithmetic; "
        f"auto picks {auto}), depth {args.depth}; transformers' tower as the common yardstick:",
        "",
        "| pack | bf16 kernels patches/s | widened patches/s | widened / kernels | peer patches/s "
        "| widened / peer | relative difference |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines))
    contenders = build(args.depth, torch.bfloat16)
    modes = {
        "kernels": in_bf16_mode(contenders["ours"], "bf16"),
        "widened": in_bf16_mode(contenders["ours"], "float32"),
        "peer": contenders["peer"],
    }
    for pack_name in args.packs:
        grids = as_thw(PACKS[pack_name])
        patches = int(grids.prod(dim=1).sum())
        pixels = torch.randn(patches, 3, 14, 14).to(torch.bfloat16)
        timed = time_interleaved(modes, pixels, grids, args.repeats)
        with torch.inference_mode():
            a, b = (modes[name](pixels, grids).double() for name in ("widened", "kernels"))
        diff = float((a - b).norm() / b.norm())
        rate = {name: patches / timed[name] for name in modes}
        line = (
            f"| {pack_name} | {rate['kernels']:.0f} | {rate['widened']:.0f} | {rate['widened'] / rate['kernels']:.2f}x "
            f"| {rate['peer']:.0f} | {rate['widened'] / rate['peer']:.2f}x | {diff:.1e} |"
        )
        print(line, flush=True)
        lines.append(line)
    return lines


LLAMA_PACKS = {"448x448 (32x32)": (448, 448), "896x896 (64x64)": (896, 896)}
"""The single-photo packs llama.cpp also encodes (its preprocessing keeps these sizes as they are)."""


def llamacpp_rows(args: argparse.Namespace) -> list[str]:
    """Seconds per photo of llama.cpp's encoder on this K2.5 tower's mmproj files (f16, f32) beside this
    package's bf16 and fp32 processor, tower and projector, at ``--depth``, interleaved; where
    llama-cpp-python with ``mtmd`` is installed."""
    import tempfile
    from pathlib import Path

    from llamacpp import llama_cpp_available, write_text_stub
    from llamacpp_check import SPEED_HEADER, TEXT_WIDTH, Ours, family_models, open_llamas, photos, speed_rows

    sizes = [LLAMA_PACKS[name] for name in args.packs if name in LLAMA_PACKS]
    unavailable = llama_cpp_available()
    if unavailable or not sizes:
        line = f"llama.cpp rows skipped: {unavailable or 'no single-photo pack among --packs'}"
        print(line)
        return ["", line]
    lines = ["", f"llama.cpp's encoder (llama-cpp-python, kimik25 mmproj of this tower, flash attention on) "
             f"against this package, depth {args.depth}, seconds per photo (median of {args.repeats}):", "",
             *SPEED_HEADER]  # fmt: skip
    print("\n".join(lines), flush=True)
    encoder, projector, processor = family_models("k25", args.depth, seed=0)
    contenders = {name: Ours(encoder, projector, processor, dtype)
                  for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        llamas = open_llamas(encoder, projector, processor, work, write_text_stub(work / "text.gguf", TEXT_WIDTH),
                             args.threads)  # fmt: skip
        try:
            rows = speed_rows("k25", photos(sizes), llamas, contenders, args.repeats)
        finally:
            for llama in llamas.values():
                llama.close()
    print("\n".join(rows), flush=True)
    return [*lines, *rows]


def build_k3(depth: int, dtype: torch.dtype) -> dict[str, Callable]:
    """Kimi K3's tower (moonvit-v2 at ``depth`` blocks, random weights) and the straightforward peer
    (:class:`k3_baseline.K3Baseline`) on the same weights."""
    torch.manual_seed(0)
    model = MoonViT(preset_config("moonvit-v2", num_hidden_layers=depth, attn_implementation="sdpa")).to(dtype).eval()
    peer = K3Baseline(model).eval()
    model.set_position_cache()
    return {"ours": lambda pixels, grids: model(pixels, grids).merged, "peer": peer}


def k3_rows(args: argparse.Namespace, peak: float) -> list[str]:
    """bf16 rows of Kimi K3's tower against the plain per-segment peer, as the K2.5 table."""
    cfg = preset_config("moonvit-v2")
    lines = [
        "",
        f"Kimi K3 (MoonViT-V2: 27 x 1024, attention 1536, 12 heads of 128, RMSNorm, no biases), bf16, depth "
        f"{args.depth}, against a straightforward implementation (benchmarks/k3_baseline.py: packed linears, "
        "one SDPA call per item):",
        "",
    ]
    print("\n".join(lines))
    lines += attention_table(args, "bf16", heads=12, head_dim=128)
    lines += [
        "| pack | ours patches/s | peer patches/s | ratio | ours patches/s @27 | ours MFU | peer MFU "
        "| ours fixed ms | peer fixed ms | max rel diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines[-3:]))
    full, empty = build_k3(args.depth, torch.bfloat16), build_k3(0, torch.bfloat16)
    for pack_name in args.packs:
        grid_list = PACKS[pack_name]
        grids = as_thw(grid_list)
        patches = int(grids.prod(dim=1).sum())
        pixels = torch.randn(patches, 3, 14, 14).to(torch.bfloat16)
        timed = time_interleaved(full, pixels, grids, args.repeats)
        fixed = time_interleaved(empty, pixels, grids, args.repeats)
        with torch.inference_mode():
            a, b = (fn(pixels, grids).double() for fn in full.values())
        diff = float((a - b).norm() / b.norm())
        rates = {}
        for name in ("ours", "peer"):
            per_block = max(timed[name] - fixed[name], 1e-9) / max(args.depth, 1)
            full_time = fixed[name] + cfg.num_hidden_layers * per_block
            rates[name] = (patches / timed[name], model_flops(grid_list, cfg) / full_time / peak, full_time)
        ours, peer = rates["ours"], rates["peer"]
        line = (
            f"| {pack_name} | {ours[0]:.0f} | {peer[0]:.0f} | {ours[0] / peer[0]:.2f}x | {patches / ours[2]:.0f} | "
            f"{ours[1]:.0%} | {peer[1]:.0%} | {fixed['ours'] * 1e3:.1f} | {fixed['peer'] * 1e3:.1f} | {diff:.1e} |"
        )
        print(line, flush=True)
        lines.append(line)
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_cpu.py", description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=positive_int, default=4, help="blocks to run; MFU is scaled to 27 (default: 4)")
    add_threads_argument(parser)
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs per contender (default: 5)")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        type=bf16_or_fp32,
        default=["bf16", "fp32"],
        help="dtypes to time: bf16, fp32 (default: both)",
    )
    parser.add_argument(
        "--packs", nargs="+", choices=list(PACKS), default=list(PACKS), metavar="PACK",
        help=f"packs to time (default: all): {', '.join(repr(p) for p in PACKS)}",
    )  # fmt: skip
    parser.add_argument("--out", type=output_file, help="also write the tables (markdown) here")
    parser.add_argument("--no-extras", action="store_true", help="skip the memory-scaling and profile tables")
    parser.add_argument(
        "--attention",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the attention backends (sdpa, flex, head_dim padded) on each pack's attention call (default: on)",
    )
    add_attn_rows_argument(parser, "sdpa")
    parser.add_argument(
        "--widened",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time bf16 linears widened to float32 against the bf16 kernels (default: on)",
    )
    parser.add_argument(
        "--llamacpp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time llama.cpp's encoder on the 448x448 and 896x896 packs where llama-cpp-python is installed "
        "(default: on)",
    )
    parser.add_argument(
        "--towers",
        nargs="+",
        choices=("k25", "k3"),
        default=["k25", "k3"],
        help="k25: the K2.5 tower against transformers (--dtypes); k3: Kimi K3's tower against a plain "
        "implementation (bf16) (default: both)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.threads = apply_threads(args.threads)
    cfg = preset_config("so400m")

    lines = [
        f"host: {host_line()}",
        f"torch {torch.__version__}, {args.threads} threads, depth {args.depth} (MFU scaled to 27 blocks)",
        "",
    ]
    host = cpu_host()
    declined = openvino_declined(host, torch.bfloat16)
    lines += [
        f"auto's attention for bf16 items of {OPENVINO_MIN_PATCHES:,} patches or more here: "
        f"{cpu_attention_choice(host, torch.bfloat16, OPENVINO_MIN_PATCHES)} "
        f"({declined or 'AVX512-BF16 without AMX, OpenVINO installed'})",
        "",
    ]
    peaks = {name: matmul_peak(DTYPES[name]) for name in ("bf16", "fp32")}  # warm: see moonvit.perf
    lines += ["matmul peak 4096^3 (warm): " + ", ".join(f"{n} {p / 1e9:.0f} GFLOP/s" for n, p in peaks.items())]
    # MFU divides by the peak of the arithmetic the linears run: float32's where bf16 is widened.
    mfu_peak = {"fp32": peaks["fp32"], "bf16": peaks["fp32" if cpu_bf16_matmul() == "float32" else "bf16"]}
    if cpu_bf16_matmul() == "float32":
        lines.append("bf16 linears run widened to float32 on this CPU (moonvit.model.linear): bf16 MFU is "
                     "against the fp32 peak")  # fmt: skip
    lines.append("")
    print("\n".join(lines))
    if "k25" in args.towers:
        for dtype_key in args.dtypes if args.attention else ():
            lines += attention_table(args, dtype_key, heads=16, head_dim=72)
        header = [
            "Kimi-K2.5 tower (27 x 1152) against transformers' Kimi_K25VisionModel:",
            "",
            "| pack | dtype | ours attention | ours patches/s | peer patches/s | ratio | ours patches/s @27 "
            "| peer patches/s @27 | ours items/s @27 | ours MFU | peer MFU | ours fixed ms "
            "| ours fixed ms, no position cache | ours fixed ms, new grid | peer fixed ms | fixed ratio "
            "| ours peak MiB | peer peak MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        print("\n".join(header))
        lines += header
    for dtype_key in args.dtypes if "k25" in args.towers else ():
        dtype = DTYPES[dtype_key]
        # ours once per --attn (interleaved in one run, one model), one peer
        ours_names = [f"ours {attn}" for attn in args.attn]
        contenders, empties = build(args.depth, dtype, args.attn), build(0, dtype, args.attn)
        full = {name: contenders[name] for name in (*ours_names, "peer")}
        empty = {name: empties[name] for name in (*ours_names, "peer", "ours_default", "ours_new_grid")}
        for pack_name in args.packs:
            grid_list = PACKS[pack_name]
            grids = as_thw(grid_list)
            patches = int(grids.prod(dim=1).sum())
            pixels = torch.randn(patches, 3, 14, 14).to(dtype)
            timed = time_interleaved(full, pixels, grids, args.repeats)
            fixed = time_interleaved(empty, pixels, grids, args.repeats)
            with torch.inference_mode():
                peak = {name: peak_extra_bytes(lambda: fn(pixels, grids)) for name, fn in full.items()}
            row = {}
            for name in full:
                per_block = max(timed[name] - fixed[name], 1e-9) / max(args.depth, 1)
                full_time = fixed[name] + cfg.num_hidden_layers * per_block
                flops = model_flops(grid_list, cfg)
                mfu = flops / full_time / mfu_peak[dtype_key]
                row[name] = (patches / timed[name], mfu, fixed[name] * 1e3, full_time)
            peer = row["peer"]
            for attn in args.attn:
                ours = row[f"ours {attn}"]
                resolved = resolve_attn_implementation(attn, torch.device("cpu"), dtype)
                label = attn if resolved == attn else f"{attn} ({resolved})"
                line = (
                    f"| {pack_name} | {dtype_key} | {label} | {ours[0]:.0f} | {peer[0]:.0f} | "
                    f"{ours[0] / peer[0]:.2f}x | "
                    f"{patches / ours[3]:.0f} | {patches / peer[3]:.0f} | {len(grid_list) / ours[3]:.2f} | "
                    f"{ours[1]:.0%} | {peer[1]:.0%} | {ours[2]:.1f} | {fixed['ours_default'] * 1e3:.1f} | "
                    f"{fixed['ours_new_grid'] * 1e3:.1f} | {peer[2]:.1f} | {ours[2] / peer[2]:.2f} | "
                    f"{mib(peak[f'ours {attn}'])} | {mib(peak['peer'])} |"
                )
                print(line, flush=True)
                lines.append(line)
    if "k25" in args.towers and "bf16" in args.dtypes and args.widened:
        lines += bf16_linear_rows(args)
    if "k25" in args.towers and args.llamacpp:
        lines += llamacpp_rows(args)
    if "k3" in args.towers:
        lines += k3_rows(args, mfu_peak["bf16"])
    if not args.no_extras and "k25" in args.towers:
        contenders = build(args.depth, torch.bfloat16)
        ours, peer = contenders["ours"], contenders["peer"]
        lines += ["", f"Peak memory a bf16 forward adds (depth {args.depth}):", ""]
        print("\n".join(lines[-3:]))
        lines += memory_scaling({"ours": ours, "peer": peer})
        header = ["", "Where this encoder's bf16 time goes (operator self time, one forward):", ""]
        header += ["| pack | matmul | attention (SDPA) | copies | elementwise |", "|---|---|---|---|---|"]
        print("\n".join(header))
        lines += header
        for pack_name in args.packs:
            grids = as_thw(PACKS[pack_name])
            pixels = torch.randn(int(grids.prod(dim=1).sum()), 3, 14, 14).to(torch.bfloat16)
            share = profile_shares(ours, pixels, grids)
            line = f"| {pack_name} | " + " | ".join(f"{share[kind]:.0%}" for kind in share) + " |"
            print(line, flush=True)
            lines.append(line)
    write_report(args.out, "bench_cpu.py", argv, lines)


if __name__ == "__main__":
    main()

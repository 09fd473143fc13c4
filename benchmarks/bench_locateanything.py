"""LocateAnything-3B's vision tower: this package's attention against the stock remote code's, on CPU.

LocateAnything-3B (nvidia/LocateAnything-3B) encodes images with Kimi-VL's MoonViT (27 blocks x 1152,
16 heads of 72, MLP 4304: this package's ``so400m`` preset). Without flash-attn, its remote
``modeling_vit.py`` runs each block's attention as ONE ``F.scaled_dot_product_attention`` call over the
whole packed sequence of S patches, with a dense (1, S, S) boolean block mask built in every block
(``torch.zeros([1, S, S], dtype=torch.bool)``, then True on each image's diagonal block) and q, k, v
as 3-D (heads, S, head_dim). PyTorch's fused SDPA kernels take only 4-D inputs, so that call falls to
the math path, which materialises the (heads, S, S) scores in float32 (about 150 bytes per S^2
measured on CPU, fp32 and bf16 alike). Its users report it ~10x slower than per-image attention on GPU
and out of memory at the release's 25,600-patch limit even on an 80 GB H100.

This program times, in one process and on the same random weights at full width:

- ``ours``: ``encoder(pixel_values, grid_hws)`` with ``attn_implementation="auto"`` (on CPU, sdpa: one
  4-D SDPA call per group of equally long images, no mask, nothing (S, S) kept; in bf16 on a CPU with
  bf16 arithmetic where OpenVINO is installed, its attention for items of 1,024 patches or more, and
  then ``ours sdpa`` is timed beside it);
- ``stock``: the same encoder with its attention swapped for the stock function above (registered
  as an attention backend, so the patch embedding, position table, RoPE, MLP and merger are the
  same code on both sides, and the ratio measures the attention choice alone);

on one image each: 448x448 (grid 32x32), 1024x768 as LocateAnything's processor gives it
(stretched to multiples of 28: 1036x784, grid 56 rows x 74 cols) and 2240x2240 (grid 160x160, the
25,600-patch limit), in fp32 and bf16. Per cell: median seconds per forward, seconds per block,
the peak resident memory a forward adds, the ratio stock / ours and the relative difference of the two
merged outputs (the same math: a small difference shows it is equal work).

One block's attention at 25,600 patches is ~3 TFLOP, so the forward runs ``--depth`` blocks (default
2) with the patch embedding, position table, final norm and merger included once; seconds per block
is (forward - the same forward at depth 0) / depth. Before a cell runs, each contender's peak is
estimated from its peaks at 1,024 and 2,304 patches (a * S^2 + b * S, never below the stock path's
(heads, S, S) float32 scores); a cell over ``--max-gib`` (or 80 % of the memory available now) is
skipped with its estimate: the stock path at the limit needs ~90 GiB (fp32 or bf16), so it is skipped
on any ordinary machine.

    python benchmarks/bench_locateanything.py --threads 2 --depth 2
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from common import host_line, mib, peak_extra_bytes, relative_error, seconds, write_report

from moonvit import MoonViT, MoonViTImageProcessor, preset_config
from moonvit.cli import DTYPES, apply_threads, dtype_name, output_file, positive_int
from moonvit.model.attention import register_attention, resolve_attn_implementation
from moonvit.model.grid import PackedGrid

PATCH = 14
TOKEN_LIMIT = 25_600
"""LocateAnything's ``in_token_limit`` (preprocessor_config.json), in 14x14 patches."""

SIZES: dict[str, tuple[int, int]] = {"448": (448, 448), "1024x768": (1024, 768), "limit": (2240, 2240)}
"""The images, (width, height) in pixels before LocateAnything's processor."""

BIG = 8192
"""Items over this many patches get ``--big-repeats`` timed runs and no warm-up run."""

CALIBRATION = ((32, 32), (48, 48))
"""Grids whose measured peaks give each contender's memory estimate for larger cells."""

MAX_DEPTH = 27
STOCK = "locateanything_stock_sdpa"
SDPA = "ours sdpa"


def locateanything_grid(width: int, height: int) -> tuple[int, int]:
    """(rows, cols) of patches LocateAnything's processor gives a width x height image: scaled down
    (bicubic, int truncation) when over the token limit, then stretched up to multiples of 28."""
    rows, cols = MoonViTImageProcessor.locateanything(in_token_limit=TOKEN_LIMIT).plan_image(width, height).grid_hw
    return rows, cols


def stock_sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: PackedGrid) -> torch.Tensor:
    """``sdpa_attention`` of LocateAnything's / Kimi-VL's ``modeling_vit.py``, as it runs without flash-attn:
    a dense boolean block mask over the whole pack, built in every call, and one 3-D SDPA call.

    Args:
        q, k, v: (S, heads, head_dim), as this package's blocks pass them.

    Returns:
        (S, heads, head_dim): the stock (S, heads * head_dim) output, viewed per head for the block.
    """
    seq_length, heads, head_dim = q.shape
    cu_seqlens = grid.cu_seqlens
    attention_mask = torch.zeros([1, seq_length, seq_length], device=q.device, dtype=torch.bool)
    for i in range(1, len(cu_seqlens)):
        attention_mask[..., cu_seqlens[i - 1] : cu_seqlens[i], cu_seqlens[i - 1] : cu_seqlens[i]] = True
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    attn_output = F.scaled_dot_product_attention(q, k, v, attention_mask, dropout_p=0.0)
    attn_output = attn_output.transpose(0, 1).reshape(seq_length, -1)
    return attn_output.view(seq_length, heads, head_dim)


def csv_choices(choices: Callable[[str], str], allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type for a comma-separated list of ``allowed`` names (each passed through ``choices``)."""

    def parse(text: str) -> list[str]:
        names = [choices(part) for part in text.split(",") if part.strip()]
        wrong = [name for name in names if name not in allowed]
        if not names or wrong:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (comma-separated), got {text!r}")
        return names

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/bench_locateanything.py", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument(
        "--sizes",
        type=csv_choices(str.strip, tuple(SIZES)),
        default=list(SIZES),
        help="images, comma-separated: 448 (32x32), 1024x768 (56x74), limit (160x160) (default: all)",
    )
    parser.add_argument(
        "--dtypes",
        type=csv_choices(dtype_name, ("fp32", "bf16")),
        default=["fp32", "bf16"],
        help="dtypes, comma-separated: fp32, bf16 (default: both)",
    )
    parser.add_argument("--depth", type=positive_int, default=2, help="blocks per forward, 1 to 27 (default: 2)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per contender (default: 3)")
    parser.add_argument(
        "--big-repeats",
        type=positive_int,
        default=1,
        help=f"timed runs per contender for items over {BIG} patches, without warm-up (default: 1)",
    )
    parser.add_argument("--threads", type=positive_int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument(
        "--max-gib",
        type=float,
        default=12.0,
        help="skip a cell whose estimated peak exceeds this many GiB (default: 12; 80%% of the memory "
        "available at that moment caps it further)",
    )
    parser.add_argument(
        "--out",
        type=output_file,
        default=Path("benchmarks/results/bench_locateanything.md"),
        help="write the report (markdown) here (default: benchmarks/results/bench_locateanything.md)",
    )
    return parser


Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def contenders(model: MoonViT, implementations: dict[str, str]) -> dict[str, Forward]:
    """Forward callables of ``model`` (shared weights), each with its attention backend switched in first."""

    def forward_with(implementation: str) -> Forward:
        def forward(pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
            model.set_attn_implementation(implementation)
            merged = model(pixels, grids).merged
            assert merged is not None
            return merged

        return forward

    return {name: forward_with(implementation) for name, implementation in implementations.items()}


def build(depth: int, dtype: torch.dtype) -> tuple[MoonViT, MoonViT]:
    """The ``so400m`` tower at ``depth`` blocks (random weights) and the same tower at depth 0
    (its patch embedding, position table and final norm), for the fixed per-forward cost."""
    torch.manual_seed(0)
    model = MoonViT(preset_config("so400m", num_hidden_layers=depth)).to(dtype).eval()
    empty = MoonViT(preset_config("so400m", num_hidden_layers=0)).to(dtype).eval()
    empty.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("encoder.blocks.")})
    return model, empty


def inputs(grid: tuple[int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random normalised pixels (S, 3, 14, 14) of one image of ``grid`` patches, and its (1, 2) grid_hws."""
    rows, cols = grid
    generator = torch.Generator().manual_seed(rows * 1000 + cols)
    pixels = torch.randn(rows * cols, 3, PATCH, PATCH, generator=generator).clamp(-1, 1).to(dtype)
    return pixels, torch.tensor([[rows, cols]])


@dataclass
class MemoryFit:
    """Peak bytes a forward adds, as ``quadratic * S^2 + linear * S`` (S: patches)."""

    quadratic: float
    linear: float
    floor_per_s2: float = 0.0

    def bytes(self, patches: int) -> float:
        return max(self.quadratic, self.floor_per_s2) * patches**2 + self.linear * patches


def fit_memory(forward: Forward, dtype: torch.dtype, floor_per_s2: float) -> MemoryFit:
    """Fit the peaks of ``forward`` at the :data:`CALIBRATION` grids; conservative where they are noisy."""
    points = []
    with torch.inference_mode():
        for grid in CALIBRATION:
            pixels, grids = inputs(grid, dtype)
            forward(pixels, grids)
            peak = peak_extra_bytes(lambda: forward(pixels, grids))
            points.append((grid[0] * grid[1], float(peak or 0)))
    (s1, p1), (s2, p2) = points
    quadratic = (p2 / s2 - p1 / s1) / (s2 - s1)
    linear = p1 / s1 - quadratic * s1
    if quadratic < 0:
        quadratic, linear = 0.0, max(p1 / s1, p2 / s2)
    elif linear < 0:
        quadratic, linear = p2 / s2**2, 0.0
    return MemoryFit(quadratic, linear, floor_per_s2)


def memory_available() -> float:
    """MemAvailable from /proc/meminfo, in bytes (infinity where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return math.inf


@dataclass
class Measured:
    seconds: float
    peak: int | None
    output: torch.Tensor


def measure(runs: dict[str, Callable[[], torch.Tensor]], repeats: int, warm_up: bool) -> dict[str, Measured]:
    """Median seconds of each run, interleaved; the first timed run of each also gives its peak memory."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    outputs: dict[str, torch.Tensor] = {}
    peaks: dict[str, int | None] = {}
    with torch.inference_mode():
        if warm_up:
            for run in runs.values():
                run()
        for repeat in range(repeats):
            for name, run in runs.items():

                def timed(name: str = name, run: Callable[[], torch.Tensor] = run) -> None:
                    times[name].append(seconds(lambda: outputs.__setitem__(name, run())))

                if repeat == 0:
                    count = len(times[name])
                    peaks[name] = peak_extra_bytes(timed)
                    if len(times[name]) == count:  # no peak reading here: the run did not happen
                        timed()
                else:
                    timed()
    return {name: Measured(statistics.median(times[name]), peaks[name], outputs[name]) for name in runs}


def table_row(
    first: list[str],
    names: dict[str, str],
    measured: dict[str, Measured],
    fixed: Measured,
    depth: int,
    skipped: dict[str, str],
    sdpa_column: bool,
) -> str:
    """One table row: ``first`` cells, then per contender seconds, seconds per block and peak, with
    the stock / ours ratios (and ours sdpa / ours per block with ``sdpa_column``) and the outputs'
    relative difference (n/a where a contender was skipped)."""
    per_block = {name: max(m.seconds - fixed.seconds, 0.0) / depth for name, m in measured.items()}
    both = "ours" in measured and "stock" in measured
    ratio = block_ratio = diff = "n/a"
    if both:
        ours, stock = measured["ours"], measured["stock"]
        ratio = f"{stock.seconds / ours.seconds:.2f}x"
        block_ratio = f"{per_block['stock'] / per_block['ours']:.2f}x" if per_block["ours"] > 0 else "n/a"
        diff = f"{relative_error(ours.output, stock.output):.1e}"
    cells = [*first]
    cells += [f"{measured[n].seconds:.2f}" if n in measured else skipped[n] for n in names] + [ratio]
    cells += [f"{per_block[n]:.2f}" if n in measured else skipped[n] for n in names] + [block_ratio]
    if sdpa_column:
        sdpa_ratio = "n/a"
        if SDPA in measured and "ours" in measured and per_block["ours"] > 0:
            sdpa_ratio = f"{per_block[SDPA] / per_block['ours']:.2f}x"
        cells.append(sdpa_ratio)
    cells += [mib(measured[n].peak) if n in measured else skipped[n] for n in names] + [diff]
    return "| " + " | ".join(cells) + " |"


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.depth > MAX_DEPTH:
        parser.error(f"--depth: the tower has {MAX_DEPTH} blocks, got {args.depth}")
    threads = apply_threads(args.threads)
    register_attention(STOCK, stock_sdpa_attention)
    config = preset_config("so400m")
    heads = config.num_attention_heads
    auto = {name: resolve_attn_implementation("auto", torch.device("cpu"), DTYPES[name]) for name in args.dtypes}
    extra_sdpa = any(choice != "sdpa" for choice in auto.values())
    implementations = {"ours": "auto", **({SDPA: "sdpa"} if extra_sdpa else {}), "stock": STOCK}

    grids = {name: locateanything_grid(*SIZES[name]) for name in args.sizes}
    lines = [
        f"host: {host_line()}",
        f"torch {torch.__version__}, {threads} threads; tower so400m (LocateAnything-3B / Kimi-VL MoonViT): "
        f"{config.hidden_size} wide, {heads} heads of {config.head_dim}, MLP {config.intermediate_size}, "
        f"random weights shared by both sides",
        "",
        f"Per-forward figures are at depth {args.depth} (of 27) with the patch embedding, position table, final "
        "norm and merger included once; s/block = (forward - forward at depth 0) / depth, the fixed part "
        "measured once per cell. Timed runs interleaved, median of "
        f"{args.repeats} after a warm-up ({args.big_repeats} without warm-up over {BIG} patches).",
        "ours: attn_implementation auto -> "
        + ", ".join(f"{choice} ({name})" for name, choice in auto.items())
        + (" (sdpa shown too)" if extra_sdpa else "")
        + "; stock: modeling_vit.py's sdpa_attention (dense (1, S, S) bool mask built per block, one 3-D "
        "SDPA call over the pack: PyTorch's math path), the rest of the tower the same code.",
        "peak MiB: resident memory one forward adds at its peak (Linux). rel diff: |ours - stock| / |stock| "
        "of the merged outputs.",
        "",
    ]
    columns = ["size", "patches", "dtype", *(f"{name} s" for name in implementations), "stock/ours",
               *(f"{name} s/block" for name in implementations), "stock/ours per block",
               *(["sdpa/ours per block"] if extra_sdpa else []),
               *(f"{name} peak MiB" for name in implementations), "rel diff"]  # fmt: skip
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    notes: list[str] = []
    print("\n".join(lines + table), flush=True)

    for dtype_key in args.dtypes:
        dtype = DTYPES[dtype_key]
        model, empty = build(args.depth, dtype)
        # "ours sdpa" is timed only where auto is something else for this dtype
        same_as_ours = auto[dtype_key] == "sdpa"
        forwards = contenders(model, {n: i for n, i in implementations.items() if not (same_as_ours and n == SDPA)})
        fixed_forward = contenders(empty, {"fixed": "sdpa"})["fixed"]
        largest = max(rows * cols for rows, cols in grids.values())
        fits: dict[str, MemoryFit] = {}
        if largest > CALIBRATION[-1][0] * CALIBRATION[-1][1]:
            scores_per_s2 = heads * 4.0 + 1  # the (heads, S, S) float32 scores and the bool mask
            fits = {name: fit_memory(fn, dtype, scores_per_s2 if name == "stock" else 0.0)
                    for name, fn in forwards.items()}  # fmt: skip
            fit_text = ", ".join(
                f"{name} {fit.quadratic:.0f} B * S^2 + {fit.linear / 2**10:.0f} KiB * S" for name, fit in fits.items()
            )
            notes.append(f"{dtype_key} memory estimate, fitted at 1,024 and 2,304 patches: {fit_text}.")
            print(notes[-1], flush=True)

        for size in args.sizes:
            rows, cols = grids[size]
            patches = rows * cols
            width, height = SIZES[size]
            label = f"{width}x{height} ({rows}x{cols})" if (cols * PATCH, rows * PATCH) == (width, height) else (
                f"{width}x{height} -> {cols * PATCH}x{rows * PATCH} ({rows}x{cols})")  # fmt: skip
            pixels, grid_hws = inputs((rows, cols), dtype)
            allowed = min(args.max_gib * 2**30, 0.8 * memory_available())
            runs: dict[str, Callable[[], torch.Tensor]] = {}
            skipped: dict[str, str] = {SDPA: "= ours"} if same_as_ours else {}
            for name, fn in forwards.items():
                estimate = fits[name].bytes(patches) if name in fits else 0.0
                if estimate > allowed:
                    skipped[name] = f"skipped: est. {gib(estimate)}"
                    notes.append(
                        f"{label}, {dtype_key}: {name} not run: its peak is estimated at {gib(estimate)}, over the "
                        f"{gib(allowed)} allowed (--max-gib {args.max_gib:g}, at most 80 % of the memory available)."
                    )
                    print(notes[-1], flush=True)
                else:
                    runs[name] = functools.partial(fn, pixels, grid_hws)
            big = patches > BIG
            repeats = args.big_repeats if big else args.repeats
            measured = measure(runs, repeats, warm_up=not big)
            fixed = measure({"fixed": lambda: fixed_forward(pixels, grid_hws)}, args.repeats, warm_up=True)["fixed"]
            table.append(table_row([label, str(patches), dtype_key], implementations, measured, fixed, args.depth,
                                   skipped, extra_sdpa))  # fmt: skip
            print(table[-1], flush=True)

    lines += table
    if notes:
        lines += ["", *notes]
    write_report(args.out, "bench_locateanything.py", argv, lines)


if __name__ == "__main__":
    main()
